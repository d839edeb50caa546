"""Plain-PyTorch references of every kernel, one section per kernel file, each function named
after its launcher + `_ref` (kernels/gemv.py: gemv -> gemv_ref, ...).

Written from docs/qwen35-text-model.md and the kernel docstrings, not from the kernels: fp32
math, with a rounding to the activation dtype exactly where the kernels (and HF) round, so a
kernel that follows the same plan agrees to accumulation-order noise.

The decode references (one token) are pure: they return new tensors (outputs, and the updated
states or caches) instead of writing in place, so a test can compare both. The prefill
references (T tokens: gemm, gdn_chunk, flash_attention) take the launcher's arguments,
write `out` (and update the states or caches in place) and return `out`. The GDN prefill
reference is the token recurrence of spec section 6.4, not the chunked form: the chunk kernel
is tested against T sequential steps.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# HF's l2norm epsilon for GDN q/k: inside the sqrt, added to the sum of squares (spec 3c).
L2NORM_EPS = 1e-6


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One storage rounding to `dtype`, back in fp32."""
    return x.to(dtype).float()


def l2norm_ref(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|^2 + 1e-6) over the last dim, fp32 (GDN q and k)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


# ------------------------------------------------------------------------------------------
# embedding  (kernels/embedding.py)
# ------------------------------------------------------------------------------------------

def embedding_gather_ref(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids.long()]


# ------------------------------------------------------------------------------------------
# RMSNorm  (kernels/rms_norm.py)
# ------------------------------------------------------------------------------------------

def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float,
                 out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (1 + w), fp32, one rounding."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())
    return y.to(out_dtype or x.dtype)


# ------------------------------------------------------------------------------------------
# decode GEMV with its fused prologues and epilogues  (kernels/gemv.py)
# ------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------
# Gated DeltaNet decode  (kernels/gdn_decode.py)
# ------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------
# gated attention decode  (kernels/attention_decode.py)
# ------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------
# LM head + argmax, sampler  (kernels/sampling.py)
# ------------------------------------------------------------------------------------------

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
# prefill GEMM with the fused epilogues  (kernels/gemm.py)
# ------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------
# Gated DeltaNet prefill: conv1d + SiLU, gates, recurrence, gated RMSNorm  (kernels/gdn_chunk.py)
# ------------------------------------------------------------------------------------------

def gdn_conv_ref(x: torch.Tensor, w: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv + SiLU of x [T, C] continuing from conv_state [C, Kc-1]:
    silu(round(sum_j w[c, j] * seq[t + j, c])) with seq = [conv_state^T | x] (oldest first),
    rounded to x's dtype and returned in fp32; afterwards conv_state holds the last Kc-1 rows
    of seq."""
    T = x.shape[0]
    kc = w.shape[1]
    seq = torch.cat([conv_state.t().float(), x.float()], dim=0)          # [Kc-1+T, C]
    acc = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(kc):
        acc += seq[j:j + T] * w[:, j].float()
    conv_state.copy_(seq[T:].t().to(conv_state.dtype))
    return _round(F.silu(_round(acc, x.dtype)), x.dtype)


def gdn_gates_ref(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """beta = sigmoid(b) (rounded to b's dtype, as HF keeps it); g = -exp(A_log) *
    softplus(a + dt_bias) in fp32 with softplus threshold 20. Both returned as fp32 [T, Hv]."""
    beta = torch.sigmoid(b.float()).to(b.dtype).float()
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
    return beta, g


def _gdn_output_norm_ref(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float,
                       dtype: torch.dtype) -> torch.Tensor:
    """Spec 3b over the last dim: norm in fp32, round, times w, times silu(z) in fp32, round."""
    o = _round(o.float(), dtype)                  # the GDN core output is stored in the dtype
    n = o * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + eps)
    n = _round(n, dtype)
    return ((w.float() * n) * F.silu(z.float())).to(dtype)


def gdn_prefill_ref(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                    conv_w: torch.Tensor, conv_state: torch.Tensor, A_log: torch.Tensor,
                    dt_bias: torch.Tensor, state: torch.Tensor, norm_w: torch.Tensor,
                    out: torch.Tensor, *, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                    head_v_dim: int, eps: float, chunk: int = 64,
                    t_dev: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The conv (gdn_conv_ref) of the raw projection qkv, then T sequential steps of the gated
    delta rule (spec 6.3-6.5); `chunk` is accepted for signature parity and ignored. Only the
    first t = t_dev[0] rows (clamped to [0, T]; all T without t_dev) are real: they alone
    enter conv_state and state (both updated in place); the output rows past them are 0."""
    del chunk
    T = qkv.shape[0] if t_dev is None else max(0, min(int(t_dev.reshape(-1)[0]), qkv.shape[0]))
    hk, hv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    group = hv // hk
    key_dim = hk * dk
    qkv_conv = gdn_conv_ref(qkv[:T], conv_w, conv_state)
    z, b, a = z[:T], b[:T], a[:T]
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
    y = _gdn_output_norm_ref(o, z.reshape(T, hv, dv), norm_w, eps, out.dtype)
    out.zero_()
    out[:T] = y.reshape(T, hv * dv)
    return out


# ------------------------------------------------------------------------------------------
# gated attention prefill: q/k norm, partial RoPE, KV write, causal GQA, gate  (kernels/flash_attention.py)
# ------------------------------------------------------------------------------------------

def rope_inv_freq_ref(rotary_dim: int, rope_theta: float, device=None) -> torch.Tensor:
    """inv_freq[j] = theta^(-2j/rotary_dim) in fp32, computed the way HF does."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (rope_theta ** exps)


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
    q = apply_rope_ref(rms_norm_ref(q, q_norm_w, eps), pos, rotary_dim, rope_theta)
    kk = apply_rope_ref(rms_norm_ref(k.view(T, Hkv, hd), k_norm_w, eps), pos, rotary_dim,
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
