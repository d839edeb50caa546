"""A pure streaming read for the bandwidth roofline, and the read-rate measurement the bench and
the tuner both use.

`row_sums` reads a [R, C] matrix once in tiles of whole rows (the access pattern of our decode
GEMVs at their best) and writes one fp32 sum per row, so no load can be dropped. On the H200 it
reads faster than `torch.sum` over the same bytes (4.4 against 4.0-4.1 TB/s), so the bench takes
the faster of the two (`read_rates_gb_s`) as the HBM read rate the decode roofline is measured
against.

PyTorch reference: torch.sum over the rows (the tests compare with it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, next_pow2

ROW_SUMS_BLOCK_R = 8          # rows a program reads (8 x 1024 bf16 = 16 KB a program)


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=m, other=0.0)
    tl.store(out_ptr + rows, tl.sum(x.to(tl.float32), axis=1), mask=rows < R)


def row_sums(x: torch.Tensor, out: torch.Tensor, *, block_r: int = ROW_SUMS_BLOCK_R,
             num_warps: int = 4) -> torch.Tensor:
    """out[r] = sum(x[r, :]) in fp32 for a contiguous 2-D x (rows of at most 4,096); out
    float32 [R]. Returns out."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError("row_sums: x must be a contiguous 2-D matrix")
    R, C = x.shape
    if not 1 <= C <= 4096:
        raise ValueError(f"row_sums: rows of 1..4096 elements, got {C}")
    if out.numel() != R or out.dtype != torch.float32 or out.device != x.device:
        raise ValueError(f"row_sums: out must be float32 [{R}] on x's device")
    _row_sums_kernel[(cdiv(R, block_r),)](x, out, R, C, BLOCK_R=block_r,
                                          BLOCK_C=next_pow2(C), num_warps=num_warps)
    return out


def read_rates_gb_s(nbytes: int, device, reps: int = 20) -> dict:
    """Read bandwidth in GB/s of one pass over an nbytes bf16 buffer, two ways: torch.sum (fp32
    accumulate) and row_sums over it as [*, 1024] (the access pattern of the decode GEMVs).
    {"torch_sum": ..., "row_sums": ...}; the second only on CUDA."""
    import triton.testing
    n = max(nbytes // 2, 1 << 20)
    buf = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    out = {}

    def timed(fn) -> float:
        ms = triton.testing.do_bench(fn, warmup=5, rep=reps * 5, return_mode="median")
        return n * 2 / (ms * 1e-3) / 1e9
    out["torch_sum"] = timed(lambda: buf.sum(dtype=torch.float32))
    if torch.device(device).type == "cuda":
        cols = 1024
        mat = buf[: n // cols * cols].view(-1, cols)
        sums = torch.empty(mat.shape[0], dtype=torch.float32, device=device)
        out["row_sums"] = timed(lambda: row_sums(mat, sums)) * mat.numel() / n
        mat = sums = None
    buf = None                      # give the buffer (weights-sized) back to the driver
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out
