"""Prefill GEMM: out[T, N] = x[T, K] @ W[N, K]^T on tensor cores, with the decode epilogues.

    plain      out = x W^T
    residual   out = residual + round(x W^T)              (out may alias residual)
    silu_mul   out = round(silu(round(x Wg^T))) * round(x Wu^T),  W = [Wg; Wu]  ([2I, K] -> [T, I])

Accumulation is fp32 (`tl.dot`); the epilogue rounds where HF rounds (each projection output,
SiLU(gate), the product) so the result matches a bf16 PyTorch model bit-for-bit up to the
order of the K-sum. The output is allocated by the caller.

Launch forms (config keys, GEMM_FORM_DEFAULTS are the original form's):

    grid        PERSISTENT=0 TMA=0 SPLIT_K=1: one program per output tile, pointer loads
                (_gemm_kernel; the small-prompt tiles and the form the tuner compares against)
    persistent  PERSISTENT=1: min(SMs, work units) programs, each walking the tiles in the
                grouped order at a stride of the grid (_gemm_persistent_kernel), so one
                program's epilogue overlaps its next tile's loads and no wave is left ragged
    TMA         TMA=1: operands, residual and output moved by tensor descriptors (Hopper TMA;
                the out-of-bounds zero fill replaces the masks); TMA=2: the operands only (the
                epilogue through pointers: two descriptors fewer to encode at each launch);
                pointer loads where a descriptor is not allowed (pre-sm_90, a base or row
                stride not 16-byte aligned)
    split-K     SPLIT_K=s: every tile's K range cut in s slices, each slice's fp32 partial
                written to a workspace, then one pass (_gemm_splitk_reduce_kernel) sums the
                slices in slice order and runs the epilogue: deterministic, no float atomics.
                For the narrow N (1024) projections, whose tiles do not fill the SMs.
    FLATTEN / WARP_SPEC  tl.range(flatten=, warp_specialize=) on the persistent tile loop.

PDL (`pdl`, _common.pdl_mode): before the wait for the previous kernel a program computes its
tile and sends its first weight tile to L2 (a prefetch: the pipelined K loop itself is
unchanged); every activation load and every store comes after the wait (the residual GEMMs
write `h` in place, which the previous kernels read).

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

from ._common import (FLOAT_DTYPES, cdiv, check_pdl, clear_table_cache, interpreting, launch_kw,
                      next_pow2, pdl_start, pdl_wait, prefetch_l2, sm_count, table_for_this_gpu)

try:    # host-side TMA descriptors (Triton >= 3.4; the interpreter emulates them)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - an older Triton: pointer loads only
    TensorDescriptor = None


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
                 table: Optional[str] = TUNING_PATH,
                 optional: Optional[dict] = None) -> Optional[dict]:
    """The measured config for `kernel` (a name that includes the shape it was measured at) at
    the bucket of T in the tile table file `table` (None: no table), or None. An entry must
    carry exactly `keys` as positive integers, plus any of `optional` ({key: default}) as
    integers, positive too except where the default is 0 (a switch: 0 or 1 and up); the absent
    optional keys take their defaults."""
    if T < MIN_TUNED_T or table is None:
        return None
    opt = tuple(sorted((optional or {}).items()))
    entry = _tuned_entry(kernel, t_bucket(T), tuple(keys), opt, str(table))
    return dict(entry) if entry is not None else None


@functools.lru_cache(maxsize=256)
def _tuned_entry(kernel: str, bucket: int, keys: tuple[str, ...],
                 optional: tuple[tuple[str, int], ...], path: str) -> Optional[dict]:
    # per (kernel, bucket, table file): the prefill asks at every launch of every layer
    entry = _load_tuning(path).get(kernel, {}).get(str(bucket))
    opt = dict(optional)
    if not isinstance(entry, dict) or not set(keys) <= set(entry) <= set(keys) | set(opt):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool)
               and (v > 0 or (v == 0 and opt.get(k) == 0)) for k, v in entry.items()):
        return None
    return {**opt, **entry}


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
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    # Grouped tile order: GROUP_M row-blocks share each column-block of W while it is in L2.
    tiles_per_group = GROUP_M * num_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % tiles_per_group) % group_rows
    pid_n = (tile % tiles_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _prefetch_w_tile(w_ptr, n0, k0, N, K, stride_wn, up_row_offset, SILU_MUL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[n0 : n0+BLOCK_N, k0 : k0+BLOCK_K] (and the up rows below the gate rows with SILU_MUL)
    into L2: one prefetch per 16 columns (32 bytes of a half matrix), clamped into W."""
    rows = tl.minimum(n0 + tl.arange(0, BLOCK_N), N - 1).to(tl.int64) * stride_wn
    cols = tl.minimum(k0 + tl.arange(0, BLOCK_K // 16) * 16, K - 1)
    ptrs = w_ptr + rows[:, None] + cols[None, :]
    prefetch_l2(ptrs)
    if SILU_MUL:
        prefetch_l2(ptrs + up_row_offset * stride_wn)


@triton.jit
def _epilogue(acc, acc_up, dtype: tl.constexpr, SILU_MUL: tl.constexpr):
    # the projection rounded to the activation dtype, then SiLU(gate) and the product rounded
    y = acc.to(dtype).to(tl.float32)
    if SILU_MUL:
        silu_gate = (y * tl.sigmoid(y)).to(dtype).to(tl.float32)
        y = (silu_gate * acc_up.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return y


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, res_ptr,
                 M, N, K, stride_xm, stride_wn, stride_om, stride_rm, up_row_offset,
                 HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr = 0):
    # the grid form: one program per output tile
    pdl_start(PDL)
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = w_ptrs + up_row_offset * stride_wn
    if PDL != 0:    # the first weight tile into L2 while the previous kernel drains
        _prefetch_w_tile(w_ptr, pid_n * BLOCK_N, 0, N, K, stride_wn, up_row_offset, SILU_MUL,
                         BLOCK_N, BLOCK_K)
    pdl_wait(PDL)

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
    y = _epilogue(acc, acc_up, dtype, SILU_MUL)
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :],
                    mask=mask, other=0.0)
        y = y + r.to(tl.float32)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             y.to(dtype), mask=mask)


@triton.jit
def _gemm_persistent_kernel(x, w, out, res, ws, w_mem,
                            M, N, K, stride_xm, stride_wn, stride_om, stride_rm, up_row_offset,
                            num_programs, k_tiles_per_split,
                            HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr,
                            EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, TMA_OUT: tl.constexpr,
                            SPLIT_K: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
                            WARP_SPEC: tl.constexpr, DOT_PREC: tl.constexpr,
                            PDL: tl.constexpr = 0):
    # Work unit u = (K slice u // tiles, output tile u % tiles in the grouped order); program p
    # takes units p, p + num_programs, ...  With USE_TMA, x / w are tensor descriptors (and
    # out / res with TMA_OUT): their out-of-bounds rows and columns read as zero, are not written.
    # With SPLIT_K > 1 a unit writes its fp32 partial to ws[slice] and the reduce pass finishes.
    # w_mem: W itself (w may be its descriptor), for the L2 prefetch under PDL.
    pdl_start(PDL)
    if USE_TMA:
        dtype = w.dtype
    else:
        dtype = w.dtype.element_ty
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    if PDL != 0:    # the first unit's first weight tile into L2 while the previous kernel drains
        first = tl.program_id(0)
        _, pn = _tile_coords(first % num_tiles, num_m, num_n, GROUP_M)
        _prefetch_w_tile(w_mem, pn * BLOCK_N, (first // num_tiles) * k_tiles_per_split * BLOCK_K,
                         N, K, stride_wn, up_row_offset, SILU_MUL, BLOCK_N, BLOCK_K)
    pdl_wait(PDL)
    for unit in tl.range(tl.program_id(0), num_tiles * SPLIT_K, num_programs,
                         flatten=FLATTEN, warp_specialize=WARP_SPEC):
        pid_m, pid_n = _tile_coords(unit % num_tiles, num_m, num_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        if SPLIT_K == 1:
            kt_lo = 0
            kt_hi = k_tiles
        else:
            kt_lo = (unit // num_tiles) * k_tiles_per_split
            kt_hi = tl.minimum(kt_lo + k_tiles_per_split, k_tiles)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(kt_lo, kt_hi):
            k0 = kt * BLOCK_K
            if USE_TMA:
                a = x.load([m0, k0])
                b = w.load([n0, k0])
            else:
                mask_k = (k0 + offs_k) < K
                x_ptrs = x + offs_m.to(tl.int64)[:, None] * stride_xm + (k0 + offs_k)[None, :]
                w_ptrs = w + offs_n.to(tl.int64)[:, None] * stride_wn + (k0 + offs_k)[None, :]
                if EVEN_K:
                    a = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                    b = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
                else:
                    a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                    b = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
            if SILU_MUL:
                # up rows: up_row_offset below the gate rows (a gate tile past N reads up rows
                # into columns that are never stored)
                if USE_TMA:
                    bu = w.load([n0 + up_row_offset, k0])
                else:
                    u_ptrs = w_ptrs + up_row_offset * stride_wn
                    if EVEN_K:
                        bu = tl.load(u_ptrs, mask=mask_n[:, None], other=0.0)
                    else:
                        bu = tl.load(u_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                acc_up = tl.dot(a, tl.trans(bu), acc_up, input_precision=DOT_PREC)

        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            y = _epilogue(acc, acc_up, dtype, SILU_MUL)
            if TMA_OUT:
                if HAS_RESIDUAL:
                    y = y + res.load([m0, n0]).to(tl.float32)
                out.store([m0, n0], y.to(dtype))
            else:
                if HAS_RESIDUAL:
                    r = tl.load(res + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :],
                                mask=mask, other=0.0)
                    y = y + r.to(tl.float32)
                tl.store(out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                         y.to(dtype), mask=mask)
        else:
            # ws [SPLIT_K, M, N] fp32 (gate | up: [SPLIT_K, M, 2N])
            ws_cols = N * (2 if SILU_MUL else 1)
            p = (ws + (unit // num_tiles).to(tl.int64) * M * ws_cols
                 + offs_m.to(tl.int64)[:, None] * ws_cols + offs_n[None, :])
            tl.store(p, acc, mask=mask)
            if SILU_MUL:
                tl.store(p + N, acc_up, mask=mask)


@triton.jit
def _gemm_splitk_reduce_kernel(ws, out_ptr, res_ptr, M, N, stride_om, stride_rm,
                               HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr,
                               SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, PDL: tl.constexpr = 0):
    # out tile = epilogue(sum of the K slices' partials, taken in slice order: deterministic)
    pdl_start(PDL)
    pdl_wait(PDL)               # the partials are the previous launch's
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ws_cols = N * (2 if SILU_MUL else 1)
    p = ws + offs_m.to(tl.int64)[:, None] * ws_cols + offs_n[None, :]
    acc = tl.load(p, mask=mask, other=0.0)
    acc_up = acc
    if SILU_MUL:
        acc_up = tl.load(p + N, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        q = p + s * M.to(tl.int64) * ws_cols
        acc += tl.load(q, mask=mask, other=0.0)
        if SILU_MUL:
            acc_up += tl.load(q + N, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    y = _epilogue(acc, acc_up, dtype, SILU_MUL)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :],
                    mask=mask, other=0.0)
        y = y + r.to(tl.float32)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             y.to(dtype), mask=mask)


# tiles of the split-K reduce pass (memory bound: wide rows, one load per slice)
REDUCE_BLOCK_M, REDUCE_BLOCK_N = 32, 128

GEMM_TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
# the launch form (module docstring); these values are the grid form, which a config that
# names only the tile keys (and a tile table written before the forms existed) runs
GEMM_FORM_DEFAULTS = {"PERSISTENT": 0, "TMA": 0, "SPLIT_K": 1, "FLATTEN": 0, "WARP_SPEC": 0}
GEMM_KEYS = GEMM_TILE_KEYS + tuple(GEMM_FORM_DEFAULTS)
# shared memory a config may plan for: sm_90's 227 KB a block, less room for the pipeline's
# barriers (a 128 x 256 x 64 TMA tile in 3 stages plans 208 KB and compiles to 208.02 KB)
SMEM_BUDGET = 226 * 1024


def gemm_kernel_name(N: int, K: int, residual: bool, silu_mul: bool) -> str:
    """Tuning-table name of one GEMM shape (N = output columns)."""
    epi = "silu_mul" if silu_mul else ("residual" if residual else "plain")
    return f"gemm_{epi}_N{N}_K{K}"


def gemm_config(M: int, N: int, K: int, silu_mul: bool, residual: bool = False,
                table: Optional[str] = TUNING_PATH, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The tiles and form gemm() launches this shape with (all of GEMM_KEYS): the tile table's
    (`table`, None: none) when it has them, else the built-in table; shrunk to the shared
    memory of `dtype`'s operands."""
    return dict(_gemm_config_cached(M, N, K, silu_mul, residual,
                                    None if table is None else str(table), dtype.itemsize))


@functools.lru_cache(maxsize=512)
def _gemm_config_cached(M: int, N: int, K: int, silu_mul: bool, residual: bool,
                        table: Optional[str], elem_size: int) -> dict:
    # per (shape, table file, operand width): the launch path asks at every call (host time
    # is TTFT here)
    cfg = tuned_config(gemm_kernel_name(N, K, residual, silu_mul), M, GEMM_TILE_KEYS, table,
                       optional=GEMM_FORM_DEFAULTS)
    if cfg is None:
        cfg = _gemm_default_config(M, N, K, silu_mul, elem_size)
    return _fit_shared_memory(cfg, elem_size, silu_mul)


def gemm_smem_bytes(cfg: dict, elem_size: int, silu_mul: bool) -> int:
    """Shared memory a config's pipeline plans for: num_stages of the x tile and the W tile
    (two with silu_mul), plus the output tile a TMA store stages (TMA=1)."""
    b_rows = cfg["BLOCK_N"] * (2 if silu_mul else 1)
    pipe = cfg["num_stages"] * (cfg["BLOCK_M"] + b_rows) * cfg["BLOCK_K"] * elem_size
    return pipe + (cfg["BLOCK_M"] * cfg["BLOCK_N"] * elem_size if cfg.get("TMA") == 1 else 0)


def _fit_shared_memory(cfg: dict, elem_size: int, silu_mul: bool) -> dict:
    """`cfg` with fewer stages, then a thinner K tile, then a narrower N tile until it fits
    SMEM_BUDGET: the tables are measured on bf16, and an fp32 model runs the same shapes."""
    cfg = dict(cfg)
    while gemm_smem_bytes(cfg, elem_size, silu_mul) > SMEM_BUDGET:
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["BLOCK_K"] > 32:
            cfg["BLOCK_K"] //= 2
        elif cfg["BLOCK_N"] > 64:
            cfg["BLOCK_N"] //= 2
        else:
            break
    return cfg


def _gemm_default_config(M: int, N: int, K: int, silu_mul: bool, elem_size: int = 2) -> dict:
    """Static tile table (no run-time autotune: prefill must not stall on a first call).

    Short prompts are weight-bandwidth bound and take the grid form's tiles (grid_config).
    Long prompts (M >= 512, half operands) are compute bound and take the persistent TMA form
    with 128-row wgmma tiles (measured on an H100, benchmarks/prefill_gemm.py):
    - the wide projections 128 x 256 with the tile loop flattened into the K loop (the next
      tile's loads overlap this one's epilogue): 6-8 % faster than unflattened;
    - the narrow N ones 128 x 128 below 4,096 rows (at M = 2048 their 128 tiles fill one wave
      of 132 SMs, where 128 x 256 would leave half the SMs idle), 128 x 256 from there on;
    - gate|up 128 x 128: its two accumulators make it a 128 x 256 tile already (flattening
      loses 15 % there).
    An fp32 model (the accuracy mode) keeps the grid form.
    """
    if M < 512 or elem_size > 2:
        return grid_config(M, N, K, silu_mul)
    wide = not silu_mul and N >= 4096
    bn = 256 if wide or (not silu_mul and M >= 4096) else 128
    cfg = dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8, num_warps=8,
               num_stages=3 if bn == 256 or silu_mul else 4,
               PERSISTENT=1, TMA=1, SPLIT_K=1, FLATTEN=int(wide), WARP_SPEC=0)
    return _clamp_tiles(cfg, N, K)


def grid_config(M: int, N: int, K: int, silu_mul: bool) -> dict:
    """The grid form's built-in tiles: a thin M tile and a deep K tile for short prompts, the
    128-wide wgmma tiles for long ones; the gate|up GEMM keeps two accumulators, so it halves
    N to stay within registers. (The whole built-in table before the persistent form.)"""
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
    cfg.update(GROUP_M=8, **GEMM_FORM_DEFAULTS)
    return _clamp_tiles(cfg, N, K)


def _clamp_tiles(cfg: dict, N: int, K: int) -> dict:
    # Never make a tile wider than K or N itself (tiny test shapes); tl.dot needs >= 16.
    cfg["BLOCK_K"] = max(16, min(cfg["BLOCK_K"], next_pow2(K)))
    cfg["BLOCK_N"] = max(16, min(cfg["BLOCK_N"], next_pow2(N)))
    return cfg


def _check_rows(name: str, t: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> None:
    if t.dim() != 2 or tuple(t.shape) != (rows, cols):
        raise ValueError(f"{name} must have shape [{rows}, {cols}], got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous rows (stride(1) == 1)")


@functools.lru_cache(maxsize=8)
def _tma_device(kind: str, index: Optional[int]) -> bool:
    if TensorDescriptor is None:
        return False
    if kind == "cuda":
        return torch.cuda.get_device_capability(index)[0] >= 9
    return interpreting()          # the interpreter emulates descriptors on CPU tensors


def tma_allowed(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether tensor descriptors can move these row-major 2-D tensors: a TMA device (sm_90+,
    or the interpreter), 16-byte aligned bases and row strides."""
    t0 = tensors[0]
    if not _tma_device(t0.device.type, t0.device.index):
        return False
    return all(t is None or (t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0)
               for t in tensors)


def gemm(x: torch.Tensor, W: torch.Tensor, out: torch.Tensor, *,
         residual: Optional[torch.Tensor] = None, silu_mul: bool = False,
         config: Optional[dict] = None, table: Optional[str] = TUNING_PATH,
         pdl: int = 0) -> torch.Tensor:
    """out = x @ W^T with optional fused epilogue (see module docstring); returns out.

    x [T, K], W [N, K] contiguous (nn.Linear layout), out [T, N] ([T, N/2] with silu_mul,
    gate rows first in W). Rows of x/out/residual may be strided (views into a wider buffer).
    `config` (GEMM_KEYS; the form keys may be left out: the grid form) overrides the tile
    table: the tuner sweeps through it. `table`: the tile table file (None: the built-in
    tiles only). `pdl`: see _common.pdl_mode (every launch of the form, the split-K reduce pass
    included).
    """
    pdl = check_pdl(pdl, "gemm")
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
    if config is not None:
        cfg = {**GEMM_FORM_DEFAULTS, **config}
    else:
        cfg = _gemm_config_cached(M, N, K, silu_mul, residual is not None,
                                  None if table is None else str(table), x.element_size())
    res = residual if residual is not None else out
    if cfg["PERSISTENT"] or cfg["TMA"] or cfg["SPLIT_K"] > 1:
        _launch_persistent(x, W, out, res, residual is not None, silu_mul, M, N, K, cfg, pdl)
        return out
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
    _gemm_kernel[grid](
        x, W, out, res, M, N, K, x.stride(0), W.stride(0), out.stride(0), res.stride(0), N,
        HAS_RESIDUAL=residual is not None, SILU_MUL=silu_mul,
        EVEN_K=(K % cfg["BLOCK_K"] == 0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], DOT_PREC=dot_precision(x.dtype), PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_kw(pdl))
    return out


def _launch_persistent(x, W, out, res, has_residual: bool, silu_mul: bool,
                       M: int, N: int, K: int, cfg: dict, pdl: int = 0) -> None:
    """The persistent / TMA / split-K forms (_gemm_persistent_kernel, then the reduce pass)."""
    BM, BN, BK = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    k_tiles = cdiv(K, BK)
    per_split = cdiv(k_tiles, max(1, min(cfg["SPLIT_K"], k_tiles)))
    split = cdiv(k_tiles, per_split)                   # no empty K slice
    units = cdiv(M, BM) * cdiv(N, BN) * split
    programs = min(units, sm_count(x.device)) if cfg["PERSISTENT"] else units
    use_tma = bool(cfg["TMA"]) and tma_allowed(x, W, out, res)
    tma_out = use_tma and cfg["TMA"] == 1 and split == 1   # the reduce pass stores through pointers
    ws = (torch.empty(split, M, N * (2 if silu_mul else 1), device=x.device, dtype=torch.float32)
          if split > 1 else out)
    xa, wa, oa, ra = x, W, out, res
    if use_tma:
        xa = TensorDescriptor(x, [M, K], [x.stride(0), 1], [BM, BK])
        wa = TensorDescriptor(W, [W.shape[0], K], [K, 1], [BN, BK])
        if tma_out:
            oa = TensorDescriptor(out, [M, N], [out.stride(0), 1], [BM, BN])
            ra = TensorDescriptor(res, [M, N], [res.stride(0), 1], [BM, BN])
    _gemm_persistent_kernel[(programs,)](
        xa, wa, oa, ra, ws, W, M, N, K, x.stride(0), W.stride(0), out.stride(0), res.stride(0), N,
        programs, per_split,
        HAS_RESIDUAL=has_residual, SILU_MUL=silu_mul, EVEN_K=(K % BK == 0), USE_TMA=use_tma,
        TMA_OUT=tma_out, SPLIT_K=split, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg["GROUP_M"],
        FLATTEN=bool(cfg["FLATTEN"]), WARP_SPEC=bool(cfg["WARP_SPEC"]),
        DOT_PREC=dot_precision(x.dtype), PDL=pdl, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **launch_kw(pdl))
    if split > 1:
        grid = (cdiv(M, REDUCE_BLOCK_M), cdiv(N, REDUCE_BLOCK_N))
        _gemm_splitk_reduce_kernel[grid](
            ws, out, res, M, N, out.stride(0), res.stride(0),
            HAS_RESIDUAL=has_residual, SILU_MUL=silu_mul, SPLIT_K=split,
            BLOCK_M=REDUCE_BLOCK_M, BLOCK_N=REDUCE_BLOCK_N, PDL=pdl, num_warps=4,
            **launch_kw(pdl))
