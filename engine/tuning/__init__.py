"""Tuners that measure the kernels' launch plans on the GPU and write the tables kernels/ reads
(decode: decode_tuning.json, prefill: prefill_tuning.json)."""


def model_config(model=None):
    """The text config the tuners measure the shapes of: a model folder's (--model DIR), else
    Qwen3.5-0.8B's."""
    from tritonchat.engine.config import load_config, qwen35_08b_config
    return load_config(model) if model else qwen35_08b_config()
