"""Gated full-attention decode for one token at position p (spec section 5), split-KV.

    q_h  = rope(rmsnorm_zc(qg[h, :hd], q_norm_w))        gate_h = qg[h, hd:]   (per-head interleave)
    k    = rope(rmsnorm_zc(k, k_norm_w));  v raw;  k_cache[:, p] = k,  v_cache[:, p] = v
    o_h  = softmax(q_h K_{g(h)}^T / sqrt(hd)) V_{g(h)}  over positions 0..p,  g(h) = h // (H/Hkv)
    out_h = round(round(o_h) * round(sigmoid(gate_h)))

RoPE is rotate-half on the first rotary_dim dims, inv_freq[j] = theta^(-2j/rotary_dim), cos and
sin computed in fp32 and rounded to the activation dtype, and the products and the sum rounded
as HF's bf16 ops round them; the QK norms round once (fp32 math, then the dtype).

One launch, grid (Hkv, num_splits): program (g, s) handles the H/Hkv query heads of KV head g
at once (a [max(16, H/Hkv), hd] query tile: `tl.dot` reads each K/V tile once for the group) over
its slice of positions: the slice length is ceil((p+1)/num_splits) rounded up to BLOCK_N and is
computed on the device from `pos`, so one CUDA graph serves every position; splits past the end
exit at once. The position, the first K/V tile, the RoPE table and the norm weights are read
before the PDL wait (earlier steps wrote them); after it, the queries, key and value in one
round trip (tiles of one layout: a load whose value needs a layout conversion makes the warp
wait for it before issuing the next load). The new token's K/V are used from registers and
written to the cache by split 0; no program reads cache slot p during this launch, so the
write cannot race a read. Softmax is online in fp32 (base 2); the probabilities are rounded to
the cache dtype for the P V tensor-core dot (HF eager also rounds its fp32 softmax to bf16
before P V). Each split stores its partials (acc rows, then (m, l)) and takes a ticket. Up to
ONE_LEVEL active splits, the split drawing the last ticket merges them all (max-rescaled, in
split order, chunks of MERGE whose loads are in flight together); more are merged in two levels
of tickets: the last split of each group of MERGE merges its group, and the group merger
drawing the KV head's last ticket merges the group partials, in order. The final merger rounds,
gates and stores the heads' outputs; each counter is reset by its last ticket's holder. (Until
the ticket, a second "combine" launch did the merge: one kernel boundary more per layer.)
With defer_splits = D, at positions with at most D active splits the launch ends at the
partial stores and its consumer merges them (merge_partials, in the o_proj's prologue: one L2
round trip instead of the ticket's release/acquire and the merger's round trips). With
defer_groups as well, past D splits every split is in a group of MERGE: the group's last ticket
merges the group and stores its partial, and the consumer merges the (at most D) group
partials: no second ticket, no final merger.

PyTorch reference: kernels/reference.py, section "attention_decode": attention_decode_ref.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, cdiv, check_pdl, decode_table, launch_kw, next_pow2, pdl_start,
                      pdl_wait)

LOG2E = 1.4426950408889634


@triton.jit
def _rope_cos_sin(offs_d, pos_f, freq_log2_step, act: tl.constexpr, ROT: tl.constexpr):
    """cos and sin of the rotate-half angles p * theta^(-2j/ROT) at every dim (fp32 math,
    rounded to the activation dtype `act` as HF's tables are)."""
    HALF: tl.constexpr = ROT // 2
    j = tl.where(offs_d < HALF, offs_d, offs_d - HALF).to(tl.float32)
    ang = pos_f * tl.exp2(j * freq_log2_step)
    return tl.cos(ang).to(act).to(tl.float32), tl.sin(ang).to(act).to(tl.float32)


@triton.jit
def _rope_partner(offs_d, ROT: tl.constexpr):
    # rotate-half pairs dim i with i + ROT/2 (the first half takes the partner negated)
    HALF: tl.constexpr = ROT // 2
    return tl.where(offs_d < HALF, offs_d + HALF, tl.where(offs_d < ROT, offs_d - HALF, offs_d))


@triton.jit
def _rope_table(pos_f, freq_log2_step, offs_d, act: tl.constexpr, ROT: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """_rope_cos_sin at every dim, evaluating each of the ROT/2 distinct angles once (the sin /
    cos code is long; the dims past ROT are masked by the caller): the same values, bit for bit.
    A rotary half that does not tile BLOCK_D falls back to one evaluation per dim."""
    HALF: tl.constexpr = ROT // 2
    if BLOCK_D % HALF == 0 and (HALF & (HALF - 1)) == 0:
        c, s = _rope_cos_sin(tl.arange(0, HALF), pos_f, freq_log2_step, act, ROT)
        # element d of the [BLOCK_D // HALF, HALF] broadcast is angle d % HALF
        c = tl.reshape(tl.broadcast_to(c[None, :], (BLOCK_D // HALF, HALF)), (BLOCK_D,))
        s = tl.reshape(tl.broadcast_to(s[None, :], (BLOCK_D // HALF, HALF)), (BLOCK_D,))
        return c, s
    else:
        return _rope_cos_sin(offs_d, pos_f, freq_log2_step, act, ROT)


@triton.jit
def _norm_weights(w_ptr, offs_d, HD: tl.constexpr, ROT: tl.constexpr):
    """The zero-centred norm weight at each dim (row 0) and at its rotate-half partner (row 1),
    as ONE [2, BLOCK_D] load (fp32)."""
    two = tl.arange(0, 2)[:, None]
    idx = tl.where(two == 0, offs_d[None, :], _rope_partner(offs_d, ROT)[None, :])
    return tl.load(w_ptr + idx, mask=(offs_d < HD)[None, :] & (two < 2), other=0.0).to(tl.float32)


@triton.jit
def _row(t, i: tl.constexpr):
    """Row i of a [2, N] tile (a sum of one value and a zero: exact)."""
    return tl.sum(tl.where(tl.arange(0, 2)[:, None] == i, t, 0.0), axis=0)


@triton.jit
def _norm_rope(x, xp, w, wp, cos, sin, offs_d, eps, act: tl.constexpr, HD: tl.constexpr,
               ROT: tl.constexpr):
    """Zero-centred RMSNorm of the head rows x ([R, BLOCK_D] fp32, zero past HD; xp = the same
    rows read at each dim's RoPE partner) with the weights (w, wp) at each dim and at its
    partner, then partial rotate-half RoPE with the (cos, sin) of _rope_cos_sin. Returns the
    rows rounded to `act` (as fp32)."""
    in_lo = offs_d < ROT // 2
    in_rot = offs_d < ROT
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HD + eps)
    xn = (x * inv_rms[:, None] * (1.0 + w[None, :])).to(act).to(tl.float32)
    xpn = (xp * inv_rms[:, None] * (1.0 + wp[None, :])).to(act).to(tl.float32)
    rot_half = tl.where(in_lo, -xpn, xpn)
    xr = ((xn * cos[None, :]).to(act).to(tl.float32)
          + (rot_half * sin[None, :]).to(act).to(tl.float32)).to(act).to(tl.float32)
    return tl.where(in_rot[None, :], xr, xn)


@triton.jit
def _kv_tile(kc, vc, n0, cache_end, offs_d, d_mask, HD: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cached K and V rows n0 .. n0 + BLOCK_N (masked at cache_end) and the row mask."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < cache_end
    kv_off = offs_n.to(tl.int64)[:, None] * HD + offs_d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    return (tl.load(kc + kv_off, mask=kv_mask, other=0.0),
            tl.load(vc + kv_off, mask=kv_mask, other=0.0), n_mask)


@triton.jit
def _attend_tile(q_dot, kt, vt, n_mask, m_i, l_i, acc, qk_scale_log2,
                 DOT_PRECISION: tl.constexpr):
    """One [BLOCK_N] tile of cached positions into the online softmax (m_i, l_i, acc). A tile
    with no valid position (n_mask all false) leaves the state as it was."""
    s = tl.dot(q_dot, tl.trans(kt), input_precision=DOT_PRECISION) * qk_scale_log2
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    pexp = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(pexp, axis=1)
    acc = acc * alpha[:, None] + tl.dot(pexp.to(vt.dtype), vt, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _split_partials(q, k_new, v_new, kt0, vt0, n_mask0, kc, vc, start, end, cache_end, p,
                    heads, h_mask, offs_d, d_mask, part_ptr, split, qk_scale_log2,
                    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HD: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """One split of the flash-decoding attention for the query rows q [BLOCK_H, BLOCK_D]
    (fp32, normed and rotated) of `heads`: the online softmax in fp32 (base 2) over the split's
    cached positions [start, cache_end) (the tile kt0 / vt0 / n_mask0 loaded by the caller,
    then the rest), then the new token (position p, key k_new, value v_new) where the split's
    range [start, end) holds p; its partials stored: the acc rows [H, NUM_SPLITS, HD] (16-byte
    aligned rows: vector loads in the merge), then the (m, l) pairs [H, NUM_SPLITS, 2], whose
    base it returns."""
    cdt = kc.dtype.element_ty
    q_dot = q.to(cdt)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    m_i, l_i, acc = _attend_tile(q_dot, kt0, vt0, n_mask0, m_i, l_i, acc, qk_scale_log2,
                                 DOT_PRECISION)
    for n0 in range(start + BLOCK_N, cache_end, BLOCK_N):
        kt, vt, n_mask = _kv_tile(kc, vc, n0, cache_end, offs_d, d_mask, HD, BLOCK_N)
        m_i, l_i, acc = _attend_tile(q_dot, kt, vt, n_mask, m_i, l_i, acc, qk_scale_log2,
                                     DOT_PRECISION)

    s_cur = tl.sum(q * k_new, axis=1) * qk_scale_log2
    s_cur = tl.where((p >= start) & (p < end), s_cur, float("-inf"))
    m_new = tl.maximum(m_i, s_cur)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p_cur = tl.exp2(s_cur - m_safe)
    l_i = l_i * alpha + p_cur
    p_cur_r = p_cur.to(cdt).to(tl.float32)      # rounded like the P of the P V dot above
    acc = acc * alpha[:, None] + p_cur_r[:, None] * v_new.to(tl.float32)

    ml_ptr = part_ptr + NUM_HEADS * NUM_SPLITS * HD
    rec = heads.to(tl.int64) * NUM_SPLITS + split
    tl.store(part_ptr + rec[:, None] * HD + offs_d[None, :], acc,
             mask=h_mask[:, None] & d_mask[None, :])
    tl.store(ml_ptr + rec * 2, m_new, mask=h_mask)
    tl.store(ml_ptr + rec * 2 + 1, l_i, mask=h_mask)
    return ml_ptr


@triton.jit
def _attn_decode_kernel(qg_ptr, k_ptr, v_ptr, qn_w_ptr, kn_w_ptr, k_cache_ptr, v_cache_ptr,
                        pos_ptr, part_ptr, cnt_ptr, out_ptr, max_ctx, eps, qk_scale_log2,
                        freq_log2_step,
                        HD: tl.constexpr, ROT: tl.constexpr, GROUP: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MERGE: tl.constexpr,
                        MERGE_TOP: tl.constexpr, ONE_LEVEL: tl.constexpr, DEFER: tl.constexpr,
                        DEFER_GROUPS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_start(PDL)
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    cdt = k_cache_ptr.dtype.element_ty
    act = out_ptr.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HD
    partner = _rope_partner(offs_d, ROT)
    kc = k_cache_ptr + kvh.to(tl.int64) * max_ctx * HD
    vc = v_cache_ptr + kvh.to(tl.int64) * max_ctx * HD
    # the norm weights (no kernel writes them), each in one load issued first
    wq2 = _norm_weights(qn_w_ptr, offs_d, HD, ROT)
    wk2 = _norm_weights(kn_w_ptr, offs_d, HD, ROT)

    # The position and the cached K/V (slots < p) were written by earlier steps: with PDL mode 1
    # (a kernel lets the next one launch only after its own wait) those launches are complete,
    # so they are read before waiting for the q/k/v producer; mode 2 lets launches run further
    # ahead, so there everything is read after the wait.
    if PDL == 2:
        pdl_wait(PDL)
    p, per_split, n_active = split_layout(pos_ptr, NUM_SPLITS, BLOCK_N)
    n_tok = p + 1
    # splits past the end hold no position: they exit (and take no ticket)
    if split < n_active:
        start = split * per_split
        end = tl.minimum(start + per_split, n_tok)
        cache_end = tl.minimum(tl.minimum(end, p), max_ctx)     # the cache holds all but p
        kt0, vt0, n_mask0 = _kv_tile(kc, vc, start, cache_end, offs_d, d_mask, HD, BLOCK_N)
        # what depends only on p and the weights: the RoPE table and the norm weights' rows
        cos, sin = _rope_table(p.to(tl.float32), freq_log2_step, offs_d, act, ROT, BLOCK_D)
        qw, qwp = _row(wq2, 0), _row(wq2, 1)
        kw, kwp = _row(wk2, 0), _row(wk2, 1)
        if PDL != 2:
            pdl_wait(PDL)          # q/k/v come from the previous kernel

        offs_h = tl.arange(0, BLOCK_H)
        h_mask = offs_h < GROUP
        heads = kvh * GROUP + offs_h
        # One round trip: the group's queries (rows past GROUP are zeros), this token's key and
        # value, all as [BLOCK_H, BLOCK_D] tiles of one layout (the key and value repeated in
        # every row: no layout conversion, which would wait on its load before the next load
        # is issued), each also read at the RoPE partner dims. The output gates are read by
        # the merge.
        qrows = qg_ptr + heads[:, None] * (2 * HD)
        qm = h_mask[:, None] & d_mask[None, :]
        rep = kvh * HD + offs_h[:, None] * 0                      # every row: this KV head
        rm = (offs_h >= 0)[:, None] & d_mask[None, :]
        qx = tl.load(qrows + offs_d[None, :], mask=qm, other=0.0).to(tl.float32)
        qxp = tl.load(qrows + partner[None, :], mask=qm, other=0.0).to(tl.float32)
        kx = tl.load(k_ptr + rep + offs_d[None, :], mask=rm, other=0.0).to(tl.float32)
        kxp = tl.load(k_ptr + rep + partner[None, :], mask=rm, other=0.0).to(tl.float32)
        v_new = tl.load(v_ptr + rep + offs_d[None, :], mask=rm, other=0.0).to(cdt)
        q = _norm_rope(qx, qxp, qw, qwp, cos, sin, offs_d, eps, act, HD, ROT)
        k_new = _norm_rope(kx, kxp, kw, kwp, cos, sin, offs_d, eps, act, HD, ROT)
        k_new = k_new.to(cdt).to(tl.float32)
        if split == 0:
            # row 0 of the repeated key / value into cache slot p (p broadcast to a vector: the
            # interpreter rejects a scalar & vector store mask)
            slot_ok = ((offs_h == 0)[:, None] & d_mask[None, :]
                       & ((offs_d * 0 + p) < max_ctx)[None, :])
            dst = p.to(tl.int64) * HD + offs_h[:, None] * 0 + offs_d[None, :]
            tl.store(kc + dst, k_new.to(cdt), mask=slot_ok)
            tl.store(vc + dst, v_new, mask=slot_ok)

        # online softmax over this split's cached positions and the new token; partials out
        ml_ptr = _split_partials(q, k_new, v_new, kt0, vt0, n_mask0, kc, vc, start, end,
                                 cache_end, p, heads, h_mask, offs_d, d_mask, part_ptr, split,
                                 qk_scale_log2, NUM_HEADS, NUM_SPLITS, HD, BLOCK_H, BLOCK_D,
                                 BLOCK_N, DOT_PRECISION)

        # Up to DEFER active splits the merge is the consumer's: the o_proj's prologue reads the
        # partials after its wait (merge_partials), so this launch ends at the partial stores,
        # with no ticket and no merger, and does not write `out`.
        if n_active > DEFER:
            # The merge (no second launch). Up to ONE_LEVEL splits: the split drawing the last
            # ticket merges them all, MERGE at a time (every load of a chunk in flight
            # together). More: two levels of tickets. The splits form groups of MERGE; the split
            # that finishes last in its group merges the group and stores the group's partial;
            # the group merger that finishes last merges the group partials. Every partial store
            # is issued before its ticket (release), the last ticket reads them (acquire), and
            # each counter is reset by the program that drew its last ticket, ready for the next
            # launch. (At 32K one merger reading the 66 splits in turn took 10.5 us; at ~20
            # splits the two levels' second ticket costs more than the chunks it saves.)
            tl.debug_barrier()
            NG: tl.constexpr = (NUM_SPLITS + MERGE - 1) // MERGE
            two = n_active > ONE_LEVEL
            grp = tl.where(two, split // MERGE, 0)
            g_lo = grp * MERGE
            g_hi = tl.where(two, tl.minimum(g_lo + MERGE, n_active), n_active)
            n_groups = tl.where(two, tl.cdiv(n_active, MERGE), 1)
            cnt_kv = cnt_ptr + kvh * (NG + 1)
            ticket = tl.atomic_add(cnt_kv + grp, 1, sem="acq_rel", scope="gpu")
            if ticket == g_hi - g_lo - 1:
                offs_g = tl.arange(0, BLOCK_G)
                g_mask = offs_g < GROUP
                hrow = kvh * GROUP + offs_g
                gd_mask = g_mask[:, None] & d_mask[None, :]
                # the output gates, in flight with the first chunk (used only by the final merger)
                gate = tl.load(qg_ptr + hrow[:, None] * (2 * HD) + HD + offs_d[None, :],
                               mask=gd_mask, other=0.0).to(tl.float32)
                run_max = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
                num = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
                den = tl.zeros((BLOCK_G,), dtype=tl.float32)
                for c0 in range(g_lo, g_hi, MERGE):
                    run_max, num, den = _merge_chunk(part_ptr, ml_ptr, hrow, g_mask, NUM_SPLITS, c0,
                                                     g_hi, run_max, num, den, offs_d, d_mask, HD,
                                                     MERGE)
                tl.atomic_xchg(cnt_kv + grp, 0, sem="relaxed", scope="gpu")
                # this group's partial: (num, run_max, den) in the split partials' format
                gacc_ptr = ml_ptr + NUM_HEADS * NUM_SPLITS * 2
                gml_ptr = gacc_ptr + NUM_HEADS * NG * HD
                grec = hrow.to(tl.int64) * NG + grp
                if DEFER_GROUPS:
                    # the consumer merges the group partials (merge_partials): no second ticket
                    tl.store(gacc_ptr + grec[:, None] * HD + offs_d[None, :], num, mask=gd_mask)
                    tl.store(gml_ptr + grec * 2, run_max, mask=g_mask)
                    tl.store(gml_ptr + grec * 2 + 1, den, mask=g_mask)
                else:
                    last = n_groups == 1
                    if n_groups > 1:
                        tl.store(gacc_ptr + grec[:, None] * HD + offs_d[None, :], num,
                                 mask=gd_mask)
                        tl.store(gml_ptr + grec * 2, run_max, mask=g_mask)
                        tl.store(gml_ptr + grec * 2 + 1, den, mask=g_mask)
                        tl.debug_barrier()
                        t_top = tl.atomic_add(cnt_kv + NG, 1, sem="acq_rel", scope="gpu")
                        last = t_top == n_groups - 1
                        if last:
                            run_max = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
                            num = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
                            den = tl.zeros((BLOCK_G,), dtype=tl.float32)
                            for c0 in range(0, n_groups, MERGE_TOP):
                                run_max, num, den = _merge_chunk(gacc_ptr, gml_ptr, hrow, g_mask,
                                                                 NG, c0, n_groups, run_max, num,
                                                                 den, offs_d, d_mask, HD,
                                                                 MERGE_TOP)
                            tl.atomic_xchg(cnt_kv + NG, 0, sem="relaxed", scope="gpu")
                    if last:
                        o = num / tl.where(den > 0.0, den, 1.0)[:, None]
                        o = o.to(act).to(tl.float32)
                        sg = tl.sigmoid(gate).to(act).to(tl.float32)
                        tl.store(out_ptr + hrow[:, None] * HD + offs_d[None, :],
                                 (o * sg).to(act), mask=gd_mask)


@triton.jit
def _merge_chunk(acc_ptr, ml_ptr, hrow, g_mask, N_REC, lo, n_valid, run_max, num, den, offs_d,
                 d_mask, HD: tl.constexpr, CHUNK: tl.constexpr):
    """Folds the partial records lo .. min(lo + CHUNK, n_valid) of the heads `hrow` (acc rows
    at acc_ptr [heads, N_REC, HD], (m, l) pairs at ml_ptr [heads, N_REC, 2]) into the running
    max-rescaled (run_max, num, den), in record order. Every load of the chunk is issued
    together (acc rows first: they stay in flight while (m, l) arrive); .cg: the records were
    written by other SMs, read from L2, never a stale L1 line."""
    offs_c = tl.arange(0, CHUNK)
    a_rows = ()
    for i in tl.static_range(CHUNK):
        # (a vector: the interpreter rejects a scalar & vector mask)
        ok = g_mask & ((hrow * 0 + lo + i) < n_valid)
        rr = hrow.to(tl.int64) * N_REC + lo + i
        a_rows = a_rows + (tl.load(acc_ptr + rr[:, None] * HD + offs_d[None, :],
                                   mask=ok[:, None] & d_mask[None, :], other=0.0,
                                   cache_modifier=".cg"),)
    cg_mask = ((lo + offs_c) < n_valid)[:, None] & g_mask[None, :]
    ml = ml_ptr + (hrow.to(tl.int64)[None, :] * N_REC + lo + offs_c[:, None]) * 2
    m_c = tl.load(ml, mask=cg_mask, other=float("-inf"), cache_modifier=".cg")
    l_c = tl.load(ml + 1, mask=cg_mask, other=0.0, cache_modifier=".cg")
    c_max = tl.maximum(run_max, tl.max(m_c, axis=0))
    c_safe = tl.where(c_max == float("-inf"), 0.0, c_max)   # padded heads only
    scale = tl.exp2(run_max - c_safe)
    w_c = tl.exp2(m_c - c_safe[None, :])
    den = den * scale + tl.sum(w_c * l_c, axis=0)
    num = num * scale[:, None]
    for i in tl.static_range(CHUNK):
        w_i = tl.sum(tl.where(offs_c[:, None] == i, w_c, 0.0), axis=0)   # row i
        num += w_i[:, None] * a_rows[i]
    return c_max, num, den


@triton.jit
def split_layout(pos_ptr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(p, positions per split, active splits) of the launch at the position in pos_ptr."""
    p = tl.load(pos_ptr).to(tl.int32)
    n_tok = p + 1
    per_split = tl.cdiv(tl.cdiv(n_tok, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return p, per_split, tl.minimum(tl.cdiv(n_tok, per_split), NUM_SPLITS)


@triton.jit
def merge_partials(part_ptr, hh, dd, n_active, NUM_SPLITS: tl.constexpr,
                   NUM_HEADS: tl.constexpr, HD: tl.constexpr, DEFER: tl.constexpr,
                   MERGE: tl.constexpr, GROUPS: tl.constexpr):
    """The attention output (fp32, not rounded) of the heads hh ([R, 1]) at the dims dd
    ([1, HD]) that a launch with defer_splits = DEFER left to its consumer: merged from the
    partials of its n_active <= DEFER splits, or (GROUPS: a launch with defer_groups, past
    DEFER splits) from the partials of its ceil(n_active / MERGE) <= DEFER merge groups. Every
    load is issued first (one L2 round trip; .cg: the partials were written by other SMs),
    then the max-rescaled sum in record order. (The record strides are selected at run time:
    two branches with constant strides were no faster on the H200.)"""
    if GROUPS:
        NG: tl.constexpr = (NUM_SPLITS + MERGE - 1) // MERGE
        GACC: tl.constexpr = NUM_HEADS * NUM_SPLITS * (HD + 2)
        grp = n_active > DEFER
        acc_off = tl.where(grp, GACC, 0)
        ml_off = tl.where(grp, GACC + NUM_HEADS * NG * HD, NUM_HEADS * NUM_SPLITS * HD)
        n_rec = tl.where(grp, NG, NUM_SPLITS)
        n_valid = tl.where(grp, tl.cdiv(n_active, MERGE), n_active)
    else:
        acc_off = 0
        ml_off = NUM_HEADS * NUM_SPLITS * HD
        n_rec = NUM_SPLITS
        n_valid = n_active
    acc_ptr = part_ptr + acc_off
    ml_ptr = part_ptr + ml_off
    rec = hh.to(tl.int64) * n_rec
    accs = ()
    for s in tl.static_range(DEFER):
        ok = (hh * 0 + s) < n_valid
        accs = accs + (tl.load(acc_ptr + (rec + s) * HD + dd, mask=ok & (dd < HD), other=0.0,
                               cache_modifier=".cg"),)
    ms = ()
    ls = ()
    for s in tl.static_range(DEFER):
        ok = (hh * 0 + s) < n_valid
        ms = ms + (tl.load(ml_ptr + (rec + s) * 2, mask=ok, other=float("-inf"),
                           cache_modifier=".cg"),)
        ls = ls + (tl.load(ml_ptr + (rec + s) * 2 + 1, mask=ok, other=0.0,
                           cache_modifier=".cg"),)
    m = ms[0]
    for s in tl.static_range(1, DEFER):
        m = tl.maximum(m, ms[s])
    m = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros_like(ls[0])
    num = tl.zeros_like(accs[0])
    for s in tl.static_range(DEFER):
        w = tl.exp2(ms[s] - m)
        den += w * ls[s]
        num += w * accs[s]
    return num / tl.where(den > 0.0, den, 1.0)


DEFAULT_MERGE = 8      # splits a merger reads at once (4 and 16 were slower on the H200)
ONE_LEVEL_CHUNKS = 4   # up to 4 chunks of splits one merger reads them all (H200 step: two
                       # levels 3.6% faster at 4K, 65 splits; 2.8% slower at 640, 21 splits)


def _n_groups(num_splits: int, merge_splits: int) -> int:
    return cdiv(int(num_splits), int(merge_splits))


def partials_numel(num_heads: int, head_dim: int, num_splits: int,
                   merge_splits: int = DEFAULT_MERGE) -> int:
    """fp32 elements of the `partials` scratch: acc[hd] and (m, l) per (head, split), then the
    same per (head, group of merge_splits splits)."""
    return num_heads * (num_splits + _n_groups(num_splits, merge_splits)) * (head_dim + 2)


def counters_numel(num_kv_heads: int, num_splits: int, merge_splits: int = DEFAULT_MERGE) -> int:
    """int32 elements of the `counters` scratch: a ticket counter per (KV head, group of
    merge_splits splits) and one per KV head for the group mergers."""
    return num_kv_heads * (_n_groups(num_splits, merge_splits) + 1)


def plan_num_splits(max_context: int, num_kv_heads: int, *, sm_count: int = 132,
                    block_n: int = 32) -> int:
    """A capture-time split count: enough (kv head, split) programs to cover the SMs when the
    context is long, never more splits than BLOCK_N-sized pieces of max_context (pass the
    launch's tile, tile_positions(), or splits past the last position idle). Short contexts use
    fewer splits automatically (the split length is rounded up to BLOCK_N)."""
    want = max(1, sm_count // max(1, num_kv_heads))
    return max(1, min(want, cdiv(max_context, block_n)))


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError("attention_decode: " + msg)


def attention_plan(num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """The decode table's launch plan for this attention shape (block_n, num_warps, num_stages,
    defer_splits: up to how many active splits the engine leaves the merge to the o_proj, and
    defer_groups: 1 when past them it leaves the merge of the group partials too; any may be
    absent): measured in the captured step on the device, see decode_tuning.json.
    {} when the table has no entry (the sizes chosen in attention_decode apply)."""
    e = decode_table().get(f"attention:{int(num_heads)}x{int(num_kv_heads)}x{int(head_dim)}")
    plan = {}
    for k in ("block_n", "num_warps", "num_stages", "defer_splits", "defer_groups"):
        try:
            v = int(e[k]) if e is not None and k in e else 0
        except (TypeError, ValueError):
            v = 0
        if k == "block_n":
            v = v if v & (v - 1) == 0 else 0
        elif k == "defer_splits":
            v = min(v, MAX_DEFER)
        elif k == "defer_groups":
            v = 1 if v else 0
        if v > 0:
            plan[k] = v
    return plan


def attention_range_plans(num_heads: int, num_kv_heads: int,
                          head_dim: int) -> list[tuple[int, Optional[int], dict]]:
    """[(from, below, plan)] ascending by `from`: launch plans the step measured faster than the
    entry's own over a range of positions (decode_tuning.json, the attention entry's
    `context_ranges`; `below` None: to the end of the context). A plan gives splits_per_sm (the
    launch's splits a KV head are splits_per_sm x the SMs / the KV heads, as plan_num_splits
    caps them), block_n, num_warps, num_stages and merge_splits. [] without such ranges; a
    range that is malformed, empty or repeats a start is left out, and so is one whose sizes
    are out of bounds: tiles of 16 to 128 positions, warps and merge groups powers of two,
    merge groups of 2 to MAX_DEFER splits (a merger holds a group at once), 1 to 4 splits an SM
    and 1 to 4 pipeline stages. (The engine captures one decode graph per range,
    engine/triton_backend.py.)"""
    e = decode_table().get(f"attention:{int(num_heads)}x{int(num_kv_heads)}x{int(head_dim)}")
    if e is None or not isinstance(e.get("context_ranges"), list):
        return []
    out: dict[int, tuple[Optional[int], dict]] = {}
    for r in e["context_ranges"]:
        try:
            lo = int(r.get("from", 0))
            hi = None if r.get("below") is None else int(r["below"])
            p = {k: int(r[k]) for k in ("splits_per_sm", "block_n", "num_warps", "num_stages",
                                        "merge_splits")}
        except (AttributeError, KeyError, TypeError, ValueError):
            continue
        pow2 = all(v >= 1 and v & (v - 1) == 0
                   for v in (p["block_n"], p["num_warps"], p["merge_splits"]))
        if (lo < 0 or (hi is not None and hi <= lo) or lo in out or not pow2
                or not 16 <= p["block_n"] <= 128 or not 2 <= p["merge_splits"] <= MAX_DEFER
                or not 1 <= p["splits_per_sm"] <= 4 or not 1 <= p["num_stages"] <= 4):
            continue
        out[lo] = (hi, p)
    return [(lo, hi, p) for lo, (hi, p) in sorted(out.items())]


MAX_DEFER = 16         # partials a consumer merges at once (in registers: ~8 per split a thread)


class DeferredMerge(NamedTuple):
    """What the consumer of a launch with defer_splits > 0 reads: the launch's partials, its
    position and q|gate projection (the consumer applies the output gate), and its shape.
    block_n, num_splits, merge_splits and defer_groups must be the launch's (deferred_merge()
    builds it so)."""
    partials: torch.Tensor
    pos: torch.Tensor
    qg: torch.Tensor
    num_heads: int
    head_dim: int
    num_splits: int
    block_n: int
    defer_splits: int
    merge_splits: int = DEFAULT_MERGE
    defer_groups: bool = False


def deferred_merge(qg: torch.Tensor, pos: torch.Tensor, partials: torch.Tensor, *,
                   num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int,
                   defer_splits: int, block_n: int | None = None,
                   merge_splits: int | None = None, defer_groups: bool = False) -> DeferredMerge:
    """The DeferredMerge of attention_decode(qg, ..., pos, ..., partials, num_splits=...,
    defer_splits=..., block_n=..., merge_splits=..., defer_groups=...) (block_n None: the
    launch's default, tile_positions; merge_splits None: DEFAULT_MERGE)."""
    bn = int(block_n or tile_positions(num_heads, num_kv_heads, head_dim))
    return DeferredMerge(partials, pos, qg, int(num_heads), int(head_dim), int(num_splits), bn,
                         int(defer_splits), int(merge_splits or DEFAULT_MERGE), bool(defer_groups))


def groups_deferrable(num_splits: int, defer_splits: int,
                      merge_splits: int = DEFAULT_MERGE) -> bool:
    """Whether a launch with these splits can take defer_groups: its consumer merges at most
    defer_splits records, so the merge groups must number no more."""
    return 0 < int(defer_splits) and _n_groups(num_splits, merge_splits) <= int(defer_splits)


def tile_positions(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Cached positions per K/V tile (BLOCK_N) of the launch for this shape: the decode table's
    plan, else a [BLOCK_N, head_dim] tile of up to 8K elements, 16 to 64 positions."""
    return (attention_plan(num_heads, num_kv_heads, head_dim).get("block_n")
            or max(16, min(64, 8192 // max(16, next_pow2(int(head_dim))))))


def attention_decode(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, pos: torch.Tensor, out: torch.Tensor,
                     partials: torch.Tensor, counters: torch.Tensor, *, num_heads: int,
                     num_kv_heads: int,
                     head_dim: int, rotary_dim: int, rope_theta: float, eps: float,
                     num_splits: int, block_n: int | None = None,
                     merge_splits: int | None = None, one_level_splits: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     defer_splits: int = 0, defer_groups: bool = False,
                     pdl: int = 0) -> torch.Tensor:
    """One decode step of gated attention at the position held in `pos` (int32/int64 [1]).

    qg [H*2*hd] (per head: query then gate), k, v [Hkv*hd], q_norm_w, k_norm_w [hd],
    k_cache, v_cache [Hkv, max_ctx, hd] contiguous (slot p is written), out [H*hd],
    partials fp32 with >= partials_numel(H, hd, num_splits, merge_splits) elements, counters
    int32 with >= counters_numel(Hkv, num_splits, merge_splits) elements, zeroed once when
    allocated (every launch leaves them zero). The caller guarantees p < max_ctx (the kernel
    masks the cache write and reads past it, but cannot report it).
    block_n (positions per K/V tile), merge_splits (the splits a merger reads at a time and a
    merge group's size, a power of two; DEFAULT_MERGE), one_level_splits (up to this many active
    splits one merger reads them all; more are merged in two levels; ONE_LEVEL_CHUNKS x
    merge_splits), num_warps and num_stages (the software pipelining of the K/V tile loop)
    default to the decode table's plan for the shape (attention_plan), else to sizes chosen
    here. defer_splits = D > 0: at positions with at most D active splits the launch stops at
    the split partials and leaves `out` alone; its consumer merges them (gemv with
    merge=DeferredMerge(...), the o_proj's prologue), which also applies the output gate.
    defer_groups (with defer_splits = D, when the merge groups number at most D: see
    groups_deferrable): past D active splits the launch merges each group of merge_splits
    splits (its last ticket) and stops at the group partials, which the consumer merges; so no
    position writes `out` and the group mergers draw no second ticket. `pdl`: see
    _common.pdl_mode. Returns out."""
    pdl = check_pdl(pdl, "attention_decode")
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
    merge = int(merge_splits or DEFAULT_MERGE)
    _expect(merge >= 1 and merge & (merge - 1) == 0, "merge_splits must be a power of two")
    need_p = partials_numel(H, hd, num_splits, merge)
    _expect(partials.dtype == torch.float32 and partials.is_contiguous()
            and partials.numel() >= need_p,
            f"partials must be contiguous float32 with >= {need_p} elements")
    for t, name in ((qg, "qg"), (k, "k"), (v, "v"), (q_norm_w, "q_norm_w"),
                    (k_norm_w, "k_norm_w"), (k_cache, "k_cache"), (out, "out")):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"attention_decode: {name} dtype {t.dtype} not in {FLOAT_DTYPES}")
    need_c = counters_numel(Hkv, num_splits, merge)
    _expect(counters.dtype == torch.int32 and counters.is_contiguous()
            and counters.numel() >= need_c,
            f"counters must be a contiguous int32 tensor of >= {need_c} zeroed elements")
    for t in (k, v, q_norm_w, k_norm_w, k_cache, v_cache, pos, out, partials, counters):
        _expect(t.device == qg.device, "all tensors must be on one device")
    _expect(qg.dtype == k.dtype == out.dtype, "qg, k and out must share the activation dtype")

    group = H // Hkv
    block_d = max(16, next_pow2(hd))
    block_h = max(16, next_pow2(group))          # tl.dot needs M >= 16
    plan = attention_plan(H, Hkv, hd)
    if block_n is None:
        block_n = tile_positions(H, Hkv, hd)
    num_stages = num_stages or plan.get("num_stages")
    max_ctx = k_cache.shape[1]
    freq_log2_step = -2.0 * math.log2(float(rope_theta)) / rot
    # fp32 caches get exact fp32 dots (tests); bf16/fp16 use the default tensor-core path
    dot_precision = "ieee" if k_cache.dtype == torch.float32 else None
    num_warps = num_warps or plan.get("num_warps") or (4 if block_d <= 128 else 8)
    block_g = next_pow2(group)
    # the group mergers' partials: one chunk of up to 16 records at a time
    merge_top = min(16, next_pow2(_n_groups(num_splits, merge)))
    one_level = ONE_LEVEL_CHUNKS * merge if one_level_splits is None else int(one_level_splits)
    defer = int(defer_splits)
    _expect(0 <= defer <= MAX_DEFER, f"defer_splits must be in 0..{MAX_DEFER}")
    defer_groups = bool(defer_groups)
    _expect(not defer_groups or groups_deferrable(num_splits, defer, merge),
            f"defer_groups needs defer_splits >= the merge groups ({_n_groups(num_splits, merge)})")
    if defer_groups:
        one_level = 0                            # every active split is in a merge group
    _attn_decode_kernel[(Hkv, num_splits)](
        qg, k, v, q_norm_w, k_norm_w, k_cache, v_cache, pos, partials, counters, out, max_ctx,
        float(eps), float(hd) ** -0.5 * LOG2E, freq_log2_step,
        HD=hd, ROT=rot, GROUP=group, NUM_SPLITS=num_splits, NUM_HEADS=H, BLOCK_H=block_h,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, MERGE=merge,
        MERGE_TOP=merge_top, ONE_LEVEL=one_level, DEFER=defer, DEFER_GROUPS=defer_groups,
        DOT_PRECISION=dot_precision, PDL=pdl, num_warps=num_warps,
        **({"num_stages": int(num_stages)} if num_stages else {}), **launch_kw(pdl))
    return out
