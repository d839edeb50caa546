"""Tuners that measure the kernels' launch plans on the GPU and write the tables kernels/ reads
(decode: decode_tuning.json, prefill: prefill_tuning.json)."""
