"""Decode GEMV (batch 1, one token): out = W @ x with W [N, K] row-major (nn.Linear layout),
with the neighbouring operators fused in (see the block comment above the kernels):

    prologue   none | zero-centred RMSNorm of x | gated RMSNorm per value head | the attention's
               deferred split merge
    epilogue   plain | + residual (out may alias residual) | silu(Wg x) * (Wu x) for W = [Wg; Wu]
               | the GDN causal-conv update of the first conv_dim rows

Accumulation is fp32 and the epilogue rounds ONCE to out.dtype (the residual add and the SiLU
product happen on the fp32 sums).

Decode is memory-bound (every weight byte is read once per token), so a program owns BLOCK_N
rows and streams them along K in [BLOCK_N, BLOCK_K] tiles: multiply by the broadcast x and keep
a 2-D fp32 accumulator, reduced over K once at the end (`tl.dot` needs M >= 16). K-contiguous
rows and power-of-two BLOCK_K give 16-byte vector loads; W is read with `evict_first` (read
once), x with `evict_last` (every program reads it). Split-K adds a grid axis over K ranges for
the shapes whose row grid is too small to fill the GPU, reduced in-kernel in a fixed order (no
atomics on the data: bit-reproducible run to run).

Block sizes come from `decode_tuning.json` (written by the decode tuners, engine/tuning/) keyed
by shape, prologue and epilogue, with a heuristic fallback for other shapes; `plan()` is
what the engine calls at load.

PyTorch reference: kernels/reference.py, section "gemv": gemv_ref (and matvec_ref, the bare product).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import attention_decode as _attn
from ._common import (FLOAT_DTYPES, cdiv, check_pdl, decode_table, launch_kw, next_pow2, pdl_start,
                      pdl_wait, sm_count)

# The fallback plans aim at this many programs (H200: 132 SMs, ~2 resident GEMV programs each).
TARGET_PROGRAMS = 264
MAX_SPLIT_K = 8


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# ------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------
#
#   prologue  PRO_NONE     x = v
#             PRO_RMS      x = round(v * rsqrt(mean(v^2) + eps) * (1 + w))          (zero-centred)
#             PRO_GATED    per value head j of width DV:
#                          n = round(o_j * rsqrt(mean(o_j^2) + eps));  x_j = round(w * n * silu(z_j))
#             PRO_ATTN     the attention's output merged from its split partials (or its merge
#                          groups' partials) when its launch left the merge (attention_decode
#                          defer_splits, defer_groups), gated:
#                          x = round(round(o) * round(sigmoid(gate))); else x = v (persistent form)
#   epilogue  EPI_PLAIN    out = y
#             EPI_RESIDUAL out = residual + y                    (out may alias residual: h += W x)
#             EPI_SILU_MUL out = silu(y_gate) * y_up              (W = [gate; up])
#             EPI_CONV     rows c < conv_dim: m = round(y); s = [state[c] | m];
#                          out[c] = round(silu(round(sum_j w[c, j] s[j])));  state[c] <- s[1:]
#                          other rows: out = y
#
# Every program recomputes the prologue from the whole input vector (2-8 KB, L2-resident)
# instead of reading a normalised copy: that is what removes the separate norm launches. `round`
# is the rounding to the activation dtype (the dtype of the prologue's input vector), placed
# exactly where the unfused sequence (norm kernel -> bf16 buffer -> GEMV) rounds.
#
# Latency: a decode GEMV's time past its bytes is a chain of dependent memory round trips, so
# everything that no earlier kernel of the step writes (the first weight tile, the prologue's
# norm weights) and everything whose writer is already complete under PDL mode 1 (the
# epilogue's residual rows and conv state) is read before the PDL wait, and after it every
# activation load is issued before the first value that waits on one (_x_first).
#
# Split-K without a second launch: each (row block, split) program writes its fp32 partial sums,
# then takes a ticket from a per-row-block counter; the program that draws the last ticket sums
# the SPLIT_K partials in split order (deterministic, whatever order the programs finish in),
# runs the epilogue and resets the counter to 0 for the next launch (so a CUDA graph replays it).

PRO_NONE, PRO_RMS, PRO_GATED, PRO_ATTN = 0, 1, 2, 4
EPI_PLAIN, EPI_RESIDUAL, EPI_SILU_MUL, EPI_CONV = 0, 1, 2, 3
_EPILOGUES = {"plain": EPI_PLAIN, "residual": EPI_RESIDUAL, "silu_mul": EPI_SILU_MUL,
              "conv": EPI_CONV}

@triton.jit
def _rms_inv(v_ptr, n, eps, BLOCK: tl.constexpr):
    """rsqrt(mean(v[:n]^2) + eps) in fp32."""
    offs = tl.arange(0, BLOCK)
    ss = tl.zeros((BLOCK,), dtype=tl.float32)
    for i0 in range(0, n, BLOCK):
        v = tl.load(v_ptr + i0 + offs, mask=i0 + offs < n, other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        ss += v * v
    return tl.rsqrt(tl.sum(ss, axis=0) / n + eps)


@triton.jit
def _w_load(w_rows, ks, row_mask, k_ok, MASK_N: tl.constexpr, MASK_K: tl.constexpr,
            EVICT: tl.constexpr = True):
    """W[rows, ks] in its storage dtype (a prefetch keeps it packed until used); EVICT marks
    the loads evict-first (the weights are streamed once; the LM head's plan goes without)."""
    policy: tl.constexpr = "evict_first" if EVICT else ""
    if MASK_K:
        if MASK_N:
            m = row_mask[:, None] & k_ok[None, :]
        else:
            m = k_ok[None, :]
        w = tl.load(w_rows + ks[None, :], mask=m, other=0.0, eviction_policy=policy)
    else:
        if MASK_N:
            w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None], other=0.0,
                        eviction_policy=policy)
        else:
            w = tl.load(w_rows + ks[None, :], eviction_policy=policy)
    return w


@triton.jit
def _w_tile(w_rows, ks, row_mask, k_ok, MASK_N: tl.constexpr, MASK_K: tl.constexpr):
    """W[rows, ks] in fp32, streamed once; masks only where the shape is ragged."""
    return _w_load(w_rows, ks, row_mask, k_ok, MASK_N, MASK_K).to(tl.float32)


@triton.jit
def _x_rms(x_ptr, nw_ptr, ks, k_ok, inv_rms, PRO: tl.constexpr, MASK_K: tl.constexpr):
    """The GEMV input at ks: v, or round(v * inv_rms * (1 + w)) for PRO_RMS (masked lanes 0)."""
    if MASK_K:
        v = tl.load(x_ptr + ks, mask=k_ok, other=0.0, eviction_policy="evict_last")
    else:
        v = tl.load(x_ptr + ks, eviction_policy="evict_last")
    x = v.to(tl.float32)
    if PRO == 1:
        if MASK_K:
            nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0, eviction_policy="evict_last")
        else:
            nw = tl.load(nw_ptr + ks, eviction_policy="evict_last")
        x = (x * inv_rms * (1.0 + nw.to(tl.float32))).to(v.dtype).to(tl.float32)
    return x


@triton.jit
def _x_tile_raw(x_ptr, ks, k_ok, MASK_K: tl.constexpr):
    """x[ks] as stored (kept in cache for the other programs; masked only for a ragged K)."""
    if MASK_K:
        return tl.load(x_ptr + ks, mask=k_ok, other=0.0, eviction_policy="evict_last")
    else:
        return tl.load(x_ptr + ks, eviction_policy="evict_last")


@triton.jit
def _x_first(x_ptr, nw0, ks, k_ok, K, eps, PRO: tl.constexpr, MASK_K: tl.constexpr,
             BLOCK_X: tl.constexpr, ONE_X: tl.constexpr):
    """(the GEMV input at ks, inv_rms) right after the PDL wait: _rms_inv then _x_rms, with every
    load issued before the first value that waits on one (the whole vector for the norm, then
    this tile; the tile's norm weights `nw0` were read before the wait), so the prologue costs
    one L2 round trip instead of two. ONE_X: the whole vector is one BLOCK_X load."""
    if PRO == 1:
        if ONE_X:
            offs = tl.arange(0, BLOCK_X)
            v = tl.load(x_ptr + offs, mask=offs < K, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            v0 = _x_tile_raw(x_ptr, ks, k_ok, MASK_K)
            inv_rms = tl.rsqrt(tl.sum(v * v, axis=0) / K + eps)    # = _rms_inv, one block
        else:
            v0 = _x_tile_raw(x_ptr, ks, k_ok, MASK_K)
            inv_rms = _rms_inv(x_ptr, K, eps, BLOCK_X)
        x = v0.to(tl.float32) * inv_rms * (1.0 + nw0.to(tl.float32))
        x = x.to(v0.dtype).to(tl.float32)
    else:
        x = _x_tile_raw(x_ptr, ks, k_ok, MASK_K).to(tl.float32)
        inv_rms = 1.0
    return x, inv_rms


@triton.jit
def _nw_first(nw_ptr, ks, k_ok, PRO: tl.constexpr, MASK_K: tl.constexpr):
    """The norm weights of the first tile (PRO_RMS; read before the PDL wait: no kernel writes
    them); a 0.0 placeholder otherwise."""
    nw0 = 0.0
    if PRO == 1:
        if MASK_K:
            nw0 = tl.load(nw_ptr + ks, mask=k_ok, other=0.0, eviction_policy="evict_last")
        else:
            nw0 = tl.load(nw_ptr + ks, eviction_policy="evict_last")
    return nw0


@triton.jit
def _x_gated(o_ptr, z_ptr, nw_ptr, base, ds, d_ok, inv_rms, MASK_K: tl.constexpr):
    """round(w[ds] * round(o * inv_rms) * silu(z)) at head offset `base` (masked lanes 0)."""
    if MASK_K:
        o = tl.load(o_ptr + base + ds, mask=d_ok, other=0.0, eviction_policy="evict_last")
        z = tl.load(z_ptr + base + ds, mask=d_ok, other=0.0, eviction_policy="evict_last")
        nw = tl.load(nw_ptr + ds, mask=d_ok, other=0.0, eviction_policy="evict_last")
    else:
        o = tl.load(o_ptr + base + ds, eviction_policy="evict_last")
        z = tl.load(z_ptr + base + ds, eviction_policy="evict_last")
        nw = tl.load(nw_ptr + ds, eviction_policy="evict_last")
    act = o.dtype
    n = (o.to(tl.float32) * inv_rms).to(act).to(tl.float32)
    zf = z.to(tl.float32)
    return (nw.to(tl.float32) * n * (zf * tl.sigmoid(zf))).to(act).to(tl.float32)


@triton.jit
def _epi_pre(rows, row_mask, res_ptr, conv_state_ptr, conv_w_ptr, CONV_DIM,
             EPI: tl.constexpr, KW: tl.constexpr, BLOCK_N: tl.constexpr):
    """What the epilogue reads besides the GEMV result: the residual rows (EPI_RESIDUAL), the
    conv state and weights of the conv channels among the rows (EPI_CONV; `s_nxt` = the state
    shifted by one slot), loaded as whole [rows, taps] tiles. The direct forms read them before
    the PDL wait (then the epilogue waits on no load after the K loop)."""
    KWP: tl.constexpr = triton.next_power_of_2(KW)
    jj = tl.arange(0, KWP)
    r = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w2 = tl.zeros((BLOCK_N, KWP), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_N, KWP), dtype=tl.float32)
    s_nxt = tl.zeros((BLOCK_N, KWP), dtype=tl.float32)
    if EPI == 1:
        r = tl.load(res_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    if EPI == 3:
        is_conv = row_mask & (rows < CONV_DIM)
        c = tl.where(is_conv, rows, 0).to(tl.int64)
        s_rows = conv_state_ptr + c[:, None] * (KW - 1)
        w2 = tl.load(conv_w_ptr + c[:, None] * KW + jj[None, :],
                     mask=is_conv[:, None] & (jj[None, :] < KW), other=0.0).to(tl.float32)
        s2 = tl.load(s_rows + jj[None, :], mask=is_conv[:, None] & (jj[None, :] < KW - 1),
                     other=0.0).to(tl.float32)
        s_nxt = tl.load(s_rows + jj[None, :] + 1, mask=is_conv[:, None] & (jj[None, :] < KW - 2),
                        other=0.0).to(tl.float32)
    return r, w2, s2, s_nxt


@triton.jit
def _col(t, jj, j: tl.constexpr):
    """Column j of a [BLOCK_N, KWP] tile (a sum of one value and zeros: exact)."""
    return tl.sum(tl.where(jj[None, :] == j, t, 0.0), axis=1)


@triton.jit
def _epilogue(y, up, rows, row_mask, out_ptr, conv_state_ptr, CONV_DIM, r, w2, s2, s_nxt,
                    EPI: tl.constexpr, KW: tl.constexpr):
    # r, w2, s2, s_nxt: _epi_pre's loads for these rows
    out_ty = out_ptr.dtype.element_ty
    act_dtype = out_ty                            # the unfused path rounds to its buffer
    if EPI == 2:
        y = y * tl.sigmoid(y) * up
    if EPI == 1:
        y += r
    if EPI == 3:
        # causal depthwise conv step for the conv channels among these rows (one owner each)
        KWP: tl.constexpr = triton.next_power_of_2(KW)
        jj = tl.arange(0, KWP)
        is_conv = row_mask & (rows < CONV_DIM)
        c = tl.where(is_conv, rows, 0).to(tl.int64)
        m_new = y.to(act_dtype)                   # the projection output, as stored unfused
        acc = m_new.to(tl.float32) * _col(w2, jj, KW - 1)
        for j in tl.static_range(KW - 1):         # the unfused order: newest tap first
            acc += _col(s2, jj, j) * _col(w2, jj, j)
        conv = acc.to(act_dtype).to(tl.float32)
        silu = (conv * tl.sigmoid(conv)).to(act_dtype).to(tl.float32)
        # the state shifted by one slot, the new value last: after the K reduction a row's
        # value sits in several threads, each storing the same values; the barrier keeps every
        # replica's reads of the old state (_epi_pre) before any of these stores
        new_s = tl.where(jj[None, :] == KW - 2, m_new.to(tl.float32)[:, None], s_nxt)
        tl.debug_barrier()
        tl.store(conv_state_ptr + c[:, None] * (KW - 1) + jj[None, :],
                 new_s.to(conv_state_ptr.dtype.element_ty),
                 mask=is_conv[:, None] & (jj[None, :] < KW - 1))
        y = tl.where(is_conv, silu, y)
    tl.store(out_ptr + rows, y.to(out_ty), mask=row_mask)


@triton.jit
def _gemv_kernel(x_ptr, z_ptr, nw_ptr, w_ptr, out_ptr, res_ptr, conv_state_ptr,
                       conv_w_ptr, part_ptr, cnt_ptr,
                       N_OUT, K, stride_w, eps, K_PER_SPLIT, CONV_DIM,
                       PRO: tl.constexpr, EPI: tl.constexpr, DV: tl.constexpr,
                       KW: tl.constexpr, SPLIT_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_X: tl.constexpr,
                       ONE_X: tl.constexpr, MASK_N: tl.constexpr, MASK_K: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    PAIR: tl.constexpr = EPI == 2
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N_OUT
    offs_k = tl.arange(0, BLOCK_K)
    g_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    u_rows = w_ptr + (rows + N_OUT).to(tl.int64)[:, None] * stride_w    # PAIR: up half
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # The direct form reads what its epilogue needs besides the result (residual rows, conv
    # state and weights) before the PDL wait: earlier kernels wrote them, and with PDL mode 1 (a
    # kernel lets the next one launch only after its own wait) those are complete; mode 2 lets
    # launches run further ahead, so there they are read after the loop.
    EPI_EARLY: tl.constexpr = SPLIT_K == 1 and PDL != 2
    EPI_LATE: tl.constexpr = SPLIT_K == 1 and PDL == 2
    if EPI_EARLY:
        r, w2, s2, s_nxt = _epi_pre(rows, row_mask, res_ptr, conv_state_ptr, conv_w_ptr,
                                    CONV_DIM, EPI, KW, BLOCK_N)

    if PRO == 2:
        # K = heads x DV; the splits own whole heads
        n_heads = K // DV
        h_lo = pid_s * K_PER_SPLIT
        h_hi = tl.minimum(h_lo + K_PER_SPLIT, n_heads)
        # first weight tile in flight before waiting for the producer kernel
        w0 = _w_load(g_rows, h_lo * DV + offs_k, row_mask, offs_k < DV, MASK_N, MASK_K)
        pdl_wait(PDL)
        offs_d = tl.arange(0, BLOCK_X)
        for hh in range(h_lo, h_hi):
            base = hh * DV
            o_h = tl.load(x_ptr + base + offs_d, mask=offs_d < DV, other=0.0,
                          eviction_policy="evict_last").to(tl.float32)
            inv_rms = tl.rsqrt(tl.sum(o_h * o_h, axis=0) / DV + eps)
            for d0 in tl.static_range(0, DV, BLOCK_K):
                ds = d0 + offs_k
                d_ok = ds < DV
                x = _x_gated(x_ptr, z_ptr, nw_ptr, base, ds, d_ok, inv_rms, MASK_K)
                if d0 == 0:
                    if hh == h_lo:
                        w = w0.to(tl.float32)   # the tile prefetched before the wait
                    else:
                        w = _w_tile(g_rows, base + ds, row_mask, d_ok, MASK_N, MASK_K)
                else:
                    w = _w_tile(g_rows, base + ds, row_mask, d_ok, MASK_N, MASK_K)
                acc += w * x[None, :]
    else:
        k_lo = pid_s * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        ks0 = k_lo + offs_k
        w0 = _w_load(g_rows, ks0, row_mask, ks0 < k_hi, MASK_N, MASK_K)
        if PAIR:
            u0 = _w_load(u_rows, ks0, row_mask, ks0 < k_hi, MASK_N, MASK_K)
        nw0 = _nw_first(nw_ptr, ks0, ks0 < k_hi, PRO, MASK_K)
        pdl_wait(PDL)
        x, inv_rms = _x_first(x_ptr, nw0, ks0, ks0 < k_hi, K, eps, PRO, MASK_K, BLOCK_X, ONE_X)
        acc += w0.to(tl.float32) * x[None, :]
        if PAIR:
            acc_u += u0.to(tl.float32) * x[None, :]
        for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
            ks = k0 + offs_k
            k_ok = ks < k_hi
            x = _x_rms(x_ptr, nw_ptr, ks, k_ok, inv_rms, PRO, MASK_K)
            acc += _w_tile(g_rows, ks, row_mask, k_ok, MASK_N, MASK_K) * x[None, :]
            if PAIR:
                acc_u += _w_tile(u_rows, ks, row_mask, k_ok, MASK_N, MASK_K) * x[None, :]

    y = tl.sum(acc, axis=1)
    up = tl.sum(acc_u, axis=1)
    if EPI_LATE:
        r, w2, s2, s_nxt = _epi_pre(rows, row_mask, res_ptr, conv_state_ptr, conv_w_ptr,
                                    CONV_DIM, EPI, KW, BLOCK_N)
    if SPLIT_K == 1:
        _epilogue(y, up, rows, row_mask, out_ptr, conv_state_ptr, CONV_DIM, r, w2, s2,
                        s_nxt, EPI, KW)
    else:
        n_part = N_OUT * (2 if PAIR else 1)       # partial rows per split
        tl.store(part_ptr + pid_s * n_part + rows, y, mask=row_mask)
        if PAIR:
            tl.store(part_ptr + pid_s * n_part + N_OUT + rows, up, mask=row_mask)
        # all of this program's partial stores are issued before its ticket (release)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            y = tl.zeros((BLOCK_N,), dtype=tl.float32)
            up = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: read the other SMs' partials from L2, never a stale L1 line
                y += tl.load(part_ptr + s * n_part + rows, mask=row_mask, other=0.0,
                             cache_modifier=".cg")
                if PAIR:
                    up += tl.load(part_ptr + s * n_part + N_OUT + rows, mask=row_mask,
                                  other=0.0, cache_modifier=".cg")
            r, w2, s2, s_nxt = _epi_pre(rows, row_mask, res_ptr, conv_state_ptr, conv_w_ptr,
                                        CONV_DIM, EPI, KW, BLOCK_N)
            _epilogue(y, up, rows, row_mask, out_ptr, conv_state_ptr, CONV_DIM, r, w2,
                            s2, s_nxt, EPI, KW)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")   # ready to replay


@triton.jit
def _gemv_persistent_kernel(x_ptr, z_ptr, nw_ptr, w_ptr, out_ptr, res_ptr, conv_state_ptr,
                                  conv_w_ptr, ap_ptr, pos_ptr, N_OUT, K, stride_w, eps, CONV_DIM,
                                  PRO: tl.constexpr, EPI: tl.constexpr, DV: tl.constexpr,
                                  KW: tl.constexpr, NPROG: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, MASK_K: tl.constexpr,
                                  PDL: tl.constexpr, A_NS: tl.constexpr, A_BN: tl.constexpr,
                                  A_DEFER: tl.constexpr, A_MERGE: tl.constexpr,
                                  A_GROUPS: tl.constexpr):
    # Persistent direct form (no split-K): NPROG programs (a few per SM) stride over the row
    # blocks; a row block's whole K (BLOCK_K >= K) is one tile. The first tile is loaded before
    # the PDL wait, the input vector (and its norm) once per program, and each iteration loads
    # the next row block's tile before reducing the current one (one tile of look-ahead). Few,
    # resident programs leave room on the SMs for the next kernel's programs, which start their
    # own weight prefetch while this one streams. PRO_GATED here: K = (K / DV) heads x DV, both
    # powers of two (the whole gated input is one [heads, DV] tile, flattened); PRO_ATTN the
    # same with the attention's heads (DV = head_dim; z_ptr = its q|gate projection, ap_ptr its
    # split partials, A_NS / A_BN / A_DEFER / A_MERGE / A_GROUPS its split count, tile,
    # defer_splits, merge group size and defer_groups).
    pdl_start(PDL)
    pid = tl.program_id(0)
    PAIR: tl.constexpr = EPI == 2
    n_blocks = tl.cdiv(N_OUT, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    rows = pid * BLOCK_N + offs_n
    row_mask = rows < N_OUT
    w_cur = _w_load(w_ptr + rows.to(tl.int64)[:, None] * stride_w, ks, row_mask, k_ok, True, MASK_K)
    u_cur = w_cur
    if PAIR:
        u_cur = _w_load(w_ptr + (rows + N_OUT).to(tl.int64)[:, None] * stride_w, ks, row_mask,
                        k_ok, True, MASK_K)
    # the first row block's epilogue inputs before the wait (PDL mode 1: their writers are
    # complete; see _gemv_kernel), the later blocks' one block ahead in the loop
    if PDL != 2:
        r, w2, s2, s_nxt = _epi_pre(rows, row_mask, res_ptr, conv_state_ptr, conv_w_ptr,
                                    CONV_DIM, EPI, KW, BLOCK_N)
    # the prologue's norm weights before the wait (no kernel writes them); after it, every
    # activation load issued before the first value that waits on one
    if PRO == 2:
        NH: tl.constexpr = BLOCK_K // DV
        dd = tl.arange(0, DV)
        off2 = tl.arange(0, NH)[:, None] * DV + dd[None, :]
        nw = tl.load(nw_ptr + dd, eviction_policy="evict_last").to(tl.float32)
        pdl_wait(PDL)
        o2 = tl.load(x_ptr + off2, eviction_policy="evict_last")
        zf = tl.load(z_ptr + off2, eviction_policy="evict_last").to(tl.float32)
        act = o2.dtype
        of = o2.to(tl.float32)
        inv = tl.rsqrt(tl.sum(of * of, axis=1) / DV + eps)
        n = (of * inv[:, None]).to(act).to(tl.float32)
        x = tl.reshape((nw[None, :] * n * (zf * tl.sigmoid(zf))).to(act).to(tl.float32),
                       (BLOCK_K,))
    elif PRO == 4:
        NHA: tl.constexpr = BLOCK_K // DV
        hh = tl.arange(0, NHA)[:, None]
        dd = tl.arange(0, DV)[None, :]
        act = x_ptr.dtype.element_ty
        # the position and the q|gate projection (two launches back) are final before the wait
        # in PDL mode 1: the split layout, and the gates when this launch merges
        if PDL == 2:
            pdl_wait(PDL)
        p_, per_split_, n_active = _attn.split_layout(pos_ptr, A_NS, A_BN)
        if A_GROUPS:
            merged = n_active > 0              # the split partials, or past A_DEFER the groups'
        else:
            merged = n_active <= A_DEFER
        g = tl.zeros((NHA, DV), dtype=tl.float32)
        if merged:
            g = tl.load(z_ptr + hh * (2 * DV) + DV + dd, eviction_policy="evict_last")
            g = tl.sigmoid(g.to(tl.float32)).to(act).to(tl.float32)
        if PDL != 2:
            pdl_wait(PDL)
        if merged:
            o = _attn.merge_partials(ap_ptr, hh, dd, n_active, A_NS, NHA, DV, A_DEFER, A_MERGE,
                                     A_GROUPS)
            xo = (o.to(act).to(tl.float32) * g).to(act).to(tl.float32)
        else:
            xo = tl.load(x_ptr + hh * DV + dd, eviction_policy="evict_last").to(tl.float32)
        x = tl.reshape(xo, (BLOCK_K,))
    else:
        nw0 = _nw_first(nw_ptr, ks, k_ok, PRO, MASK_K)
        pdl_wait(PDL)
        x, inv_rms = _x_first(x_ptr, nw0, ks, k_ok, K, eps, PRO, MASK_K, BLOCK_K, True)
    if PDL == 2:
        r, w2, s2, s_nxt = _epi_pre(rows, row_mask, res_ptr, conv_state_ptr, conv_w_ptr,
                                    CONV_DIM, EPI, KW, BLOCK_N)
    for rb in range(pid, n_blocks, NPROG):
        rows = rb * BLOCK_N + offs_n
        row_mask = rows < N_OUT
        nrows = (rb + NPROG) * BLOCK_N + offs_n
        nmask = nrows < N_OUT                       # past the last block: nothing is loaded
        w_nxt = _w_load(w_ptr + nrows.to(tl.int64)[:, None] * stride_w, ks, nmask, k_ok, True,
                        MASK_K)
        u_nxt = w_nxt
        if PAIR:
            u_nxt = _w_load(w_ptr + (nrows + N_OUT).to(tl.int64)[:, None] * stride_w, ks, nmask,
                            k_ok, True, MASK_K)
        r_n, w2_n, s2_n, s_nxt_n = _epi_pre(nrows, nmask, res_ptr, conv_state_ptr, conv_w_ptr,
                                            CONV_DIM, EPI, KW, BLOCK_N)
        y = tl.sum(w_cur.to(tl.float32) * x[None, :], axis=1)
        up = y
        if PAIR:
            up = tl.sum(u_cur.to(tl.float32) * x[None, :], axis=1)
        _epilogue(y, up, rows, row_mask, out_ptr, conv_state_ptr, CONV_DIM, r, w2, s2,
                        s_nxt, EPI, KW)
        w_cur = w_nxt
        u_cur = u_nxt
        r, w2, s2, s_nxt = r_n, w2_n, s2_n, s_nxt_n


def gated_persistent_ok(k: int, head_dim: int) -> bool:
    """Whether the persistent form can take the gated prologue for K = heads x head_dim."""
    return (head_dim >= 1 and k % head_dim == 0 and head_dim & (head_dim - 1) == 0
            and (k // head_dim) & (k // head_dim - 1) == 0)


def heuristic_plan(n_out: int, k: int, prologue: str = "none", head_dim: int = 0,
                         silu_mul: bool = False) -> dict:
    """Fallback launch plan for a fused GEMV: dict(split_k, block_n, block_k, num_warps)."""
    if prologue == "gated":
        block_k = min(256, next_pow2(max(head_dim, 16)))
    else:
        block_k = min(512, next_pow2(max(k, 16)))
    per_tile = 2048 if silu_mul else 4096            # the pair form holds two tiles
    block_n = max(1, min(32, per_tile // block_k, next_pow2(n_out)))
    programs = cdiv(n_out, block_n)
    split_k = 1
    if programs < TARGET_PROGRAMS // 2:
        units = (k // head_dim) if prologue == "gated" else cdiv(k, block_k)
        split_k = max(1, min(MAX_SPLIT_K, cdiv(TARGET_PROGRAMS, programs), units // 2))
    return dict(split_k=split_k, block_n=block_n, block_k=block_k, num_warps=4)


def plan_key(n_out: int, k: int, prologue: str, epilogue: str) -> str:
    """Table key of a fused GEMV: e.g. 'gemv:8224x1024:rms:conv'."""
    return f"gemv:{n_out}x{k}:{prologue}:{epilogue}"


def _fits(p: dict, k: int, prologue: str, head_dim: int) -> bool:
    """A gated-prologue plan's tiles stay within one head, unless it is the persistent form
    where that form can take the shape; other prologues take any table plan."""
    return prologue != "gated" or p["block_k"] <= next_pow2(head_dim) or bool(
        p["persistent"] and gated_persistent_ok(k, head_dim))


def plan(n_out: int, k: int, prologue: str = "none", epilogue: str = "plain",
               head_dim: int = 0, split_k_enabled: bool = True) -> dict:
    """Launch plan of a fused GEMV from decode_tuning.json, else heuristic_plan.
    split_k_enabled=False gives the best direct (split_k = 1) form the tuner measured."""
    e = decode_table().get(plan_key(n_out, k, prologue, epilogue))
    if e is not None:
        try:
            p = dict(split_k=int(e["split_k"]), block_n=int(e["block_n"]),
                     block_k=int(e["block_k"]), num_warps=int(e["num_warps"]),
                     persistent=int(e.get("persistent", 0)))
            if not split_k_enabled and p["split_k"] > 1:
                p = dict(split_k=1, block_n=int(e["direct_block_n"]), block_k=int(e["direct_block_k"]),
                         num_warps=int(e["direct_num_warps"]),
                         persistent=int(e.get("direct_persistent", 0)))
            if _fits(p, k, prologue, head_dim):
                return p
        except (KeyError, TypeError, ValueError):
            pass
    p = heuristic_plan(n_out, k, prologue, head_dim, epilogue == "silu_mul")
    if not split_k_enabled and p["split_k"] > 1:
        # direct form: narrow row blocks so the grid still covers the SMs
        p = dict(p, split_k=1, block_n=max(1, min(p["block_n"], next_pow2(max(1, n_out // TARGET_PROGRAMS)))))
    return p


def range_plans(n_out: int, k: int, prologue: str = "none", epilogue: str = "plain",
                      head_dim: int = 0, split_k_enabled: bool = True) -> list[tuple[int, dict]]:
    """[(below, plan)], ascending: the plans the step measured faster than the entry's own for
    contexts shorter than `below` positions (decode_tuning.json, the entry's `context_ranges`;
    the engine captures one decode graph per range, engine/triton_backend.py). A plan applies
    from the previous range's `below` (or 0) up to its own. [] without such ranges; a range
    that is malformed, repeats a bound, splits K with split-K off or does not fit the shape
    (as plan checks the entry's own plan) is left out."""
    e = decode_table().get(plan_key(n_out, k, prologue, epilogue))
    if e is None or not isinstance(e.get("context_ranges"), list):
        return []
    out: dict[int, dict] = {}
    for r in e["context_ranges"]:
        try:
            below = int(r["below"])
            p = dict(split_k=int(r["split_k"]), block_n=int(r["block_n"]),
                     block_k=int(r["block_k"]), num_warps=int(r["num_warps"]),
                     persistent=int(r.get("persistent", 0)))
        except (KeyError, TypeError, ValueError):
            continue
        pow2 = all(v >= 1 and v & (v - 1) == 0 for v in (p["block_n"], p["block_k"], p["num_warps"]))
        if (below <= 0 or below in out or not pow2 or p["split_k"] < 1
                or p["persistent"] not in (0, 1, 2) or (p["persistent"] and p["split_k"] != 1)
                or (not split_k_enabled and p["split_k"] > 1) or not _fits(p, k, prologue, head_dim)):
            continue
        out[below] = p
    return sorted(out.items())


def scratch_numel(n_out: int, plan_: dict, silu_mul: bool = False) -> tuple[int, int]:
    """(fp32 partials, int32 counters) elements a split-K fused launch needs (0, 0 if none).
    The counters must be zeroed once at allocation; the kernel leaves them at zero."""
    s = int(plan_["split_k"])
    if s <= 1:
        return 0, 0
    return s * n_out * (2 if silu_mul else 1), cdiv(n_out, int(plan_["block_n"]))


def gemv(x: torch.Tensor, W: torch.Tensor, out: torch.Tensor, *,
               norm_w: Optional[torch.Tensor] = None, eps: float = 1e-6,
               gate: Optional[torch.Tensor] = None, head_dim: int = 0,
               residual: Optional[torch.Tensor] = None, silu_mul: bool = False,
               conv_state: Optional[torch.Tensor] = None, conv_w: Optional[torch.Tensor] = None,
               split_k: Optional[int] = None, partials: Optional[torch.Tensor] = None,
               counters: Optional[torch.Tensor] = None, block_n: Optional[int] = None,
               block_k: Optional[int] = None, num_warps: Optional[int] = None,
               persistent: Optional[int] = None, merge=None, pdl: int = 0) -> torch.Tensor:
    """One fused decode GEMV (see the block comment above); returns out.

    Prologue: none; `norm_w` alone = zero-centred RMSNorm of x (norm_w [K]); `norm_w` + `gate`
    + `head_dim` = gated RMSNorm per head (x = o [K], gate = z [K], norm_w [head_dim]).
    Epilogue: plain; `residual` (out may be residual itself); `silu_mul` (W = [gate; up],
    out [N/2]); `conv_state` [C, Kc-1] + `conv_w` [C, Kc] = the GDN causal-conv update of the
    first C rows (state updated in place). The norm is rounded to x.dtype, the conv to
    out.dtype.
    split_k > 1 needs `partials` (fp32) and `counters` (int32, zeroed once) of
    scratch_numel() elements. `persistent` = P > 0 (direct form, prologue none/rms only):
    P programs per SM stride over the row blocks, each row's whole K one tile (block_k is
    ignored). `merge` (attention_decode.DeferredMerge, persistent form only): x is the gated
    attention output, merged here from the split partials at positions where the attention's
    launch left the merge (x = its `out` elsewhere). Block sizes default to plan().
    `pdl`: see _common.pdl_mode. Never allocates/syncs."""
    _expect(W.dim() == 2 and W.is_contiguous() and W.dtype in FLOAT_DTYPES,
            "gemv: W must be a contiguous [N, K] float matrix")
    n_rows, K = W.shape
    _expect(x.numel() == K and x.is_contiguous() and x.dtype in FLOAT_DTYPES,
            f"gemv: x must be a contiguous float vector of {K}, got {tuple(x.shape)}")
    _expect(not silu_mul or n_rows % 2 == 0, "gemv: silu_mul needs an even number of rows")
    n_out = n_rows // 2 if silu_mul else n_rows
    _expect(out.numel() == n_out and out.is_contiguous() and out.dtype in FLOAT_DTYPES,
            f"gemv: out must be a contiguous float vector of {n_out}")
    dev = out.device
    _expect(x.device == W.device == dev, "gemv: tensors must be on one device")

    pro_name, pro = "none", PRO_NONE
    dv = 1
    if merge is not None:
        dv, nh = int(merge.head_dim), int(merge.num_heads)
        _expect(gate is None and norm_w is None and conv_state is None and not silu_mul,
                "gemv: the attention merge is a prologue of its own")
        _expect(nh * dv == K and dv & (dv - 1) == 0 and nh & (nh - 1) == 0,
                f"gemv: the merge needs K = heads x head_dim, both powers of two (K={K})")
        _expect(merge.qg.numel() == 2 * K and merge.qg.is_contiguous() and merge.qg.device == dev,
                f"gemv: the merge's q|gate projection must hold {2 * K} values")
        _expect(merge.pos.numel() == 1 and merge.pos.dtype in (torch.int32, torch.int64)
                and merge.pos.device == dev, "gemv: the merge's pos must be one device int")
        ms = int(merge.merge_splits)
        _expect(ms >= 1 and ms & (ms - 1) == 0, "gemv: the merge's merge_splits must be a "
                "power of two")
        need = _attn.partials_numel(nh, dv, int(merge.num_splits), ms)
        _expect(merge.partials.dtype == torch.float32 and merge.partials.is_contiguous()
                and merge.partials.numel() >= need and merge.partials.device == dev,
                f"gemv: the merge's partials must be float32 with >= {need} elements")
        _expect(0 <= int(merge.defer_splits) <= _attn.MAX_DEFER and int(merge.block_n) >= 1,
                "gemv: the merge's defer_splits / block_n are out of range")
        _expect(not merge.defer_groups
                or _attn.groups_deferrable(int(merge.num_splits), int(merge.defer_splits), ms),
                "gemv: the merge's groups outnumber its defer_splits")
        _expect(persistent is None or int(persistent) > 0,
                "gemv: the attention merge runs in the persistent form")
        _expect(split_k in (None, 1), "gemv: the attention merge takes no split-K")
        persistent = 1 if persistent is None else persistent
        split_k = 1
        pro_name, pro = "attn", PRO_ATTN
    elif gate is not None:
        dv = int(head_dim)
        _expect(norm_w is not None and dv >= 1 and K % dv == 0,
                "gemv: the gated norm needs norm_w and a head_dim dividing K")
        _expect(gate.numel() == K and gate.is_contiguous() and gate.dtype == x.dtype
                and gate.device == dev, f"gemv: gate must be a contiguous [{K}] like x")
        _expect(norm_w.numel() == dv and norm_w.is_contiguous() and norm_w.device == dev,
                f"gemv: the gated norm weight must hold head_dim={dv} values")
        pro_name, pro = "gated", PRO_GATED
    elif norm_w is not None:
        _expect(norm_w.numel() == K and norm_w.is_contiguous() and norm_w.device == dev,
                f"gemv: norm_w must be a contiguous [{K}] vector")
        pro_name, pro = "rms", PRO_RMS

    modes = [residual is not None, bool(silu_mul), conv_state is not None]
    _expect(sum(modes) <= 1, "gemv: choose at most one of residual, silu_mul, conv")
    epi_name = ("residual" if modes[0] else "silu_mul" if modes[1]
                else "conv" if modes[2] else "plain")
    epi = _EPILOGUES[epi_name]
    kw, conv_dim = 2, 0
    if residual is not None:
        _expect(residual.numel() == n_out and residual.is_contiguous() and residual.device == dev,
                f"gemv: residual must be a contiguous [{n_out}] vector")
    if conv_state is not None:
        _expect(conv_w is not None, "gemv: the conv epilogue needs conv_w")
        if conv_w.dim() == 3 and conv_w.shape[1] == 1:
            conv_w = conv_w.view(conv_w.shape[0], conv_w.shape[2])
        _expect(conv_w.dim() == 2 and conv_w.is_contiguous() and conv_w.shape[1] >= 2,
                "gemv: conv_w must be a contiguous [C, Kc] matrix with Kc >= 2")
        conv_dim, kw = conv_w.shape
        _expect(conv_dim <= n_out, "gemv: more conv channels than output rows")
        _expect(tuple(conv_state.shape) == (conv_dim, kw - 1) and conv_state.is_contiguous()
                and conv_state.device == dev and conv_w.device == dev,
                f"gemv: conv_state must be a contiguous [{conv_dim}, {kw - 1}] matrix")

    if None in (split_k, block_n, block_k, num_warps, persistent):
        p = plan(n_out, K, pro_name, epi_name, dv)
    else:
        p = {}                                   # the caller (the engine) passes the whole plan
    if persistent is None:
        # the plan's persistent form applies only when the caller keeps the plan's direct form
        persistent = p.get("persistent", 0) if split_k in (None, 1) and block_n is None else 0
    persistent = int(persistent)
    if not persistent and p.get("persistent", 0):
        # the plan is the persistent form but the caller asked for the grid form (a split
        # count or tile of its own): the grid form's tiles, not the persistent ones
        p = heuristic_plan(n_out, K, pro_name, dv, bool(silu_mul))
    split_k = int(p["split_k"] if split_k is None else split_k)
    block_n = int(block_n or p["block_n"])
    block_k = int(block_k or p["block_k"])
    num_warps = int(num_warps or p["num_warps"])
    _expect(block_n >= 1 and block_n & (block_n - 1) == 0, "gemv: block_n must be a power of 2")
    _expect(block_k >= 16 and block_k & (block_k - 1) == 0,
            "gemv: block_k must be a power of 2 >= 16")
    _expect(1 <= split_k <= 64, "gemv: split_k must be in 1..64")
    n_blocks = cdiv(n_out, block_n)
    res = residual if residual is not None else out
    cs = conv_state if conv_state is not None else out
    cw = conv_w if conv_state is not None else out
    pdl = check_pdl(pdl, "gemv")
    if persistent > 0:
        _expect(pro != PRO_GATED or gated_persistent_ok(K, dv),
                "gemv: the persistent form takes a gated-norm prologue only when the head "
                "size and the head count are powers of two")
        _expect(split_k == 1, "gemv: the persistent form is the direct (split_k = 1) form")
        bk = max(16, next_pow2(K))
        nprog = max(1, min(n_blocks, persistent * sm_count(dev)))
        zp = merge.qg if merge is not None else gate if gate is not None else x
        ap, pp = (merge.partials, merge.pos) if merge is not None else (x, x)
        attn_kw = (dict(A_NS=int(merge.num_splits), A_BN=int(merge.block_n),
                        A_DEFER=int(merge.defer_splits), A_MERGE=int(merge.merge_splits),
                        A_GROUPS=bool(merge.defer_groups)) if merge is not None
                   else dict(A_NS=1, A_BN=1, A_DEFER=0, A_MERGE=1, A_GROUPS=False))
        _gemv_persistent_kernel[(nprog,)](
            x, zp, norm_w if norm_w is not None else x, W, out, res, cs, cw, ap, pp, n_out, K,
            W.stride(0), float(eps), conv_dim, PRO=pro, EPI=epi, DV=dv, KW=kw, NPROG=nprog,
            BLOCK_N=block_n, BLOCK_K=bk, MASK_K=K != bk, PDL=pdl, num_warps=num_warps,
            **attn_kw, **launch_kw(pdl))
        return out
    if pro == PRO_GATED:
        _expect(block_k <= max(16, next_pow2(dv)),
                "gemv: with the gated norm block_k must not exceed the head size")
        units = K // dv                                    # splits own whole heads
        per_split = cdiv(units, split_k)
        mask_k = dv % block_k != 0
        block_x = next_pow2(dv)
    else:
        per_split = cdiv(cdiv(K, split_k), block_k) * block_k
        mask_k = K % block_k != 0
        block_x = min(1024, next_pow2(K))
    grid_s = cdiv(K // dv if pro == PRO_GATED else K, per_split)   # no empty split
    part, cnt = out, out                     # dummies, never touched when SPLIT_K == 1
    if grid_s > 1:
        need_p, need_c = scratch_numel(n_out, dict(split_k=grid_s, block_n=block_n),
                                             bool(silu_mul))
        _expect(partials is not None and partials.dtype == torch.float32
                and partials.is_contiguous() and partials.numel() >= need_p
                and partials.device == dev,
                f"gemv: split_k={split_k} needs fp32 partials of >= {need_p} elements")
        _expect(counters is not None and counters.dtype == torch.int32
                and counters.is_contiguous() and counters.numel() >= need_c
                and counters.device == dev,
                f"gemv: split_k={split_k} needs zeroed int32 counters of >= {need_c}")
        part, cnt = partials, counters
    z = gate if gate is not None else x
    nw = norm_w if norm_w is not None else x
    _gemv_kernel[(n_blocks, grid_s)](
        x, z, nw, W, out, res, cs, cw, part, cnt, n_out, K, W.stride(0), float(eps), per_split,
        conv_dim, PRO=pro, EPI=epi, DV=dv, KW=kw, SPLIT_K=grid_s, BLOCK_N=block_n,
        BLOCK_K=block_k, BLOCK_X=block_x, ONE_X=block_x >= K, MASK_N=n_out % block_n != 0,
        MASK_K=mask_k, PDL=pdl, num_warps=num_warps, **launch_kw(pdl))
    return out
