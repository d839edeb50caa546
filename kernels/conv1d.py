"""Causal depthwise conv1d + SiLU over a prompt, continuing from the decode conv state.

With seq = [conv_state^T | x] (the Kc-1 previous inputs, oldest first, then the T new rows):

    out[t, c]  = silu( round( sum_{j<Kc} w[c, j] * seq[t + j, c] ) )      w[:, -1] hits token t
    conv_state = seq[T : T + Kc - 1]^T                                      (last Kc-1 inputs)

The sum is fp32 and rounded to the activation dtype before the SiLU (HF runs F.conv1d in the
model dtype, then F.silu). The output is allocated by the caller.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _causal_conv1d_kernel(x_ptr, w_ptr, state_ptr, out_ptr, T, C, stride_x, stride_o,
                          KC: tl.constexpr, KM1_PAD: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = offs_t < T
    mask_c = offs_c < C
    rows_c = offs_c.to(tl.int64)

    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(KC):
        # tap j reads sequence row s = t - (Kc-1) + j: x when s >= 0, else the old state
        s = offs_t - (KC - 1) + j
        in_x = s >= 0
        m = mask_t[:, None] & mask_c[None, :]
        xv = tl.load(x_ptr + s.to(tl.int64)[:, None] * stride_x + offs_c[None, :],
                     mask=m & in_x[:, None], other=0.0)
        sv = tl.load(state_ptr + rows_c[None, :] * (KC - 1) + (s + KC - 1)[:, None],
                     mask=m & (~in_x)[:, None], other=0.0)
        wj = tl.load(w_ptr + rows_c * KC + j, mask=mask_c, other=0.0)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wj.to(tl.float32)[None, :]

    dtype = out_ptr.dtype.element_ty
    conv = acc.to(dtype).to(tl.float32)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_o + offs_c[None, :],
             (conv * tl.sigmoid(conv)).to(dtype), mask=mask_t[:, None] & mask_c[None, :])

    # Only rows t < Kc-1 read the old state and they all live in row-block 0, so that program
    # alone rewrites the state, after its own reads (the barrier orders them within the CTA).
    if pid_t == 0:
        offs_i = tl.arange(0, KM1_PAD)
        s_new = T - (KC - 1) + offs_i                     # sequence row that becomes state[:, i]
        keep = mask_c[:, None] & (offs_i < KC - 1)[None, :]
        from_x = (s_new >= 0)[None, :]
        nx = tl.load(x_ptr + s_new.to(tl.int64)[None, :] * stride_x + offs_c[:, None],
                     mask=keep & from_x, other=0.0)
        ns = tl.load(state_ptr + rows_c[:, None] * (KC - 1) + (s_new + KC - 1)[None, :],
                     mask=keep & (~from_x), other=0.0)
        new_state = nx.to(tl.float32) + ns.to(tl.float32)
        tl.debug_barrier()
        tl.store(state_ptr + rows_c[:, None] * (KC - 1) + offs_i[None, :],
                 new_state.to(state_ptr.dtype.element_ty), mask=keep)


def causal_conv1d(x: torch.Tensor, w: torch.Tensor, conv_state: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """out = silu(causal depthwise conv of x continuing from conv_state); updates conv_state.

    x [T, C] (rows may be strided), w [C, Kc] contiguous, conv_state [C, Kc-1] contiguous in
    x's dtype, out [T, C] (rows may be strided, must not overlap x). Returns out.
    """
    if x.dim() != 2 or w.dim() != 2 or conv_state.dim() != 2 or out.dim() != 2:
        raise ValueError("causal_conv1d expects x [T, C], w [C, Kc], conv_state [C, Kc-1], out [T, C]")
    T, C = x.shape
    kc = w.shape[1]
    if x.dtype not in _DTYPES:
        raise TypeError(f"causal_conv1d supports {_DTYPES}, got {x.dtype}")
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
    # 16 x 128 tiles keep the 2 x Kc shifted loads in registers without spilling (sm_90: 144 regs)
    block_c = min(128, triton.next_power_of_2(C))
    # row-block 0 must cover every row that reads the old state (t < Kc-1)
    block_t = max(triton.next_power_of_2(kc - 1), min(16, triton.next_power_of_2(T)))
    grid = (triton.cdiv(T, block_t), triton.cdiv(C, block_c))
    _causal_conv1d_kernel[grid](
        x, w, conv_state, out, T, C, x.stride(0), out.stride(0),
        KC=kc, KM1_PAD=triton.next_power_of_2(kc - 1), BLOCK_T=block_t, BLOCK_C=block_c,
        num_warps=4)
    return out
