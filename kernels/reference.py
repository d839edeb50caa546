"""Plain-PyTorch references of the decode operators (Triton launcher name + `_ref`).

Written from docs/qwen35-text-model.md and the kernel docstrings, not from the kernels: fp32
math, with a rounding to the activation dtype exactly where the kernels (and HF) round. The
functions are pure: they return new tensors (outputs, and the updated states or caches) instead
of writing in place, so a test can compare both.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One storage rounding to `dtype`, back in fp32."""
    return x.to(dtype).float()


def embedding_gather_ref(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids.long()]


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float,
                 out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (1 + w), fp32, one rounding."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())
    return y.to(out_dtype or x.dtype)


def matvec_ref(x: torch.Tensor, W: torch.Tensor, *, residual: Optional[torch.Tensor] = None,
             silu_mul: bool = False, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """W @ x [+ residual] or silu(Wg x) * (Wu x), fp32, rounded once to out_dtype."""
    y = W.float() @ x.reshape(-1).float()
    if silu_mul:
        half = W.shape[0] // 2
        y = F.silu(y[:half]) * y[half:]
    if residual is not None:
        y = y + residual.reshape(-1).float()
    return y.to(out_dtype or x.dtype)


def _gdn_qkv_heads(x: torch.Tensor, hk: int, hv: int, dk: int, dv: int):
    """Split the convolved [q | k | v] channels per head: q, k l2-normalised (q * dk^-0.5) and
    repeated so value head h reads key head h // (hv // hk)."""
    q = x[:hk * dk].view(hk, dk)
    k = x[hk * dk:2 * hk * dk].view(hk, dk)
    v = x[2 * hk * dk:].view(hv, dv)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS) * dk ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    group = hv // hk
    return q.repeat_interleave(group, 0), k.repeat_interleave(group, 0), v


def gdn_mixer_ref(qkvz, ba, conv_state, conv_w, A_log, dt_bias, state, norm_w, *,
                   num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                   eps: float):
    """One Gated DeltaNet token: returns (out [Hv*dv], new conv_state, new state)."""
    hk, hv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    dt = qkvz.dtype
    conv_dim = 2 * hk * dk + hv * dv
    conv_w = conv_w.reshape(conv_dim, -1)
    m = qkvz[:conv_dim]
    # causal conv over [state (oldest first) | m]; w[:, -1] multiplies the current input
    seq = torch.cat([conv_state.float(), m.float()[:, None]], dim=1)
    conv = _round((seq * conv_w.float()).sum(1), dt)
    x = _round(F.silu(conv), dt)
    new_conv_state = torch.cat([conv_state[:, 1:], m[:, None].to(conv_state.dtype)], dim=1)

    q, k, v = _gdn_qkv_heads(x, hk, hv, dk, dv)

    b, a = ba[:hv], ba[hv:2 * hv]
    beta = _round(torch.sigmoid(b.float()), ba.dtype)
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), threshold=20.0)

    S = state.float() * torch.exp(g)[:, None, None]
    pred = torch.einsum("hkv,hk->hv", S, k)
    delta = beta[:, None] * (v - pred)
    S = S + k[:, :, None] * delta[:, None, :]
    o = _round(torch.einsum("hkv,hk->hv", S, q), dt)

    n = _round(o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps), dt)
    z = qkvz[conv_dim:].view(hv, dv).float()
    y = norm_w.float() * n * F.silu(z)
    return y.reshape(-1).to(dt), new_conv_state, S


def rope_ref(x: torch.Tensor, pos: int, rotary_dim: int, rope_theta: float) -> torch.Tensor:
    """Rotate-half RoPE on the first rotary_dim dims of x [heads, hd] (already rounded to its
    dtype): cos/sin fp32 -> dtype, products and sum rounded as HF's dtype ops round."""
    dt = x.dtype
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, rotary_dim, 2, device=x.device).float()
                                      / rotary_dim))
    ang = float(pos) * inv_freq
    emb = torch.cat([ang, ang])
    cos, sin = _round(emb.cos(), dt), _round(emb.sin(), dt)
    half = rotary_dim // 2
    xr = x[..., :rotary_dim].float()
    rot_half = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    xr = _round(_round(xr * cos, dt) + _round(rot_half * sin, dt), dt)
    return torch.cat([xr.to(dt), x[..., rotary_dim:]], dim=-1)


def attention_decode_ref(qg, k, v, q_norm_w, k_norm_w, k_cache, v_cache, pos: int, *,
                         num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
                         rope_theta: float, eps: float):
    """One gated-attention token at position pos: returns (out [H*hd], new k_cache, new
    v_cache); the caches hold positions 0..pos-1 on entry."""
    H, Hkv, hd = num_heads, num_kv_heads, head_dim
    dt = qg.dtype
    qg = qg.view(H, 2 * hd)
    q, gate = qg[:, :hd], qg[:, hd:]
    q = rope_ref(rms_norm_ref(q, q_norm_w, eps), pos, rotary_dim, rope_theta)
    kk = rope_ref(rms_norm_ref(k.view(Hkv, hd), k_norm_w, eps), pos, rotary_dim, rope_theta)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache[:, pos] = kk.to(k_cache.dtype)
    v_cache[:, pos] = v.view(Hkv, hd).to(v_cache.dtype)
    keys = k_cache[:, :pos + 1].float().repeat_interleave(H // Hkv, 0)     # [H, L, hd]
    vals = v_cache[:, :pos + 1].float().repeat_interleave(H // Hkv, 0)
    scores = torch.einsum("hd,hld->hl", q.float(), keys) * hd ** -0.5
    o = _round(torch.einsum("hl,hld->hd", torch.softmax(scores, -1), vals), dt)
    y = o * _round(torch.sigmoid(gate.float()), dt)
    return y.reshape(-1).to(dt), k_cache, v_cache


def lm_head_argmax_ref(h: torch.Tensor, E: torch.Tensor, valid_vocab: int,
                       norm_w: Optional[torch.Tensor] = None, eps: float = 1e-6):
    """(fp32 logits [V], argmax over ids < valid_vocab, lowest id on ties); with norm_w the
    final norm first: logits = E @ rms_norm_ref(h, norm_w, eps) (rounded to h.dtype)."""
    if norm_w is not None:
        h = rms_norm_ref(h.reshape(-1), norm_w, eps)
    logits = E.float() @ h.reshape(-1).float()
    return logits, int(torch.argmax(logits[:valid_vocab]))


def penalized_logits_ref(logits: torch.Tensor, params, counts: torch.Tensor,
                         valid_vocab: int) -> torch.Tensor:
    """Steps 1-3 of the sampler: repetition (context + generated), presence (generated),
    padded ids at -inf. params: the float list/tensor of sampling.params_list."""
    p = [float(v) for v in params]
    l = logits.float().clone()
    if counts.dim() == 2:
        seen, generated = (counts[0] + counts[1]) > 0, counts[1] > 0
    else:
        seen = generated = counts > 0
    rep = torch.tensor(p[5], dtype=torch.float32, device=l.device)
    l = torch.where(seen, torch.where(l < 0, l * rep, l / rep), l)
    l = torch.where(generated, l - torch.tensor(p[4], dtype=torch.float32, device=l.device), l)
    l[valid_vocab:] = float("-inf")
    return l


def sample_from_logits_ref(logits: torch.Tensor, params, counts: torch.Tensor, *,
                           valid_vocab: int, top_k_max: int) -> torch.Tensor:
    """The exact float64 distribution [V] the sampler draws from (see sampling.py for the
    semantics and the top_k_max candidate cap)."""
    p = [float(v) for v in params]
    temperature, top_k, top_p, min_p, greedy = p[0], int(p[1]), p[2], p[3], p[6] != 0
    l = penalized_logits_ref(logits, p, counts, valid_vocab)
    V = l.numel()
    probs = torch.zeros(V, dtype=torch.float64, device=l.device)
    if greedy or temperature <= 0:
        probs[int(torch.argmax(l))] = 1.0
        return probs
    if top_k < 1 and top_p >= 1 and min_p <= 0:
        return torch.softmax(l.double() / temperature, 0)
    kc = 1 << max(0, (int(top_k_max) - 1).bit_length())
    vals, ids = torch.sort(l, descending=True, stable=True)       # ties: lower id first
    vals, ids = vals[:kc], ids[:kc]
    rank = torch.arange(vals.numel(), device=l.device)
    k_eff = min(top_k, kc) if top_k >= 1 else kc
    k_eff = min(k_eff, vals.numel())
    keep = vals >= vals[k_eff - 1]
    zero = vals.new_zeros(())
    pw = torch.where(keep, torch.exp((vals - vals[0]) / temperature), zero)
    prob = pw / pw.sum()
    before = torch.cumsum(prob, 0) - prob
    keep &= (before < top_p) | (rank == 0)
    keep &= (pw >= min_p) | (rank == 0)
    w = torch.where(keep, pw, zero).double()
    probs[ids] = w / w.sum()
    return probs


# ------------------------------------------------------------------------------------------
# v2 fused decode operators (gemv.gemv, gdn_decode.gdn_decode)
# ------------------------------------------------------------------------------------------

def gated_rms_norm_ref(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float,
                       head_dim: int) -> torch.Tensor:
    """Per head of head_dim: n = round(o * rsqrt(mean(o^2) + eps)); round(w * n * silu(z))."""
    dt = o.dtype
    o32 = o.reshape(-1, head_dim).float()
    n = _round(o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps), dt)
    y = w.float() * n * F.silu(z.reshape(-1, head_dim).float())
    return y.reshape(-1).to(dt)


def conv_step_ref(m: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor):
    """One causal depthwise conv token + SiLU on channels m [C] (already rounded to its dtype):
    returns (round(silu(round(conv))) [C], new conv_state)."""
    dt = m.dtype
    conv_w = conv_w.reshape(m.numel(), -1)
    seq = torch.cat([conv_state.float(), m.float()[:, None]], dim=1)   # oldest first
    conv = _round((seq * conv_w.float()).sum(1), dt)
    y = F.silu(conv).to(dt)
    return y, torch.cat([conv_state[:, 1:], m[:, None].to(conv_state.dtype)], dim=1)


def gemv_ref(x: torch.Tensor, W: torch.Tensor, *, norm_w: Optional[torch.Tensor] = None,
                   eps: float = 1e-6, gate: Optional[torch.Tensor] = None, head_dim: int = 0,
                   residual: Optional[torch.Tensor] = None, silu_mul: bool = False,
                   conv_state: Optional[torch.Tensor] = None,
                   conv_w: Optional[torch.Tensor] = None,
                   out_dtype: Optional[torch.dtype] = None):
    """The unfused sequence gemv replaces: norm (rounded to x.dtype) -> matvec_ref (rounded
    to out_dtype) -> conv step on the first C rows. Returns (out, new conv_state or None)."""
    dt = out_dtype or x.dtype
    x = x.reshape(-1)
    if gate is not None:
        x = gated_rms_norm_ref(x, gate.reshape(-1), norm_w, eps, head_dim)
    elif norm_w is not None:
        x = rms_norm_ref(x, norm_w, eps)
    y = matvec_ref(x, W, residual=residual, silu_mul=silu_mul, out_dtype=dt)
    if conv_state is None:
        return y, None
    c = conv_state.shape[0]
    conv_y, new_state = conv_step_ref(y[:c], conv_state, conv_w)
    return torch.cat([conv_y, y[c:]]), new_state


def gdn_decode_ref(proj: torch.Tensor, A_log, dt_bias, state, *, num_k_heads: int,
                        num_v_heads: int, head_k_dim: int, head_v_dim: int):
    """The GDN recurrence of one token from the fused in_proj output proj = [conv output
    (q|k|v, already conv+SiLU) | z | b | a]: returns (o [Hv*dv] rounded to proj.dtype, new
    fp32 state). The gated norm is not applied (the out_proj prologue does it)."""
    hk, hv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    dt = proj.dtype
    conv_dim = 2 * hk * dk + hv * dv
    x = proj[:conv_dim].float()
    q, k, v = _gdn_qkv_heads(x, hk, hv, dk, dv)
    b = proj[conv_dim + hv * dv:conv_dim + hv * dv + hv]
    a = proj[conv_dim + hv * dv + hv:conv_dim + hv * dv + 2 * hv]
    beta = _round(torch.sigmoid(b.float()), dt)
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), threshold=20.0)
    S = state.float() * torch.exp(g)[:, None, None]
    pred = torch.einsum("hkv,hk->hv", S, k)
    delta = beta[:, None] * (v - pred)
    S = S + k[:, :, None] * delta[:, None, :]
    o = torch.einsum("hkv,hk->hv", S, q)
    return o.reshape(-1).to(dt), S
