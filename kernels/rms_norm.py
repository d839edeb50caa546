"""Zero-centred RMSNorm (Qwen3.5 `input_layernorm`, `post_attention_layernorm`, final `norm`):

    y = x * rsqrt(mean(x^2) + eps) * (1 + w)        fp32 math, one rounding to out.dtype

One program per row (the row is at most a few thousand wide, so it lives in registers). The
prefill launches it; in the decode step the norms are GEMV prologues (kernels/gemv.py).

PyTorch reference: kernels/reference.py, section "rms_norm": rms_norm_ref.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_pdl, launch_kw, next_pow2, pdl_start, pdl_wait


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64) * D
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)     # a weight: before the wait
    pdl_wait(PDL)
    x = tl.load(x_ptr + row + offs, mask=m, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(out_ptr + row + offs, (x * inv_rms * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=m)


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, name: str) -> int:
    if x.dim() not in (1, 2) or not x.is_contiguous() or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: x must be a contiguous [T, D] or [D] float tensor")
    D = x.shape[-1]
    if w.dim() != 1 or w.numel() != D or not w.is_contiguous() or w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: w must be a contiguous [{D}] float vector")
    if out.numel() != x.numel() or not out.is_contiguous() or out.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: out must be a contiguous float tensor with x's "
                         f"{x.numel()} elements, got {tuple(out.shape)}")
    if not (x.device == w.device == out.device):
        raise ValueError(f"{name}: tensors must be on one device")
    if D > 65536:
        raise ValueError(f"{name}: rows wider than 65536 are not supported (got {D})")
    return D


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor, *,
             pdl: int = 0) -> torch.Tensor:
    """out = x * rsqrt(mean(x^2) + eps) * (1 + w) per row of x [T, D] or [D]; out holds as
    many elements (e.g. [D] for a [1, D] x). `pdl`: see _common.pdl_mode (the norm weights are
    read before the wait). Returns out."""
    pdl = check_pdl(pdl, "rms_norm")
    D = _check(x, w, out, "rms_norm")
    rows = x.numel() // D
    if rows == 0:
        return out
    block_d = next_pow2(D)
    num_warps = 4 if block_d <= 2048 else (8 if block_d <= 8192 else 16)
    _rms_norm_kernel[(rows,)](x, w, out, D, float(eps), BLOCK_D=block_d, PDL=pdl,
                              num_warps=num_warps, **launch_kw(pdl))
    return out
