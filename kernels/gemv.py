"""Decode GEMV (batch 1, one token): out = W @ x with W [N, K] row-major (nn.Linear layout).

    plain      out[n] = sum_k W[n, k] x[k]
    residual   out[n] = residual[n] + sum_k W[n, k] x[k]            (out may alias residual)
    silu_mul   out[i] = silu(g_i) * u_i,  g = Wg x, u = Wu x,  W = [Wg; Wu]  ([2I, K] -> [I])

Accumulation is fp32 and the epilogue rounds ONCE to out.dtype (the residual add and the SiLU
product happen on the fp32 sums).

Decode is memory-bound (every weight byte is read once per token), so a program owns BLOCK_N
rows and streams them along K in [BLOCK_N, BLOCK_K] tiles: multiply by the broadcast x and keep
a 2-D fp32 accumulator, reduced over K once at the end (`tl.dot` needs M >= 16). K-contiguous
rows and power-of-two BLOCK_K give 16-byte vector loads; W is read with `evict_first` (read
once), x with `evict_last` (every program reads it).

Split-K (`split_k > 1`) adds a grid axis over K ranges for the shapes whose row grid is too
small to fill the GPU; each split writes an fp32 partial row into the caller's `partials`
buffer and a second kernel sums the splits in a fixed order and applies the epilogue. No
atomics, so the result is bit-reproducible run to run.

Block sizes come from `gemv_splitk_table.json` (written by `tune_gemv.py` on the GPU) keyed by
(N, K), with a heuristic fallback for other shapes; `plan()` is what the engine calls at load.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemv_splitk_table.json")
# The fallback plans aim at this many programs (H200: 132 SMs, ~2 resident GEMV programs each).
TARGET_PROGRAMS = 264
MAX_SPLIT_K = 8


# ------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------

@triton.jit
def _load_tile(w_rows, x_ptr, ks, row_mask, k_ok, MASK_N: tl.constexpr, MASK_K: tl.constexpr):
    """x[ks] (kept in cache for the other programs) and W[rows, ks] (streamed once) in fp32.
    The masks are compile-time: an exactly tiled shape loads without any predicate."""
    if MASK_K:
        x = tl.load(x_ptr + ks, mask=k_ok, other=0.0, eviction_policy="evict_last")
        if MASK_N:
            w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + ks[None, :], mask=k_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
    else:
        x = tl.load(x_ptr + ks, eviction_policy="evict_last")
        if MASK_N:
            w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None], other=0.0,
                        eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
    return x.to(tl.float32), w.to(tl.float32)


@triton.jit
def _gemv_rows(x_ptr, w_ptr, rows, row_mask, stride_w, k_lo, k_hi,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               MASK_N: tl.constexpr, MASK_K: tl.constexpr):
    """sum_{k in [k_lo, k_hi)} W[rows, k] * x[k] in fp32; returns [BLOCK_N]."""
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + offs_k
        x, w = _load_tile(w_rows, x_ptr, ks, row_mask, ks < k_hi, MASK_N, MASK_K)
        acc += w * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_rows_pair(x_ptr, w_ptr, rows, row_mask, up_offset, stride_w, K,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    MASK_N: tl.constexpr, MASK_K: tl.constexpr):
    """(W[rows] x, W[rows + up_offset] x): the gate and up rows of a merged [gate; up]
    matrix in one K loop, so both row streams are in flight together and x is read once."""
    offs_k = tl.arange(0, BLOCK_K)
    g_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    u_rows = w_ptr + (rows + up_offset).to(tl.int64)[:, None] * stride_w
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        x, wg = _load_tile(g_rows, x_ptr, ks, row_mask, k_ok, MASK_N, MASK_K)
        _, wu = _load_tile(u_rows, x_ptr, ks, row_mask, k_ok, MASK_N, MASK_K)
        acc_g += wg * x[None, :]
        acc_u += wu * x[None, :]
    return tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)


@triton.jit
def _gemv_direct_kernel(x_ptr, w_ptr, out_ptr, res_ptr, N_OUT, K, stride_w,
                        HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        MASK_N: tl.constexpr, MASK_K: tl.constexpr):
    # One program = BLOCK_N output rows over the whole K, epilogue fused.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N_OUT
    if SILU_MUL:
        # up rows sit N_OUT rows below the gate rows of the merged [gate; up] matrix
        gate, up = _gemv_rows_pair(x_ptr, w_ptr, rows, row_mask, N_OUT, stride_w, K,
                                   BLOCK_N, BLOCK_K, MASK_N, MASK_K)
        y = gate * tl.sigmoid(gate) * up
    else:
        y = _gemv_rows(x_ptr, w_ptr, rows, row_mask, stride_w, 0, K,
                       BLOCK_N, BLOCK_K, MASK_N, MASK_K)
    if HAS_RESIDUAL:
        y += tl.load(res_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _gemv_split_kernel(x_ptr, w_ptr, part_ptr, N_ROWS, K, stride_w, K_PER_SPLIT,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       MASK_N: tl.constexpr, MASK_K: tl.constexpr):
    # Program (n, s): rows block n over K range s; fp32 partial into partials[s, rows].
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N_ROWS
    k_lo = pid_s * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = _gemv_rows(x_ptr, w_ptr, rows, row_mask, stride_w, k_lo, k_hi,
                     BLOCK_N, BLOCK_K, MASK_N, MASK_K)
    tl.store(part_ptr + pid_s * N_ROWS + rows, acc, mask=row_mask)


@triton.jit
def _gemv_reduce_kernel(part_ptr, out_ptr, res_ptr, N_OUT, N_ROWS,
                        SPLIT_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                        SILU_MUL: tl.constexpr, BLOCK: tl.constexpr):
    # Sum the splits in index order (deterministic), then the same epilogue as the direct form.
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = rows < N_OUT
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        y += tl.load(part_ptr + s * N_ROWS + rows, mask=m, other=0.0)
        if SILU_MUL:
            up += tl.load(part_ptr + s * N_ROWS + N_OUT + rows, mask=m, other=0.0)
    if SILU_MUL:
        y = y * tl.sigmoid(y) * up
    if HAS_RESIDUAL:
        y += tl.load(res_ptr + rows, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------
# plans: block sizes and split-K per (N, K)
# ------------------------------------------------------------------------------------------

def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@lru_cache(maxsize=1)
def _table() -> dict:
    """{(n, k): entry} from gemv_splitk_table.json; empty when the file is missing/broken."""
    try:
        with open(TABLE_PATH, "r", encoding="utf-8") as f:
            data = json.load(f)
        return {(int(e["n"]), int(e["k"])): e for e in data.get("entries", [])}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def heuristic_plan(n: int, k: int, split_k_enabled: bool = True) -> dict:
    """Fallback when (n, k) is not in the table: ~4K-element tiles, split-K only when the row
    grid is short of TARGET_PROGRAMS and each split still gets at least two K-blocks."""
    block_k = min(512, triton.next_power_of_2(max(k, 16)))
    block_n = max(1, min(64, 4096 // block_k, triton.next_power_of_2(n)))
    programs = triton.cdiv(n, block_n)
    split_k = 1
    if split_k_enabled and programs < TARGET_PROGRAMS:
        k_blocks = triton.cdiv(k, block_k)
        split_k = max(1, min(MAX_SPLIT_K, triton.cdiv(TARGET_PROGRAMS, programs), k_blocks // 2))
    return dict(split_k=split_k, block_n=block_n, block_k=block_k, num_warps=4)


def plan(n: int, k: int, split_k_enabled: bool = True) -> dict:
    """Launch plan for a [n, k] weight: dict(split_k, block_n, block_k, num_warps).

    Table entries carry the best split config (split_k, block_n, block_k, num_warps) and,
    optionally, the best direct config (direct_block_n, direct_block_k, direct_num_warps) used
    when split-K is switched off or not worth it."""
    e = _table().get((int(n), int(k)))
    if e is None:
        return heuristic_plan(n, k, split_k_enabled)
    split = int(e.get("split_k", 1))
    if split_k_enabled and split > 1:
        return dict(split_k=split, block_n=int(e["block_n"]), block_k=int(e["block_k"]),
                    num_warps=int(e["num_warps"]))
    if "direct_block_n" in e:
        return dict(split_k=1, block_n=int(e["direct_block_n"]),
                    block_k=int(e["direct_block_k"]), num_warps=int(e["direct_num_warps"]))
    if split == 1:
        return dict(split_k=1, block_n=int(e["block_n"]), block_k=int(e["block_k"]),
                    num_warps=int(e["num_warps"]))
    return heuristic_plan(n, k, split_k_enabled=False)


def partials_numel(n_rows: int, split_k: int) -> int:
    """fp32 elements of scratch a split-K launch needs (n_rows = rows of W)."""
    return split_k * n_rows if split_k > 1 else 0


# ------------------------------------------------------------------------------------------
# launcher
# ------------------------------------------------------------------------------------------

def gemv(x: torch.Tensor, W: torch.Tensor, out: torch.Tensor, *, split_k: int = 1,
         partials: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
         silu_mul: bool = False, block_n: Optional[int] = None, block_k: Optional[int] = None,
         num_warps: Optional[int] = None) -> torch.Tensor:
    """out = W @ x [+ residual], or silu(Wg x) * (Wu x) for silu_mul; returns out.

    x [K] or [1, K]; W [N, K] contiguous; out [N] or [1, N] ([N/2] for silu_mul) in any of
    bf16/fp16/fp32; residual like out (may be out itself). split_k > 1 needs `partials`, a
    contiguous fp32 tensor of at least split_k * N elements. Block sizes default to plan(N, K).
    Never allocates, never syncs."""
    _expect(W.dim() == 2 and W.is_contiguous(), "gemv: W must be a contiguous [N, K] matrix")
    n_rows, K = W.shape
    _expect(x.numel() == K and x.is_contiguous() and x.dim() in (1, 2),
            f"gemv: x must be a contiguous [{K}] or [1, {K}] vector, got {tuple(x.shape)}")
    n_out = n_rows // 2 if silu_mul else n_rows
    _expect(not silu_mul or n_rows % 2 == 0, "gemv: silu_mul needs an even number of rows")
    _expect(out.numel() == n_out and out.is_contiguous() and out.dim() in (1, 2),
            f"gemv: out must be a contiguous [{n_out}] vector, got {tuple(out.shape)}")
    for t, name in ((x, "x"), (W, "W"), (out, "out")):
        if t.dtype not in _DTYPES:
            raise TypeError(f"gemv: {name} dtype {t.dtype} not in {_DTYPES}")
    _expect(x.device == W.device == out.device, "gemv: x, W, out on different devices")
    if residual is not None:
        _expect(residual.numel() == n_out and residual.is_contiguous()
                and residual.device == out.device,
                f"gemv: residual must be a contiguous [{n_out}] vector on out's device")
    split_k = int(split_k)
    _expect(1 <= split_k <= 64, "gemv: split_k must be in 1..64")

    if block_n is None or block_k is None or num_warps is None:
        p = plan(n_rows, K, split_k > 1)
        block_n = block_n or p["block_n"]
        block_k = block_k or p["block_k"]
        num_warps = num_warps or p["num_warps"]
    _expect(block_n >= 1 and block_n & (block_n - 1) == 0, "gemv: block_n must be a power of 2")
    _expect(block_k >= 16 and block_k & (block_k - 1) == 0,
            "gemv: block_k must be a power of 2 >= 16")
    has_res = residual is not None
    res = residual if has_res else out      # dummy pointer, never read when HAS_RESIDUAL=False

    if split_k == 1:
        _gemv_direct_kernel[(triton.cdiv(n_out, block_n),)](
            x, W, out, res, n_out, K, W.stride(0),
            HAS_RESIDUAL=has_res, SILU_MUL=bool(silu_mul), BLOCK_N=block_n, BLOCK_K=block_k,
            MASK_N=n_out % block_n != 0, MASK_K=K % block_k != 0, num_warps=num_warps)
        return out

    _expect(partials is not None and partials.dtype == torch.float32
            and partials.is_contiguous() and partials.numel() >= split_k * n_rows
            and partials.device == out.device,
            f"gemv: split_k={split_k} needs a contiguous float32 partials buffer of at least "
            f"{split_k * n_rows} elements on out's device")
    # every split starts on a BLOCK_K boundary, so only a ragged K needs the K mask
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    _gemv_split_kernel[(triton.cdiv(n_rows, block_n), split_k)](
        x, W, partials, n_rows, K, W.stride(0), k_per_split,
        BLOCK_N=block_n, BLOCK_K=block_k, MASK_N=n_rows % block_n != 0,
        MASK_K=K % block_k != 0, num_warps=num_warps)
    block_r = min(1024, triton.next_power_of_2(n_out))
    _gemv_reduce_kernel[(triton.cdiv(n_out, block_r),)](
        partials, out, res, n_out, n_rows, SPLIT_K=split_k, HAS_RESIDUAL=has_res,
        SILU_MUL=bool(silu_mul), BLOCK=block_r, num_warps=4)
    return out
