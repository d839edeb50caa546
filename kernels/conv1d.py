"""Causal depthwise conv1d + SiLU over a prompt, continuing from the decode conv state.

With seq = [conv_state^T | x] (the Kc-1 previous inputs, oldest first, then the T new rows):

    out[t, c]  = silu( round( sum_{j<Kc} w[c, j] * seq[t + j, c] ) )      w[:, -1] hits token t
    conv_state = seq[T : T + Kc - 1]^T                                      (last Kc-1 inputs)

The sum is fp32 and rounded to the activation dtype before the SiLU (HF runs F.conv1d in the
model dtype, then F.silu). The output is allocated by the caller.

PyTorch reference: kernels/reference.py, section "conv1d": causal_conv1d_ref.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, cdiv, next_pow2

from .gemm import TUNING_PATH, tuned_config

CONV_KEYS = ("BLOCK_T", "BLOCK_C", "ROW_TILES", "num_warps")


@triton.jit
def _conv_rows(x_ptr, w, state_ptr, out_ptr, t0, T, offs_c, mask_c, stride_x, stride_o,
               KC: tl.constexpr, KC_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_C: tl.constexpr, FROM_STATE: tl.constexpr):
    """Output rows t0 .. t0+BLOCK_T-1 of one channel block. Tap j reads sequence row
    s = t - (Kc-1) + j; only the first row block (FROM_STATE) can reach back into the state."""
    offs_t = t0 + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    cols = offs_c[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(KC):
        s = offs_t - (KC - 1) + j
        m = mask_t[:, None] & mask_c[None, :]
        # the shifted reloads of the same rows hit L1: HBM sees each input row about once
        if FROM_STATE:
            xv = tl.load(x_ptr + s.to(tl.int64)[:, None] * stride_x + cols,
                         mask=m & (s >= 0)[:, None], other=0.0).to(tl.float32)
            xv += tl.load(state_ptr + offs_c.to(tl.int64)[None, :] * (KC - 1) + (s + KC - 1)[:, None],
                          mask=m & (s < 0)[:, None], other=0.0).to(tl.float32)
        else:
            xv = tl.load(x_ptr + s.to(tl.int64)[:, None] * stride_x + cols, mask=m,
                         other=0.0).to(tl.float32)
        # tap weights: [BLOCK_C, KC_PAD] tile, one column picked per tap (no strided reloads)
        wj = tl.sum(tl.where(tl.arange(0, KC_PAD)[None, :] == j, w, 0.0), axis=1)
        acc += xv * wj[None, :]
    dtype = out_ptr.dtype.element_ty
    conv = acc.to(dtype).to(tl.float32)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_o + cols,
             (conv * tl.sigmoid(conv)).to(dtype), mask=mask_t[:, None] & mask_c[None, :])


@triton.jit
def _causal_conv1d_kernel(x_ptr, w_ptr, state_ptr, out_ptr, T, C, stride_x, stride_o,
                          KC: tl.constexpr, KC_PAD: tl.constexpr, KM1_PAD: tl.constexpr,
                          BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr, ROW_TILES: tl.constexpr):
    # One program: BLOCK_C channels (contiguous, 16-byte vector loads) x ROW_TILES * BLOCK_T
    # tokens. Only rows t < Kc-1 read the old state and they all lie in tile 0 of program 0,
    # so every other tile takes the state-free path.
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    first_row = pid_t * (ROW_TILES * BLOCK_T)
    offs_j = tl.arange(0, KC_PAD)
    w = tl.load(w_ptr + offs_c[:, None] * KC + offs_j[None, :],
                mask=mask_c[:, None] & (offs_j < KC)[None, :], other=0.0).to(tl.float32)
    if pid_t == 0:
        _conv_rows(x_ptr, w, state_ptr, out_ptr, 0, T, offs_c, mask_c, stride_x, stride_o,
                   KC, KC_PAD, BLOCK_T, BLOCK_C, True)
        for r in range(1, ROW_TILES):
            _conv_rows(x_ptr, w, state_ptr, out_ptr, r * BLOCK_T, T, offs_c, mask_c,
                       stride_x, stride_o, KC, KC_PAD, BLOCK_T, BLOCK_C, False)
        # This program alone rewrites the state of its channels, after its own state reads
        # (the barrier orders them within the CTA).
        offs_i = tl.arange(0, KM1_PAD)
        s_new = T - (KC - 1) + offs_i                     # sequence row that becomes state[:, i]
        keep = mask_c[:, None] & (offs_i < KC - 1)[None, :]
        from_x = (s_new >= 0)[None, :]
        rows_c = offs_c.to(tl.int64)
        nx = tl.load(x_ptr + s_new.to(tl.int64)[None, :] * stride_x + offs_c[:, None],
                     mask=keep & from_x, other=0.0)
        ns = tl.load(state_ptr + rows_c[:, None] * (KC - 1) + (s_new + KC - 1)[None, :],
                     mask=keep & (~from_x), other=0.0)
        new_state = nx.to(tl.float32) + ns.to(tl.float32)
        tl.debug_barrier()
        tl.store(state_ptr + rows_c[:, None] * (KC - 1) + offs_i[None, :],
                 new_state.to(state_ptr.dtype.element_ty), mask=keep)
    else:
        for r in range(ROW_TILES):
            _conv_rows(x_ptr, w, state_ptr, out_ptr, first_row + r * BLOCK_T, T, offs_c,
                       mask_c, stride_x, stride_o, KC, KC_PAD, BLOCK_T, BLOCK_C, False)


def _conv_default_config(T: int, C: int, kc: int) -> dict:
    """Built-in tiles: 256 channels x 32 rows per tile keeps the fp32 accumulator at 32
    registers a thread (8 warps); long prompts give each program 4 row tiles so the
    per-program set-up (weights, state branch) is paid once per 128 tokens."""
    block_c = min(256, next_pow2(C))
    block_t = min(32, next_pow2(T))
    rows = 4 if T >= 1024 else 1
    return dict(BLOCK_T=block_t, BLOCK_C=block_c, ROW_TILES=rows,
                num_warps=8 if block_c * block_t >= 8192 else 4)


def conv_kernel_name(C: int, kc: int) -> str:
    return f"conv1d_C{C}_K{kc}"

def causal_conv1d(x: torch.Tensor, w: torch.Tensor, conv_state: torch.Tensor,
                  out: torch.Tensor, *, config: Optional[dict] = None,
                  table: Optional[str] = TUNING_PATH) -> torch.Tensor:
    """out = silu(causal depthwise conv of x continuing from conv_state); updates conv_state.

    x [T, C] (rows may be strided), w [C, Kc] contiguous, conv_state [C, Kc-1] contiguous in
    x's dtype, out [T, C] (rows may be strided, must not overlap x). Returns out.
    `config` (CONV_KEYS) overrides the tile table: the tuner sweeps through it. `table`: the
    tile table file (gemm.TUNING_PATH; None: the built-in tiles only).
    """
    if x.dim() != 2 or w.dim() != 2 or conv_state.dim() != 2 or out.dim() != 2:
        raise ValueError("causal_conv1d expects x [T, C], w [C, Kc], conv_state [C, Kc-1], out [T, C]")
    T, C = x.shape
    kc = w.shape[1]
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"causal_conv1d supports {FLOAT_DTYPES}, got {x.dtype}")
    if kc < 2:
        raise ValueError("conv kernel size must be >= 2")
    if tuple(w.shape) != (C, kc) or tuple(conv_state.shape) != (C, kc - 1):
        raise ValueError(f"w must be [{C}, Kc] and conv_state [{C}, Kc-1], got "
                         f"{tuple(w.shape)} and {tuple(conv_state.shape)}")
    if tuple(out.shape) != (T, C):
        raise ValueError(f"out must be [{T}, {C}], got {tuple(out.shape)}")
    if not (w.dtype == conv_state.dtype == out.dtype == x.dtype):
        raise TypeError("x, w, conv_state and out must share one dtype")
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("x and out must have contiguous rows")
    if not (w.is_contiguous() and conv_state.is_contiguous()):
        raise ValueError("w and conv_state must be contiguous")
    if out.data_ptr() == x.data_ptr():
        raise ValueError("out must not alias x (other row blocks still read x)")
    if T == 0:
        return out
    if config is not None:
        cfg = dict(config)
    else:
        cfg = tuned_config(conv_kernel_name(C, kc), T, CONV_KEYS, table) or _conv_default_config(T, C, kc)
    # tile 0 must cover every row that reads the old state (t < Kc-1)
    block_t = max(cfg["BLOCK_T"], next_pow2(kc - 1))
    rows_per_prog = block_t * cfg["ROW_TILES"]
    grid = (cdiv(T, rows_per_prog), cdiv(C, cfg["BLOCK_C"]))
    _causal_conv1d_kernel[grid](
        x, w, conv_state, out, T, C, x.stride(0), out.stride(0),
        KC=kc, KC_PAD=next_pow2(kc), KM1_PAD=next_pow2(kc - 1), BLOCK_T=block_t,
        BLOCK_C=cfg["BLOCK_C"], ROW_TILES=cfg["ROW_TILES"], num_warps=cfg["num_warps"])
    return out
