"""Prefill GEMM: out[T, N] = x[T, K] @ W[N, K]^T on tensor cores, with the decode epilogues.

    plain      out = x W^T
    residual   out = residual + round(x W^T)              (out may alias residual)
    silu_mul   out = round(silu(round(x Wg^T))) * round(x Wu^T),  W = [Wg; Wu]  ([2I, K] -> [T, I])

Accumulation is fp32 (`tl.dot`); the epilogue rounds where HF rounds (each projection output,
SiLU(gate), the product) so the result matches a bf16 PyTorch model bit-for-bit up to the
order of the K-sum. The output is allocated by the caller.

PyTorch reference: kernels/reference.py, section "gemm": gemm_ref.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, cdiv, clear_table_cache, next_pow2, table_for_this_gpu


# Tile table measured on the device by `python -m tritonchat.engine.tuning.prefill`; every prefill
# launcher reads the file its `table` argument names (this one by default; None = none) and
# falls back to its built-in table when the file (or an entry) is absent.
TUNING_FILE = Path(__file__).with_name("prefill_tuning.json")
TUNING_PATH = str(TUNING_FILE)
# Prompt lengths the tables are measured at; a prompt takes the nearest one (log scale), and
# prompts shorter than MIN_TUNED_T keep the built-in small-tile configs.
T_BUCKETS = (128, 2048, 8192)
MIN_TUNED_T = 64


def t_bucket(T: int) -> int:
    """The measured prompt length nearest to T on a log scale."""
    return min(T_BUCKETS, key=lambda b: abs(math.log2(T / b)))


def _load_tuning(path: str) -> dict:
    """The tile configs of this GPU's table in the file (_common.table_for_this_gpu)."""
    configs = (table_for_this_gpu(path) or {}).get("configs")
    return configs if isinstance(configs, dict) else {}


def tuned_config(kernel: str, T: int, keys: tuple[str, ...],
                 table: Optional[str] = TUNING_PATH) -> Optional[dict]:
    """The measured config for `kernel` (a name that includes the shape it was measured at) at
    the bucket of T in the tile table file `table` (None: no table), or None. An entry must
    carry exactly `keys` as positive integers."""
    if T < MIN_TUNED_T or table is None:
        return None
    entry = _tuned_entry(kernel, t_bucket(T), tuple(keys), str(table))
    return dict(entry) if entry is not None else None


@functools.lru_cache(maxsize=256)
def _tuned_entry(kernel: str, bucket: int, keys: tuple[str, ...], path: str) -> Optional[dict]:
    # per (kernel, bucket, table file): the prefill asks at every launch of every layer
    entry = _load_tuning(path).get(kernel, {}).get(str(bucket))
    if not isinstance(entry, dict) or set(entry) != set(keys):
        return None
    if not all(isinstance(v, int) and v > 0 for v in entry.values()):
        return None
    return entry


def clear_tuning_cache() -> None:
    """Forget the loaded table (after the tuner rewrites it, or in tests)."""
    clear_table_cache()
    _tuned_entry.cache_clear()
    _gemm_config_cached.cache_clear()


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision for fp32 operands: an fp32 model is the accuracy mode, so its
    dots are IEEE fp32; with half activations only internal fp32 tiles reach tl.dot, and TF32
    is plenty for them. (Half operands always run on tensor cores.)"""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, res_ptr,
                 M, N, K, stride_xm, stride_wn, stride_om, stride_rm, up_row_offset,
                 HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, DOT_PREC: tl.constexpr):
    # Grouped tile order: GROUP_M row-blocks share each column-block of W while it is in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_n
    first_m = (pid // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % group_rows
    pid_n = (pid % tiles_per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = w_ptrs + up_row_offset * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            mask_k = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PREC)
        if SILU_MUL:
            if EVEN_K:
                wu = tl.load(u_ptrs, mask=mask_n[:, None], other=0.0)
            else:
                wu = tl.load(u_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=DOT_PREC)
            u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype).to(tl.float32)
    if SILU_MUL:
        silu_gate = (y * tl.sigmoid(y)).to(dtype).to(tl.float32)
        y = (silu_gate * acc_up.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :],
                    mask=mask, other=0.0)
        y = y + r.to(tl.float32)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             y.to(dtype), mask=mask)


GEMM_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def gemm_kernel_name(N: int, K: int, residual: bool, silu_mul: bool) -> str:
    """Tuning-table name of one GEMM shape (N = output columns)."""
    epi = "silu_mul" if silu_mul else ("residual" if residual else "plain")
    return f"gemm_{epi}_N{N}_K{K}"


def gemm_config(M: int, N: int, K: int, silu_mul: bool, residual: bool = False,
                table: Optional[str] = TUNING_PATH) -> dict:
    """The tiles gemm() launches this shape with: the tile table's (`table`, None: none) when it
    has them, else the built-in table."""
    return dict(_gemm_config_cached(M, N, K, silu_mul, residual,
                                    None if table is None else str(table)))


@functools.lru_cache(maxsize=512)
def _gemm_config_cached(M: int, N: int, K: int, silu_mul: bool, residual: bool,
                        table: Optional[str]) -> dict:
    # per (shape, table file): the launch path asks at every call (host time is TTFT here)
    cfg = tuned_config(gemm_kernel_name(N, K, residual, silu_mul), M, GEMM_KEYS, table)
    return cfg if cfg is not None else _gemm_default_config(M, N, K, silu_mul)


def _gemm_default_config(M: int, N: int, K: int, silu_mul: bool) -> dict:
    """Static tile table (no run-time autotune: prefill must not stall on a first call).

    Short prompts are weight-bandwidth bound, so they take a thin M tile and a deep K tile;
    long prompts are compute bound and take the 128-wide wgmma tiles. The gate|up GEMM keeps
    two accumulators, so it halves N to stay within registers.
    """
    if M <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    elif M <= 32:
        cfg = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    elif M <= 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    elif M <= 256:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    if silu_mul and cfg["BLOCK_N"] > 64:
        cfg["BLOCK_N"] = 64
    # Never make a K tile wider than K itself (tiny test shapes); tl.dot needs >= 16.
    cfg["BLOCK_K"] = max(16, min(cfg["BLOCK_K"], next_pow2(K)))
    cfg["BLOCK_N"] = max(16, min(cfg["BLOCK_N"], next_pow2(N)))
    cfg["GROUP_M"] = 8
    return cfg


def _check_rows(name: str, t: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> None:
    if t.dim() != 2 or tuple(t.shape) != (rows, cols):
        raise ValueError(f"{name} must have shape [{rows}, {cols}], got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous rows (stride(1) == 1)")


def gemm(x: torch.Tensor, W: torch.Tensor, out: torch.Tensor, *,
         residual: Optional[torch.Tensor] = None, silu_mul: bool = False,
         config: Optional[dict] = None, table: Optional[str] = TUNING_PATH) -> torch.Tensor:
    """out = x @ W^T with optional fused epilogue (see module docstring); returns out.

    x [T, K], W [N, K] contiguous (nn.Linear layout), out [T, N] ([T, N/2] with silu_mul,
    gate rows first in W). Rows of x/out/residual may be strided (views into a wider buffer).
    `config` (GEMM_KEYS) overrides the tile table: the tuner sweeps through it. `table`: the
    tile table file (None: the built-in tiles only).
    """
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"gemm supports {FLOAT_DTYPES}, got {x.dtype}")
    if x.dim() != 2 or W.dim() != 2:
        raise ValueError("gemm expects x [T, K] and W [N, K]")
    M, K = x.shape
    N_w = W.shape[0]
    _check_rows("x", x, M, K, x.dtype)
    _check_rows("W", W, N_w, K, x.dtype)
    if not W.is_contiguous():
        raise ValueError("W must be contiguous")
    if silu_mul:
        if N_w % 2:
            raise ValueError("silu_mul needs the merged [2I, K] gate|up matrix")
        N = N_w // 2
    else:
        N = N_w
    _check_rows("out", out, M, N, x.dtype)
    if residual is not None:
        _check_rows("residual", residual, M, N, x.dtype)
    if not (x.device == W.device == out.device):
        raise ValueError("x, W and out must be on the same device")
    if M == 0:
        return out
    cfg = config if config is not None else _gemm_config_cached(
        M, N, K, silu_mul, residual is not None, None if table is None else str(table))
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
    res = residual if residual is not None else out
    _gemm_kernel[grid](
        x, W, out, res, M, N, K, x.stride(0), W.stride(0), out.stride(0), res.stride(0), N,
        HAS_RESIDUAL=residual is not None, SILU_MUL=silu_mul,
        EVEN_K=(K % cfg["BLOCK_K"] == 0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], DOT_PREC=dot_precision(x.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
