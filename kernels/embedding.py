"""Embedding gather: out[t] = table[ids[t]] for a few token ids held on the device.

The ids are read inside the kernel (no host round-trip), so the decode step can sit in a CUDA
graph and be replayed with a new token id written into the same device buffer.

PyTorch reference: kernels/reference.py, section "embedding": embedding_gather_ref.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, cdiv, check_pdl, launch_kw, next_pow2, pdl_start, pdl_wait



@triton.jit
def _embedding_gather_kernel(ids_ptr, table_ptr, out_ptr, D, BLOCK_D: tl.constexpr,
                             PDL: tl.constexpr):
    # program (t, d-block): copy one slice of row ids[t]
    pdl_start(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = offs < D
    row = tl.load(ids_ptr + t).to(tl.int64)
    vals = tl.load(table_ptr + row * D + offs, mask=m, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * D + offs, vals.to(out_ptr.dtype.element_ty), mask=m)


def embedding_gather(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor, *,
                     pdl: int = 0) -> torch.Tensor:
    """out[t, :] = table[ids[t], :]; ids int32/int64 [T] (or a scalar-shaped [1]) on the device,
    table [V, D] contiguous, out [T, D] contiguous. Ids must lie in [0, V): they are not read
    on the host, so they cannot be checked here. `pdl`: see _common.pdl_mode. Returns out."""
    pdl = check_pdl(pdl, "embedding_gather")
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
        raise ValueError(f"embedding_gather: ids must be a 1-D int32/int64 tensor, got "
                         f"{ids.dtype} {tuple(ids.shape)}")
    if table.dim() != 2 or not table.is_contiguous() or table.dtype not in FLOAT_DTYPES:
        raise ValueError("embedding_gather: table must be a contiguous [V, D] float matrix")
    T = ids.numel()
    D = table.shape[1]
    if out.numel() != T * D or not out.is_contiguous() or out.dtype not in FLOAT_DTYPES:
        raise ValueError(f"embedding_gather: out must be a contiguous [{T}, {D}] float tensor, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if not (ids.device == table.device == out.device):
        raise ValueError("embedding_gather: ids, table and out must be on one device")
    if T == 0:
        return out
    block_d = min(1024, next_pow2(D))
    _embedding_gather_kernel[(T, cdiv(D, block_d))](
        ids, table, out, D, BLOCK_D=block_d, PDL=pdl, num_warps=4,
        **launch_kw(pdl))
    return out
