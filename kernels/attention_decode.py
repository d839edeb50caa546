"""Gated full-attention decode for one token at position p (spec section 5), split-KV.

    q_h  = rope(rmsnorm_zc(qg[h, :hd], q_norm_w))        gate_h = qg[h, hd:]   (per-head interleave)
    k    = rope(rmsnorm_zc(k, k_norm_w));  v raw;  k_cache[:, p] = k,  v_cache[:, p] = v
    o_h  = softmax(q_h K_{g(h)}^T / sqrt(hd)) V_{g(h)}  over positions 0..p,  g(h) = h // (H/Hkv)
    out_h = round(round(o_h) * round(sigmoid(gate_h)))

RoPE is rotate-half on the first rotary_dim dims, inv_freq[j] = theta^(-2j/rotary_dim), cos and
sin computed in fp32 and rounded to the activation dtype, and the products and the sum rounded
as HF's bf16 ops round them; the QK norms round once (fp32 math, then the dtype).

Kernel 1, grid (Hkv, num_splits): program (g, s) handles the H/Hkv query heads of KV head g at
once (a [max(16, H/Hkv), hd] query tile: `tl.dot` reads each K/V tile once for the group) over its
slice of positions: the slice length is ceil((p+1)/num_splits) rounded up to BLOCK_N and is
computed on the device from `pos`, so one CUDA graph serves every position. Splits past the end
store m = -inf, l = 0. The new token's K/V are used from registers and written to the cache by
split 0; no program reads cache slot p during this launch, so the write cannot race a read.
Softmax is online in fp32 (base 2); the probabilities are rounded to the cache dtype for the
P V tensor-core dot (HF eager also rounds its fp32 softmax to bf16 before P V). The partials
(acc, m, l) go to `partials`.

Kernel 2, grid (H,): combine the splits with their max-rescaled weights, round, gate, store.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .hostmath import cdiv, next_pow2

from . import gemv as _gemv

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2E = 1.4426950408889634


@triton.jit
def _norm_rope_tile(base, row_mask, w_ptr, offs_d, pos_f, eps, freq_log2_step,
                    HD: tl.constexpr, ROT: tl.constexpr):
    """Zero-centred RMSNorm of the head rows at `base` ([R, 1] pointers), then partial
    rotate-half RoPE at position pos_f. Returns the [R, BLOCK_D] tile rounded to the dtype
    (as fp32)."""
    act = base.dtype.element_ty
    HALF = ROT // 2
    d_mask = offs_d < HD
    in_lo = offs_d < HALF
    in_rot = offs_d < ROT
    # rotate-half pairs dim i with i + ROT/2; the first half takes the partner negated
    partner = tl.where(in_lo, offs_d + HALF, tl.where(in_rot, offs_d - HALF, offs_d))
    m = row_mask & d_mask[None, :]
    x = tl.load(base + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=m, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HD + eps)
    w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
    xn = (x * inv_rms[:, None] * (1.0 + w[None, :])).to(act).to(tl.float32)
    xpn = (xp * inv_rms[:, None] * (1.0 + wp[None, :])).to(act).to(tl.float32)
    j = tl.where(in_lo, offs_d, offs_d - HALF).to(tl.float32)
    ang = pos_f * tl.exp2(j * freq_log2_step)                 # p * theta^(-2j/ROT)
    cos = tl.cos(ang).to(act).to(tl.float32)
    sin = tl.sin(ang).to(act).to(tl.float32)
    rot_half = tl.where(in_lo, -xpn, xpn)
    xr = ((xn * cos[None, :]).to(act).to(tl.float32)
          + (rot_half * sin[None, :]).to(act).to(tl.float32)).to(act).to(tl.float32)
    return tl.where(in_rot[None, :], xr, xn)


@triton.jit
def _attn_decode_split_kernel(qg_ptr, k_ptr, v_ptr, qn_w_ptr, kn_w_ptr, k_cache_ptr,
                              v_cache_ptr, pos_ptr, part_ptr, max_ctx, eps, qk_scale_log2,
                              freq_log2_step,
                              HD: tl.constexpr, ROT: tl.constexpr, GROUP: tl.constexpr,
                              NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                              DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    _gemv._pdl_start(PDL)
    _gemv._pdl_wait(PDL)          # q/k/v come from the previous kernel
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    cdt = k_cache_ptr.dtype.element_ty
    p = tl.load(pos_ptr).to(tl.int32)
    pos_f = p.to(tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    d_mask = offs_d < HD
    h_mask = offs_h < GROUP
    heads = kvh * GROUP + offs_h

    # the group's queries [BLOCK_H, BLOCK_D] and this token's key (rows past GROUP are zeros)
    q = _norm_rope_tile(qg_ptr + heads[:, None] * (2 * HD), h_mask[:, None], qn_w_ptr, offs_d,
                        pos_f, eps, freq_log2_step, HD, ROT)
    k_new = _norm_rope_tile(k_ptr + kvh * HD + tl.zeros((1, 1), dtype=tl.int32),
                            tl.full((1, 1), 1, tl.int1), kn_w_ptr, offs_d, pos_f, eps,
                            freq_log2_step, HD, ROT)
    k_new = k_new.to(cdt).to(tl.float32)
    v_new = tl.load(v_ptr + kvh * HD + offs_d, mask=d_mask, other=0.0).to(cdt)

    kc = k_cache_ptr + kvh.to(tl.int64) * max_ctx * HD
    vc = v_cache_ptr + kvh.to(tl.int64) * max_ctx * HD
    if split == 0:
        # (p broadcast to a vector: the interpreter rejects a scalar & vector store mask)
        slot_ok = d_mask & ((offs_d * 0 + p) < max_ctx)
        tl.store(kc + p.to(tl.int64) * HD + offs_d[None, :], k_new.to(cdt), mask=slot_ok[None, :])
        tl.store(vc + p.to(tl.int64) * HD + offs_d, v_new, mask=slot_ok)

    # this split's positions [start, end) of 0..p; the cache holds all but p itself
    n_tok = p + 1
    per_split = tl.cdiv(tl.cdiv(n_tok, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, n_tok)
    cache_end = tl.minimum(tl.minimum(end, p), max_ctx)

    q_dot = q.to(cdt)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for n0 in range(start, cache_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < cache_end
        kv_off = offs_n.to(tl.int64)[:, None] * HD + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        kt = tl.load(kc + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q_dot, tl.trans(kt), input_precision=DOT_PRECISION) * qk_scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))          # finite: the tile has a valid column
        alpha = tl.exp2(m_i - m_new)
        pexp = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pexp, axis=1)
        vt = tl.load(vc + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(pexp.to(cdt), vt, input_precision=DOT_PRECISION)
        m_i = m_new

    # the new token (position p) belongs to the split whose range holds p
    s_cur = tl.sum(q * k_new, axis=1) * qk_scale_log2
    s_cur = tl.where((p >= start) & (p < end), s_cur, float("-inf"))
    m_new = tl.maximum(m_i, s_cur)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)    # empty split: no -inf - -inf
    alpha = tl.exp2(m_i - m_safe)
    p_cur = tl.exp2(s_cur - m_safe)
    l_i = l_i * alpha + p_cur
    p_cur_r = p_cur.to(cdt).to(tl.float32)          # rounded like the P of the P V dot above
    acc = acc * alpha[:, None] + p_cur_r[:, None] * v_new.to(tl.float32)[None, :]

    rec = part_ptr + (heads.to(tl.int64) * NUM_SPLITS + split) * (HD + 2)
    tl.store(rec[:, None] + offs_d[None, :], acc, mask=h_mask[:, None] & d_mask[None, :])
    tl.store(rec + HD, m_new, mask=h_mask)
    tl.store(rec + HD + 1, l_i, mask=h_mask)


@triton.jit
def _attn_decode_combine_kernel(part_ptr, qg_ptr, out_ptr, pos_ptr,
                                HD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                                BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                                BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    _gemv._pdl_start(PDL)
    _gemv._pdl_wait(PDL)
    # grid (head, head_dim block): merge the (m, l, acc) partials of the splits that hold
    # positions (the same split arithmetic as the split kernel; the others are empty), in
    # split order, BLOCK_S at a time, so a short context reads few partials
    h = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_D
    act = out_ptr.dtype.element_ty
    p = tl.load(pos_ptr).to(tl.int32)
    n_tok = p + 1
    per_split = tl.cdiv(tl.cdiv(n_tok, NUM_SPLITS), BLOCK_N) * BLOCK_N
    n_active = tl.minimum(tl.cdiv(n_tok, per_split), NUM_SPLITS)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = d0 + tl.arange(0, BLOCK_D)
    d_mask = offs_d < HD
    base = part_ptr + (h * NUM_SPLITS).to(tl.int64) * (HD + 2)
    m_max = tl.full((BLOCK_S,), float("-inf"), dtype=tl.float32)
    for s0 in range(0, n_active, BLOCK_S):
        sm = (s0 + offs_s) < n_active
        m = tl.load(base + (s0 + offs_s).to(tl.int64) * (HD + 2) + HD, mask=sm, other=float("-inf"))
        m_max = tl.maximum(m_max, m)
    mx = tl.max(m_max, axis=0)                   # split 0 always holds position 0: finite
    num = tl.zeros((BLOCK_D,), dtype=tl.float32)
    den = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for s0 in range(0, n_active, BLOCK_S):
        sm = (s0 + offs_s) < n_active
        rec = base + (s0 + offs_s).to(tl.int64) * (HD + 2)
        m = tl.load(rec + HD, mask=sm, other=float("-inf"))
        l = tl.load(rec + HD + 1, mask=sm, other=0.0)
        w = tl.exp2(m - mx)
        acc = tl.load(rec[:, None] + offs_d[None, :], mask=sm[:, None] & d_mask[None, :], other=0.0)
        num += tl.sum(w[:, None] * acc, axis=0)
        den += w * l
    o = num / tl.sum(den, axis=0)
    o = o.to(act).to(tl.float32)
    gate = tl.load(qg_ptr + h * (2 * HD) + HD + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sg = tl.sigmoid(gate).to(act).to(tl.float32)
    tl.store(out_ptr + h * HD + offs_d, (o * sg).to(act), mask=d_mask)


def partials_numel(num_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of the `partials` scratch: (acc[hd], m, l) per (head, split)."""
    return num_heads * num_splits * (head_dim + 2)


def plan_num_splits(max_context: int, num_kv_heads: int, *, sm_count: int = 132,
                    block_n: int = 32) -> int:
    """A capture-time split count: enough (kv head, split) programs to cover the SMs when the
    context is long, never more splits than BLOCK_N-sized pieces of max_context. Short
    contexts use fewer splits automatically (the split length is rounded up to BLOCK_N)."""
    want = max(1, sm_count // max(1, num_kv_heads))
    return max(1, min(want, cdiv(max_context, block_n)))


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError("attention_decode: " + msg)


def attention_decode(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, pos: torch.Tensor, out: torch.Tensor,
                     partials: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                     head_dim: int, rotary_dim: int, rope_theta: float, eps: float,
                     num_splits: int, block_n: int | None = None) -> torch.Tensor:
    """One decode step of gated attention at the position held in `pos` (int32/int64 [1]).

    qg [H*2*hd] (per head: query then gate), k, v [Hkv*hd], q_norm_w, k_norm_w [hd],
    k_cache, v_cache [Hkv, max_ctx, hd] contiguous (slot p is written), out [H*hd],
    partials fp32 with >= partials_numel(H, hd, num_splits) elements. The caller guarantees
    p < max_ctx (the kernel masks the cache write and reads past it, but cannot report it).
    Returns out."""
    H, Hkv, hd, rot = int(num_heads), int(num_kv_heads), int(head_dim), int(rotary_dim)
    _expect(Hkv >= 1 and H % Hkv == 0, f"num_heads {H} must be a multiple of num_kv_heads {Hkv}")
    _expect(rot % 2 == 0 and 2 <= rot <= hd, f"rotary_dim {rot} must be even and <= head_dim")
    _expect(qg.numel() == H * 2 * hd and qg.is_contiguous(), f"qg must hold {H * 2 * hd} values")
    _expect(k.numel() == Hkv * hd and v.numel() == Hkv * hd and k.is_contiguous()
            and v.is_contiguous(), f"k and v must hold {Hkv * hd} values")
    _expect(q_norm_w.numel() == hd and k_norm_w.numel() == hd and q_norm_w.is_contiguous()
            and k_norm_w.is_contiguous(), f"q_norm_w and k_norm_w must hold {hd} values")
    _expect(k_cache.dim() == 3 and k_cache.shape[0] == Hkv and k_cache.shape[2] == hd
            and k_cache.is_contiguous() and v_cache.shape == k_cache.shape
            and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype,
            f"k_cache and v_cache must be contiguous [{Hkv}, max_ctx, {hd}] of one dtype")
    _expect(pos.numel() == 1 and pos.dtype in (torch.int32, torch.int64),
            "pos must be an int32/int64 device tensor of one element")
    _expect(out.numel() == H * hd and out.is_contiguous(), f"out must hold {H * hd} values")
    num_splits = int(num_splits)
    _expect(num_splits >= 1, "num_splits must be >= 1")
    _expect(partials.dtype == torch.float32 and partials.is_contiguous()
            and partials.numel() >= partials_numel(H, hd, num_splits),
            f"partials must be contiguous float32 with >= {partials_numel(H, hd, num_splits)} "
            "elements")
    for t, name in ((qg, "qg"), (k, "k"), (v, "v"), (q_norm_w, "q_norm_w"),
                    (k_norm_w, "k_norm_w"), (k_cache, "k_cache"), (out, "out")):
        if t.dtype not in _DTYPES:
            raise TypeError(f"attention_decode: {name} dtype {t.dtype} not in {_DTYPES}")
    for t in (k, v, q_norm_w, k_norm_w, k_cache, v_cache, pos, out, partials):
        _expect(t.device == qg.device, "all tensors must be on one device")
    _expect(qg.dtype == k.dtype == out.dtype, "qg, k and out must share the activation dtype")

    group = H // Hkv
    block_d = max(16, next_pow2(hd))
    block_h = max(16, next_pow2(group))          # tl.dot needs M >= 16
    if block_n is None:
        block_n = max(16, min(64, 8192 // block_d))
    max_ctx = k_cache.shape[1]
    freq_log2_step = -2.0 * math.log2(float(rope_theta)) / rot
    # fp32 caches get exact fp32 dots (tests); bf16/fp16 use the default tensor-core path
    dot_precision = "ieee" if k_cache.dtype == torch.float32 else None
    num_warps = 4 if block_d <= 128 else 8
    _attn_decode_split_kernel[(Hkv, num_splits)](
        qg, k, v, q_norm_w, k_norm_w, k_cache, v_cache, pos, partials, max_ctx, float(eps),
        float(hd) ** -0.5 * LOG2E, freq_log2_step,
        HD=hd, ROT=rot, GROUP=group, NUM_SPLITS=num_splits, BLOCK_H=block_h, BLOCK_D=block_d,
        BLOCK_N=block_n, DOT_PRECISION=dot_precision, PDL=_gemv.pdl_mode(qg.device),
        num_warps=num_warps, **_gemv._launch_kw(qg.device))
    block_s = min(16, next_pow2(num_splits))
    block_dc = min(block_d, 64)
    _attn_decode_combine_kernel[(H, cdiv(hd, block_dc))](
        partials, qg, out, pos, HD=hd, NUM_SPLITS=num_splits,
        BLOCK_S=block_s, BLOCK_D=block_dc, BLOCK_N=block_n, PDL=_gemv.pdl_mode(qg.device),
        num_warps=2, **_gemv._launch_kw(qg.device))
    return out
