"""Plain-PyTorch references of the prefill operators (same names as the Triton launchers + `_ref`).

Each function takes the same arguments as its kernel, writes `out` (and updates the states or
caches in place) and returns `out`. They do the math in fp32 and round to the activation dtype
exactly where HF rounds (see qwen35-text-model.md section 11), so a kernel that follows the same
plan agrees to accumulation-order noise. The GDN reference is the token recurrence of section 6.4,
not the chunked form: the chunk kernel is tested against T sequential steps.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# HF's l2norm epsilon for GDN q/k: inside the sqrt, added to the sum of squares (spec 3c).
L2NORM_EPS = 1e-6


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 values to `dtype` and come back to fp32 (models one storage rounding)."""
    return x.to(dtype).float()


# --------------------------------------------------------------------------------------------
# GEMM with the fused epilogues
# --------------------------------------------------------------------------------------------

def gemm_ref(x: torch.Tensor, W: torch.Tensor, out: torch.Tensor, *,
             residual: Optional[torch.Tensor] = None, silu_mul: bool = False) -> torch.Tensor:
    """out = [residual +] x @ W^T, or silu(x @ Wg^T) * (x @ Wu^T) for W = [Wg; Wu].

    Rounding follows HF: each projection is rounded to the dtype, SiLU(gate) is rounded, the
    product is rounded, and the residual add happens on the rounded values.
    """
    dt = out.dtype
    y = x.float() @ W.float().t()
    if silu_mul:
        inter = W.shape[0] // 2
        gate, up = _round(y[:, :inter], dt), _round(y[:, inter:], dt)
        y = _round(F.silu(gate), dt) * up
    y = _round(y, dt)
    if residual is not None:
        y = y + residual.float()
    out.copy_(y.to(dt))
    return out


# --------------------------------------------------------------------------------------------
# Causal depthwise conv1d + SiLU
# --------------------------------------------------------------------------------------------

def causal_conv1d_ref(x: torch.Tensor, w: torch.Tensor, conv_state: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
    """out[t, c] = silu(sum_j w[c, j] * seq[t + j, c]) with seq = [conv_state^T | x] (oldest
    first); afterwards conv_state holds the last Kc-1 rows of seq."""
    T, C = x.shape
    kc = w.shape[1]
    seq = torch.cat([conv_state.t().float(), x.float()], dim=0)          # [Kc-1+T, C]
    acc = torch.zeros(T, C, dtype=torch.float32, device=x.device)
    for j in range(kc):
        acc += seq[j:j + T] * w[:, j].float()
    conv = _round(acc, out.dtype)
    out.copy_(F.silu(conv).to(out.dtype))
    conv_state.copy_(seq[T:].t().to(conv_state.dtype))
    return out


# --------------------------------------------------------------------------------------------
# Gated DeltaNet: gates, recurrence, gated RMSNorm
# --------------------------------------------------------------------------------------------

def gdn_gates_ref(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """beta = sigmoid(b) (rounded to b's dtype, as HF keeps it); g = -exp(A_log) *
    softplus(a + dt_bias) in fp32 with softplus threshold 20. Both returned as fp32 [T, Hv]."""
    beta = torch.sigmoid(b.float()).to(b.dtype).float()
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
    return beta, g


def l2norm_ref(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def gated_rms_norm_ref(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float,
                       dtype: torch.dtype) -> torch.Tensor:
    """Spec 3b over the last dim: norm in fp32, round, times w, times silu(z) in fp32, round."""
    o = _round(o.float(), dtype)                  # the GDN core output is stored in the dtype
    n = o * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + eps)
    n = _round(n, dtype)
    return ((w.float() * n) * F.silu(z.float())).to(dtype)


def gdn_prefill_ref(qkv_conv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                    norm_w: torch.Tensor, out: torch.Tensor, *, num_k_heads: int,
                    num_v_heads: int, head_k_dim: int, head_v_dim: int, eps: float,
                    chunk: int = 64) -> torch.Tensor:
    """T sequential steps of the gated delta rule (spec 6.3-6.5); `chunk` is accepted for
    signature parity and ignored. state [Hv, dk, dv] fp32 is updated in place."""
    del chunk
    T = qkv_conv.shape[0]
    hk, hv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    group = hv // hk
    key_dim = hk * dk
    q = qkv_conv[:, :key_dim].float().view(T, hk, dk)
    k = qkv_conv[:, key_dim:2 * key_dim].float().view(T, hk, dk)
    v = qkv_conv[:, 2 * key_dim:2 * key_dim + hv * dv].float().view(T, hv, dv)
    # value head h reads key head h // group (consecutive repeat, HF repeat_interleave)
    q = l2norm_ref(q).repeat_interleave(group, dim=1) * dk ** -0.5
    k = l2norm_ref(k).repeat_interleave(group, dim=1)
    beta, g = gdn_gates_ref(b, a, A_log, dt_bias)
    S = state.float().clone()
    o = torch.empty(T, hv, dv, dtype=torch.float32, device=qkv_conv.device)
    for t in range(T):
        S = S * torch.exp(g[t])[:, None, None]                           # decay first
        pred = torch.einsum("hkv,hk->hv", S, k[t])                       # S^T k
        delta = beta[t][:, None] * (v[t] - pred)
        S = S + k[t][:, :, None] * delta[:, None, :]                     # rank-1 write
        o[t] = torch.einsum("hkv,hk->hv", S, q[t])                       # read the new state
    state.copy_(S)
    y = gated_rms_norm_ref(o, z.view(T, hv, dv), norm_w, eps, out.dtype)
    out.copy_(y.reshape(T, hv * dv))
    return out


# --------------------------------------------------------------------------------------------
# Gated full attention: q/k RMSNorm, partial RoPE, KV cache write, causal GQA, output gate
# --------------------------------------------------------------------------------------------

def rope_inv_freq_ref(rotary_dim: int, rope_theta: float, device=None) -> torch.Tensor:
    """inv_freq[j] = theta^(-2j/rotary_dim) in fp32, computed the way HF does."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (rope_theta ** exps)


def rms_norm_zc_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm (spec 3a): fp32, times (1 + w), one rounding to x's dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * (1.0 + w.float())
    return y.to(x.dtype)


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
                   rope_theta: float) -> torch.Tensor:
    """Rotate-half RoPE on the first rotary_dim dims of x [T, heads, hd] (dtype arithmetic:
    cos/sin rounded to x's dtype, each product and the sum rounded, as HF's bf16 ops do)."""
    dt = x.dtype
    inv_freq = rope_inv_freq_ref(rotary_dim, rope_theta, x.device)
    ang = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    cos = emb.cos().to(dt).float()[:, None, :]
    sin = emb.sin().to(dt).float()[:, None, :]
    half = rotary_dim // 2
    xr = x[..., :rotary_dim].float()
    rot_half = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    xr = (_round(xr * cos, dt) + _round(rot_half * sin, dt)).to(dt)
    return torch.cat([xr, x[..., rotary_dim:]], dim=-1)


def attention_prefill_ref(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, start_pos: int,
                          out: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                          head_dim: int, rotary_dim: int, rope_theta: float,
                          eps: float) -> torch.Tensor:
    """Spec section 5 steps 3-7 for T new tokens at positions start_pos.. start_pos+T-1,
    attending to the cached positions 0..start_pos-1 plus themselves (causal)."""
    T = qg.shape[0]
    H, Hkv, hd = num_heads, num_kv_heads, head_dim
    dt = out.dtype
    qg = qg.view(T, H, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    pos = torch.arange(start_pos, start_pos + T, device=qg.device)
    q = apply_rope_ref(rms_norm_zc_ref(q, q_norm_w, eps), pos, rotary_dim, rope_theta)
    kk = apply_rope_ref(rms_norm_zc_ref(k.view(T, Hkv, hd), k_norm_w, eps), pos, rotary_dim,
                        rope_theta)
    k_cache[:, start_pos:start_pos + T] = kk.transpose(0, 1).to(k_cache.dtype)
    v_cache[:, start_pos:start_pos + T] = v.view(T, Hkv, hd).transpose(0, 1).to(v_cache.dtype)
    L = start_pos + T
    keys = k_cache[:, :L].float().repeat_interleave(H // Hkv, dim=0)     # [H, L, hd]
    vals = v_cache[:, :L].float().repeat_interleave(H // Hkv, dim=0)
    scores = torch.einsum("thd,hld->htl", q.float(), keys) * hd ** -0.5
    visible = torch.arange(L, device=qg.device)[None, :] <= pos[:, None]  # [T, L]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    o = torch.einsum("htl,hld->thd", torch.softmax(scores, dim=-1), vals)
    y = _round(o, dt) * _round(torch.sigmoid(gate.float()), dt)
    out.copy_(y.reshape(T, H * hd).to(dt))
    return out
