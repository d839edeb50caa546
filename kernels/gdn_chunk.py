"""Gated DeltaNet prefill: the causal conv1d + SiLU and the chunked WY form of the gated delta
rule (spec sections 6.2-6.5), from the raw projection m = [q | k | v] of T prompt tokens.

Conv (inside the chunk kernels, never stored): with seq = [conv_state^T | m] (the Kc-1 inputs
before the prompt, oldest first, then the rows),

    x[t, c]    = silu( round( sum_{j<Kc} w[c, j] seq[t + j, c] ) )     rounded to the dtype
    conv_state = seq[t_real : t_real + Kc - 1]^T                        the last Kc-1 real inputs

A chunk's programs read its raw rows and the Kc-1 rows before them (the previous chunk's, or
the conv state for the first chunk): every chunk is independent. HF runs F.conv1d in the model
dtype, then F.silu: hence the rounding before the SiLU.

Per value head, tokens split into chunks of C rows; inside a chunk (rows r, all in fp32):

    gamma_r = sum_{s<=r} g_s                       in-chunk cumulative log-decay (restarts per chunk)
    L_ij    = beta_i (k_i . k_j) exp(gamma_i - gamma_j)      i > j   (strictly lower, C x C)
    Tinv    = (I + L)^-1                           unit lower triangular
    W       = Tinv diag(beta exp(gamma)) K         U = Tinv diag(beta) V
    Vn      = U - W S0                             the true per-token deltas ("v_new")
    O       = diag(exp(gamma)) Q S0 + ((Q K^T) * exp(gamma_i - gamma_j) * [i >= j]) Vn
    S0     <- exp(gamma_last) S0 + (diag(exp(gamma_last - gamma)) K)^T Vn

Only differences gamma_i - gamma_j (i >= j) and gamma itself (<= 0) are exponentiated, so nothing
overflows however strong the decay.

Inert rows: rows >= t are padding, t = T or a device row count `t_dev` (the prefill CUDA graphs
replay one bucket length for prompts of any length up to it). Their q, k, v and z read as 0 and
beta = g = 0, so their rows of L, W, U, Vn are zero and gamma_last is the last real row's: they
never touch the recurrent state, the conv state takes the last Kc-1 real inputs, and their
output rows are 0. (The last chunk's rows past T are padding the same way.)

Three launches:
  1. prepare  (chunks x heads, parallel): conv of k and v, l2norm, gates, gamma, L, blocked
     inverse, W, U, the keys (stored for launch 3) and the decayed keys; the first chunk's
     programs first write the old conv state of their channels as Kc-1 "pre-rows"
     [Kc-1, conv_dim] of scratch, the rows before the prompt (the conv reads them like the raw
     rows, so its loads stay contiguous; launch 3 reads them there while it rewrites the real
     state)
  2. state    (heads x V-tiles, sequential over chunks): saves each chunk's S0, Vn, final state
  3. output   (chunks x heads, parallel): conv of q, the stored K, O, the gated RMSNorm into
     `out`; the first chunk's programs write the new conv state of their channels
Value head h owns the conv channels of its v; the first value head of each key group also owns
its key head's q and k channels (the new state in 3; in 1 every program of the group writes
their pre-rows, the same values). Intermediates (W, U, K,
decayed K, Vn, per-chunk S0) are stored in the activation dtype, as FLA does; the state and
every accumulation stay fp32. Scratch is allocated here; `out` and both states come from the
caller.

PDL (`pdl`, _common.pdl_mode; every launch): before the wait for the previous kernel a program
does its index math and sends its weights to L2 (conv taps, the gated norm's weights) or loads
them (A_log, dt_bias); the real row count, the activations, both states and the scratch are
read, and everything is written, after the wait.

PyTorch reference: kernels/reference.py, section "gdn_chunk": gdn_prefill_ref.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, cdiv, check_pdl, launch_kw, next_pow2, pdl_start, pdl_wait,
                      prefetch_l2)

from .gemm import TUNING_PATH, dot_precision, tuned_config

# HF's l2norm epsilon for q/k: inside the sqrt, on the sum of squares (spec 3c)
L2NORM_EPS = 1e-6
_L2NORM_EPS = tl.constexpr(L2NORM_EPS)
# Forward substitution works on diagonal blocks of this many rows (tl.dot's minimum tile).
SUB_BLOCK = 16
# launch knobs: V-tile of the sequential state pass, the warps/stages of the launches, and the
# prepare's diagonal-block solve (1: in the C x C tile, 2: as a batch of BC x BC blocks)
# W and U as dots in the activation dtype only for head dims of at least this many (padded)
# columns: on the GPU (Triton 3.6, sm_90) the bf16 form at dk = 16, dv = 24 gave NaN in the
# recurrent state (tests/engine/test_prefill_graph.py), where the fp32 form is right; at the
# model's 128 it matches the reference
WU_ACT_MIN_DIM = 64
GDN_KEYS = ("BV", "prep_warps", "state_warps", "state_stages", "out_warps", "solve")


def gdn_kernel_name(hv: int, dk: int, dv: int) -> str:
    return f"gdn_chunk_H{hv}_K{dk}_V{dv}"


def _gdn_default_config(dkp: int, dvp: int) -> dict:
    """Built-in launch table. The state pass is the only sequential loop (over T / chunk
    chunks), so it is spread over heads x V-tiles: BV = 16 (tl.dot's minimum N) gives
    16 heads x 8 tiles = 128 programs for the 0.8B, one per SM of an H200, each carrying a
    [dk, 16] slice of its head's state; the chunk loads of W / U / decayed K do not depend
    on the state, so two stages prefetch the next chunk under the current one's dots."""
    big = max(dkp, dvp) >= 128
    return dict(BV=min(16, dvp), prep_warps=8 if big else 4, state_warps=4, state_stages=2,
                out_warps=8 if big else 4, solve=1)


def gdn_config(hv: int, dk: int, dv: int, T: int, table: Optional[str] = TUNING_PATH) -> dict:
    """The launch config gdn_prefill runs at T without an override: the tile table's entry,
    else the built-in."""
    name = gdn_kernel_name(hv, dk, dv)
    default = _gdn_default_config(max(16, next_pow2(dk)), max(16, next_pow2(dv)))
    cfg = tuned_config(name, T, GDN_KEYS, table)
    return dict(default, **cfg) if cfg else default


@triton.jit
def _l2norm_rows(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + _L2NORM_EPS)[:, None]


@triton.jit
def _real_rows(t_ptr, T, T_DEV: tl.constexpr):
    """The number of real rows: t_dev[0] clamped to [0, T], or T."""
    if T_DEV:
        t = tl.minimum(tl.maximum(tl.load(t_ptr), 0), T)
    else:
        t = T
    return t


@triton.jit
def _conv_silu(m_ptr, cw_ptr, pre_ptr, rows, real, ch, ch_ok, stride_m, stride_p,
               KC: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, act: tl.constexpr):
    """silu(round(causal conv)) of channels ch at rows (fp32 holding dtype values; 0 where not
    real). Tap j reads seq row rows + j = input row s = rows - (Kc-1) + j: the raw rows for
    s >= 0 (the previous chunk's tail hits L1/L2), pre-row s + Kc-1 for s < 0 (the first
    chunk's first Kc-1 rows only; the pre-rows hold the old conv state, one row per tap).
    Only the row's base address is chosen per row, so every load stays contiguous along the
    channels (vector loads, few address registers). The taps run as a loop, not unrolled:
    unrolled, all Kc [ROWS, COLS] tap loads are in flight at once, and at 64 x 128 on 4 warps
    that alone holds ~240 registers (the kernels then spill)."""
    acc = tl.zeros((ROWS, COLS), dtype=tl.float32)
    m_ok = real[:, None] & ch_ok[None, :]
    for j in range(KC):
        s = rows - (KC - 1) + j
        base = tl.where(s >= 0, m_ptr + tl.maximum(s, 0).to(tl.int64) * stride_m,
                        pre_ptr + tl.maximum(s + KC - 1, 0).to(tl.int64) * stride_p)
        x = tl.load(base[:, None] + ch[None, :], mask=m_ok, other=0.0).to(tl.float32)
        wj = tl.load(cw_ptr + ch * KC + j, mask=ch_ok, other=0.0).to(tl.float32)
        acc += x * wj[None, :]
    c = acc.to(act).to(tl.float32)
    return (c * tl.sigmoid(c)).to(act).to(tl.float32)


@triton.jit
def _prefetch_span(ptr, n):
    # ptr[0 : n] into L2: 16 prefetches spread over it (every 128-byte line of a head's conv
    # taps, 128 channels x 4 in bf16)
    prefetch_l2(ptr + tl.minimum(tl.arange(0, 16) * ((n + 15) // 16), n - 1))


@triton.jit
def _conv_state_to_pre(cs_ptr, pre_ptr, ch, ch_ok, stride_p, KC: tl.constexpr, KM1P: tl.constexpr):
    # pre[i, ch] = cs[ch, i]: the old conv state of channels ch as Kc-1 rows
    offs_i = tl.arange(0, KM1P)
    keep = (offs_i < KC - 1)[:, None] & ch_ok[None, :]
    x = tl.load(cs_ptr + ch.to(tl.int64)[None, :] * (KC - 1) + offs_i[:, None], mask=keep)
    tl.store(pre_ptr + offs_i.to(tl.int64)[:, None] * stride_p + ch[None, :], x, mask=keep)


@triton.jit
def _conv_state_update(m_ptr, pre_ptr, cs_ptr, t, ch, ch_ok, stride_m, stride_p,
                       KC: tl.constexpr, KM1P: tl.constexpr):
    """cs[ch, i] = seq[t + i] (i < Kc-1): the last Kc-1 real inputs, from the raw rows
    (s = t - (Kc-1) + i >= 0) or, for a prompt shorter than Kc-1, the old state's pre-rows."""
    offs_i = tl.arange(0, KM1P)
    s = t - (KC - 1) + offs_i
    keep = ch_ok[:, None] & (offs_i < KC - 1)[None, :]
    from_m = (s >= 0)[None, :]
    new_m = tl.load(m_ptr + tl.maximum(s, 0).to(tl.int64)[None, :] * stride_m + ch[:, None],
                    mask=keep & from_m, other=0.0)
    old = tl.load(pre_ptr + tl.maximum(s + KC - 1, 0).to(tl.int64)[None, :] * stride_p + ch[:, None],
                  mask=keep & (~from_m), other=0.0)
    tl.store(cs_ptr + ch.to(tl.int64)[:, None] * (KC - 1) + offs_i[None, :], tl.where(from_m, new_m, old),
             mask=keep)


@triton.jit
def _diag_block_inverse_tile(L, CHUNK: tl.constexpr, BC: tl.constexpr):
    """Xd = (I + Ld)^-1 for the block-diagonal part Ld of L (BC x BC blocks), by forward
    substitution on all diagonal blocks at once in the C x C tile (solve = 1): step i solves
    row i of every block,
        X[tr, :] = e_tr - Ld[tr, :] X      with tr = block_start + i (earlier rows final)."""
    r = tl.arange(0, CHUNK)[:, None]
    c = tl.arange(0, CHUNK)[None, :]
    same_block = (r // BC) == (c // BC)
    LdT = tl.trans(tl.where(same_block, L, 0.0))                 # LdT[m, tr] = Ld[tr, m]
    eye = tl.where(r == c, 1.0, 0.0)
    X = eye
    for i in tl.static_range(1, BC):
        # a[m] = Ld[tr(m), m]: the row being solved in m's block, laid out along axis 0
        a_row = tl.sum(tl.where(c == (r // BC) * BC + i, LdT, 0.0), axis=1)
        y = tl.sum(a_row[:, None] * X, axis=0)                   # (Ld X)[tr(col), col]
        X = tl.where(r == (c // BC) * BC + i, eye - y[None, :], X)
    return X


@triton.jit
def _diag_block_inverse_batched(L, CHUNK: tl.constexpr, BC: tl.constexpr):
    """The same Xd (solve = 2) with the diagonal blocks gathered into a [C/BC, BC, BC] batch
    first, so each substitution step touches C*BC values instead of C*C (a quarter at C = 64),
    then scattered back into the C x C tile (zero off the diagonal blocks)."""
    NB: tl.constexpr = CHUNK // BC
    on_diag = tl.arange(0, NB)[:, None, None, None] == tl.arange(0, NB)[None, None, :, None]
    D = tl.sum(tl.where(on_diag, tl.reshape(L, (NB, BC, NB, BC)), 0.0), axis=2)   # D[b] = Ld block b
    ii = tl.arange(0, BC)[None, :, None]
    eye = tl.zeros((NB, BC, BC), dtype=tl.float32) + tl.where(ii == tl.arange(0, BC)[None, None, :], 1.0, 0.0)
    X = eye
    for i in tl.static_range(1, BC):
        a_row = tl.sum(tl.where(ii == i, D, 0.0), axis=1)         # [NB, BC]: D[b, i, m]
        y = tl.sum(a_row[:, :, None] * X, axis=1)                # [NB, BC]: (D X)[b, i, col]
        X = tl.where(ii == i, eye - y[:, None, :], X)
    return tl.reshape(tl.where(on_diag, X[:, :, None, :], 0.0), (CHUNK, CHUNK))


@triton.jit
def _beta(b_ptr, rows, real, h, stride_b):
    b = tl.load(b_ptr + rows.to(tl.int64) * stride_b + h, mask=real, other=0.0)
    beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
    return tl.where(real, beta, 0.0)


@triton.jit
def _gdn_chunk_prepare_kernel(
        m_ptr, b_ptr, a_ptr, cw_ptr, cs_ptr, pre_ptr, a_log_ptr, dt_bias_ptr, t_ptr,
        gam_ptr, w_ptr, u_ptr, k_ptr, kd_ptr,
        T, T_pad, stride_m, stride_p, stride_b, stride_a,
        HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        DKP: tl.constexpr, DVP: tl.constexpr, CHUNK: tl.constexpr, BC: tl.constexpr,
        KC: tl.constexpr, KM1P: tl.constexpr, T_DEV: tl.constexpr, SOLVE: tl.constexpr,
        WU_ACT: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr = 0):
    """Chunk program_id(0) of value head program_id(1): k conv'd and l2-normed, beta, gamma
    (stored), Tinv = (I + L)^-1 in fp32, then W, U, the keys and the decayed keys (stored). The
    first chunk's programs first write the old conv state of the channels they and launch 3 read
    as the pre-rows (every program of a key group writes its q / k rows: the same values)."""
    pdl_start(PDL)
    i_t = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    act = w_ptr.dtype.element_ty
    offs_k = tl.arange(0, DKP)
    offs_v = tl.arange(0, DVP)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    ch_k = HK * DK + hk * DK + offs_k
    ch_v = 2 * HK * DK + h * DV + offs_v
    if PDL != 0:    # the taps of k and v into L2
        _prefetch_span(cw_ptr + (HK * DK + hk * DK) * KC, DK * KC)
        _prefetch_span(cw_ptr + (2 * HK * DK + h * DV) * KC, DV * KC)
    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    pdl_wait(PDL)

    if i_t == 0:
        _conv_state_to_pre(cs_ptr, pre_ptr, hk * DK + offs_k, k_ok, stride_p, KC, KM1P)
        _conv_state_to_pre(cs_ptr, pre_ptr, ch_k, k_ok, stride_p, KC, KM1P)
        _conv_state_to_pre(cs_ptr, pre_ptr, ch_v, v_ok, stride_p, KC, KM1P)
        tl.debug_barrier()      # the writes above are read back below by other threads
    t = _real_rows(t_ptr, T, T_DEV)
    rows = i_t * CHUNK + tl.arange(0, CHUNK)
    real = rows < t
    head_rows = h.to(tl.int64) * T_pad + rows
    # the keys rounded to the activation dtype at once (they enter every dot so, as in FLA):
    # what stays live in fp32 through the solve sets the registers
    k = _conv_silu(m_ptr, cw_ptr, pre_ptr, rows, real, ch_k, k_ok, stride_m, stride_p,
                   KC, CHUNK, DKP, act)
    k = _l2norm_rows(k).to(act)
    tl.store(k_ptr + head_rows[:, None] * DKP + offs_k[None, :], k)

    # gates: beta = sigmoid(b) rounded like HF keeps it; g = -exp(A_log) softplus(a + dt_bias)
    beta = _beta(b_ptr, rows, real, h, stride_b)
    a = tl.load(a_ptr + rows.to(tl.int64) * stride_a + h, mask=real, other=0.0).to(tl.float32)
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(a_log) * softplus
    g = tl.where(real, g, 0.0)
    gam = tl.cumsum(g, axis=0)
    # the chunk's last cumulative decay, the very value stored for the state pass: a separate
    # tl.sum(g) adds in another order, and under strong decay its few ulps of |gamma| ~ 1e3
    # show in the state (exp(gam_last - gam) here against exp(gam_last) there)
    gam_last = tl.sum(tl.where(tl.arange(0, CHUNK) == CHUNK - 1, gam, 0.0), axis=0)
    tl.store(gam_ptr + head_rows, gam)

    # L (strictly lower)
    kk = tl.dot(k, tl.trans(k), input_precision=DOT_PREC)
    r = tl.arange(0, CHUNK)[:, None]
    c = tl.arange(0, CHUNK)[None, :]
    lower = r > c
    L = tl.where(lower, beta[:, None] * kk * tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.0)), 0.0)
    if SOLVE == 1:
        X = _diag_block_inverse_tile(L, CHUNK, BC)
    else:
        X = _diag_block_inverse_batched(L, CHUNK, BC)
    # Merge the blocks: I + L = (I + Ld)(I + N) with N = Xd Lo strictly block-lower, so
    # N^(C/BC) = 0 and (I + L)^-1 = sum_m (-N)^m Xd, evaluated by Horner: Z <- Xd - N Z.
    N = tl.dot(X, tl.where((r // BC) > (c // BC), L, 0.0), input_precision=DOT_PREC)
    Tinv = X
    for _ in tl.static_range(CHUNK // BC - 1):
        Tinv = X - tl.dot(N, Tinv, input_precision=DOT_PREC)

    # each result stored as soon as it is made, and v's conv only now
    kf = k.to(tl.float32)
    kd = kf * tl.exp(gam_last - gam)[:, None]                     # decay to the chunk end, <= 1
    tl.store(kd_ptr + head_rows[:, None] * DKP + offs_k[None, :], kd.to(act))
    # WU_ACT: W and U take Tinv and their right sides in the activation dtype, as FLA's
    # recompute_w_u does (tensor-core dots at half the operand bytes; fp32 models keep fp32)
    if WU_ACT:
        Tinv = Tinv.to(act)
    w_rhs = kf * (beta * tl.exp(gam))[:, None]
    if WU_ACT:
        w_rhs = w_rhs.to(act)
    w = tl.dot(Tinv, w_rhs, input_precision=DOT_PREC)
    tl.store(w_ptr + head_rows[:, None] * DKP + offs_k[None, :], w.to(act))
    v = _conv_silu(m_ptr, cw_ptr, pre_ptr, rows, real, ch_v, v_ok, stride_m, stride_p,
                   KC, CHUNK, DVP, act)
    u_rhs = v * beta[:, None]
    if WU_ACT:
        u_rhs = u_rhs.to(act)
    u = tl.dot(Tinv, u_rhs, input_precision=DOT_PREC)
    tl.store(u_ptr + head_rows[:, None] * DVP + offs_v[None, :], u.to(act))


@triton.jit
def _gdn_chunk_state_kernel(
        w_ptr, u_ptr, kd_ptr, gam_ptr, vn_ptr, h_ptr, state_ptr,
        NT, T_pad,
        DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr,
        CHUNK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
        PDL: tl.constexpr = 0):
    # The one sequential loop: carry S (fp32, DKP x BV slice of one head) across chunks.
    pdl_start(PDL)
    i_v = tl.program_id(0)
    h = tl.program_id(1)
    act = w_ptr.dtype.element_ty
    offs_k = tl.arange(0, DKP)
    offs_v = i_v * BV + tl.arange(0, BV)
    offs_c = tl.arange(0, CHUNK)

    s_ptrs = state_ptr + h.to(tl.int64) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    s_mask = (offs_k < DK)[:, None] & (offs_v < DV)[None, :]
    pdl_wait(PDL)               # no weights here: the state and the prepare's scratch
    S = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)

    for i_t in range(0, NT):
        rows = h.to(tl.int64) * T_pad + i_t * CHUNK + offs_c
        tl.store(h_ptr + ((h.to(tl.int64) * NT + i_t) * DKP + offs_k[:, None]) * DVP + offs_v[None, :],
                 S.to(act))
        w = tl.load(w_ptr + rows[:, None] * DKP + offs_k[None, :])
        u = tl.load(u_ptr + rows[:, None] * DVP + offs_v[None, :])
        vn = (u.to(tl.float32) - tl.dot(w, S.to(act), input_precision=DOT_PREC)).to(act)
        tl.store(vn_ptr + rows[:, None] * DVP + offs_v[None, :], vn)
        kd = tl.load(kd_ptr + rows[:, None] * DKP + offs_k[None, :])
        decay_last = tl.exp(tl.load(gam_ptr + h.to(tl.int64) * T_pad + i_t * CHUNK + CHUNK - 1))
        S = S * decay_last + tl.dot(tl.trans(kd), vn, input_precision=DOT_PREC)

    tl.store(s_ptrs, S, mask=s_mask)


@triton.jit
def _gdn_chunk_output_kernel(
        m_ptr, z_ptr, cw_ptr, cs_ptr, pre_ptr, t_ptr, gam_ptr, k_ptr, vn_ptr, h_ptr, norm_w_ptr,
        out_ptr, T, T_pad, NT, stride_m, stride_p, stride_z, stride_o, scale, eps,
        HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        DKP: tl.constexpr, DVP: tl.constexpr, CHUNK: tl.constexpr, KC: tl.constexpr,
        KM1P: tl.constexpr, T_DEV: tl.constexpr, DOT_PREC: tl.constexpr,
        PDL: tl.constexpr = 0):
    pdl_start(PDL)
    i_t = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    act = vn_ptr.dtype.element_ty
    offs_k = tl.arange(0, DKP)
    offs_v = tl.arange(0, DVP)
    k_ok = offs_k < DK
    if PDL != 0:    # the taps of q and the gated norm's weights into L2
        _prefetch_span(cw_ptr + hk * DK * KC, DK * KC)
        _prefetch_span(norm_w_ptr, DV)
    pdl_wait(PDL)

    t = _real_rows(t_ptr, T, T_DEV)
    rows = i_t * CHUNK + tl.arange(0, CHUNK)
    real = rows < t
    head_rows = h.to(tl.int64) * T_pad + rows
    gam = tl.load(gam_ptr + head_rows)
    # q from the raw rows and the pre-rows (the old conv state: this launch rewrites the real
    # one), rounded to the dtype as soon as it is made (the dots take it so): what stays live in
    # fp32 sets the registers, and so how many programs share an SM. k is the prepare's: reading
    # it back is one load, where its conv again was four and ~a quarter of this kernel's work
    q = _conv_silu(m_ptr, cw_ptr, pre_ptr, rows, real, hk * DK + offs_k, k_ok, stride_m, stride_p,
                   KC, CHUNK, DKP, act)
    q = _l2norm_rows(q) * scale
    qd = (q * tl.exp(gam)[:, None]).to(act)                      # decayed: reads the chunk-start state
    q = q.to(act)
    k = tl.load(k_ptr + head_rows[:, None] * DKP + offs_k[None, :])
    # intra-chunk part: causal (diagonal included) decayed scores times the true deltas
    r = tl.arange(0, CHUNK)[:, None]
    c = tl.arange(0, CHUNK)[None, :]
    causal = r >= c
    A = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    A = tl.where(causal, A * tl.exp(tl.where(causal, gam[:, None] - gam[None, :], 0.0)), 0.0).to(act)
    # inter-chunk part: the decayed queries against the state at the chunk start
    S0 = tl.load(h_ptr + ((h.to(tl.int64) * NT + i_t) * DKP + offs_k[:, None]) * DVP + offs_v[None, :])
    o = tl.dot(qd, S0, input_precision=DOT_PREC)
    vn = tl.load(vn_ptr + head_rows[:, None] * DVP + offs_v[None, :])
    o = tl.dot(A, vn, o, input_precision=DOT_PREC)
    if i_t == 0:    # the new conv state of this program's channels (see the module docstring)
        _conv_state_update(m_ptr, pre_ptr, cs_ptr, t, 2 * HK * DK + h * DV + offs_v, offs_v < DV,
                           stride_m, stride_p, KC, KM1P)
        if h % GROUP == 0:
            _conv_state_update(m_ptr, pre_ptr, cs_ptr, t, hk * DK + offs_k, k_ok, stride_m, stride_p,
                               KC, KM1P)
            _conv_state_update(m_ptr, pre_ptr, cs_ptr, t, HK * DK + hk * DK + offs_k, k_ok, stride_m,
                               stride_p, KC, KM1P)

    # gated RMSNorm per head: norm in fp32, round, * w, * silu(z) in fp32, round (spec 3b)
    o = o.to(act).to(tl.float32)                                 # the core output is stored in the dtype
    n = o * tl.rsqrt(tl.sum(o * o, axis=1) / DV + eps)[:, None]
    n = n.to(act).to(tl.float32)
    v_ok = offs_v < DV
    z = tl.load(z_ptr + rows.to(tl.int64)[:, None] * stride_z + h * DV + offs_v[None, :],
                mask=real[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    nw = tl.load(norm_w_ptr + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    y = (nw[None, :] * n) * (z * tl.sigmoid(z))                  # 0 on inert rows (q = z = 0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + h * DV + offs_v[None, :],
             y.to(out_ptr.dtype.element_ty), mask=(rows < T)[:, None] & v_ok[None, :])


def _check_2d(name: str, t: torch.Tensor, rows: int, cols: int) -> None:
    if t.dim() != 2 or tuple(t.shape) != (rows, cols):
        raise ValueError(f"{name} must have shape [{rows}, {cols}], got {tuple(t.shape)}")
    if t.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous rows (stride(1) == 1)")


def gdn_launches() -> list[tuple[str, object]]:
    """(name, kernel) of the launches gdn_prefill runs, in order (for timing them one by one)."""
    return [("prepare", _gdn_chunk_prepare_kernel), ("state", _gdn_chunk_state_kernel),
            ("output", _gdn_chunk_output_kernel)]


def gdn_prefill(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                conv_w: torch.Tensor, conv_state: torch.Tensor, A_log: torch.Tensor,
                dt_bias: torch.Tensor, state: torch.Tensor, norm_w: torch.Tensor, out: torch.Tensor,
                *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, eps: float,
                chunk: int = 64, t_dev: Optional[torch.Tensor] = None, config: Optional[dict] = None,
                table: Optional[str] = TUNING_PATH, pdl: int = 0) -> torch.Tensor:
    """Conv1d + SiLU, GDN core and gated RMSNorm for T prompt tokens, continuing from
    `conv_state` and `state` (both updated in place).

    qkv [T, 2*Hk*dk + Hv*dv] (the raw projection [q | k | v], before the conv), z [T, Hv*dv],
    b, a [T, Hv] (rows may be strided views), conv_w [conv_dim, Kc] and conv_state
    [conv_dim, Kc-1] contiguous in qkv's dtype, A_log [Hv], dt_bias [Hv], norm_w [dv], state
    fp32 [Hv, dk, dv] contiguous, out [T, Hv*dv] (allocated by the caller, not aliasing qkv).
    Value head h uses key head h // (Hv // Hk). t_dev: a device int32 whose first element is
    the number of real rows (the rest are inert padding, their output rows 0); None: all T.
    Scratch of ~(3*dk + 2*dv + dk*dv/chunk) * Hv * T elements in the activation dtype is
    allocated per call. Returns out. `config` (GDN_KEYS) overrides the launch table: the tuner
    sweeps through it. `table`: the tile table file (gemm.TUNING_PATH; None: the built-in
    configs only). `pdl`: see _common.pdl_mode (every launch).
    """
    pdl = check_pdl(pdl, "gdn_prefill")
    hk, hv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    if min(hk, hv, dk, dv) <= 0 or hv % hk:
        raise ValueError("need num_v_heads a positive multiple of num_k_heads and positive dims")
    if chunk not in (16, 32, 64):
        raise ValueError("chunk must be 16, 32 or 64")
    if qkv.dim() != 2:
        raise ValueError("qkv must be [T, conv_dim]")
    T = qkv.shape[0]
    act = qkv.dtype
    if act not in FLOAT_DTYPES:
        raise TypeError(f"gdn_prefill supports {FLOAT_DTYPES}, got {act}")
    cd = 2 * hk * dk + hv * dv
    _check_2d("qkv", qkv, T, cd)
    _check_2d("z", z, T, hv * dv)
    _check_2d("b", b, T, hv)
    _check_2d("a", a, T, hv)
    _check_2d("out", out, T, hv * dv)
    if z.dtype != act or out.dtype != act:
        raise TypeError("z and out must have qkv's dtype")
    if conv_w.dim() != 2 or conv_w.shape[0] != cd or conv_w.shape[1] < 2:
        raise ValueError(f"conv_w must be [{cd}, Kc] with Kc >= 2, got {tuple(conv_w.shape)}")
    kc = conv_w.shape[1]
    if tuple(conv_state.shape) != (cd, kc - 1):
        raise ValueError(f"conv_state must be [{cd}, {kc - 1}], got {tuple(conv_state.shape)}")
    if conv_w.dtype != act or conv_state.dtype != act:
        raise TypeError("conv_w and conv_state must have qkv's dtype")
    if not (conv_w.is_contiguous() and conv_state.is_contiguous()):
        raise ValueError("conv_w and conv_state must be contiguous")
    if tuple(state.shape) != (hv, dk, dv) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be contiguous float32 [{hv}, {dk}, {dv}]")
    for name, t, n in (("A_log", A_log, hv), ("dt_bias", dt_bias, hv), ("norm_w", norm_w, dv)):
        if t.dim() != 1 or t.shape[0] != n or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous vector of {n}")
    if t_dev is not None and (t_dev.dtype != torch.int32 or t_dev.numel() < 1
                              or t_dev.device != qkv.device):
        raise ValueError("t_dev must be an int32 tensor of at least one element on qkv's device")
    if T == 0:
        return out

    dkp = max(16, next_pow2(dk))
    dvp = max(16, next_pow2(dv))
    nt = cdiv(T, chunk)
    t_pad = nt * chunk
    dev = qkv.device
    gam = torch.empty(hv, t_pad, dtype=torch.float32, device=dev)
    w_buf = torch.empty(hv, t_pad, dkp, dtype=act, device=dev)
    k_buf = torch.empty(hv, t_pad, dkp, dtype=act, device=dev)
    kd_buf = torch.empty(hv, t_pad, dkp, dtype=act, device=dev)
    u_buf = torch.empty(hv, t_pad, dvp, dtype=act, device=dev)
    vn_buf = torch.empty(hv, t_pad, dvp, dtype=act, device=dev)
    h_buf = torch.empty(hv, nt, dkp, dvp, dtype=act, device=dev)
    pre = torch.empty(kc - 1, cd, dtype=act, device=dev)      # the old conv state as rows

    cfg = dict(config) if config is not None else gdn_config(hv, dk, dv, T, table)
    bv = min(cfg["BV"], dvp)
    if bv < 16 or dvp % bv:
        raise ValueError(f"BV must be a power of two in [16, {dvp}], got {cfg['BV']}")
    if cfg["solve"] not in (1, 2):
        raise ValueError(f"solve must be 1 or 2, got {cfg['solve']}")
    prec = dot_precision(act)
    t_arg = t_dev if t_dev is not None else state        # never read without T_DEV
    conv = dict(KC=kc, KM1P=next_pow2(kc - 1), T_DEV=t_dev is not None)
    pdl_kw = dict(PDL=pdl, **launch_kw(pdl))
    heads = dict(HK=hk, GROUP=hv // hk, DK=dk, DV=dv, DKP=dkp, DVP=dvp, CHUNK=chunk)
    _gdn_chunk_prepare_kernel[(nt, hv)](
        qkv, b, a, conv_w, conv_state, pre, A_log, dt_bias, t_arg, gam, w_buf, u_buf, k_buf, kd_buf,
        T, t_pad, qkv.stride(0), pre.stride(0), b.stride(0), a.stride(0), **heads, BC=SUB_BLOCK,
        SOLVE=cfg["solve"], WU_ACT=min(dkp, dvp) >= WU_ACT_MIN_DIM, DOT_PREC=prec,
        num_warps=cfg["prep_warps"], **conv, **pdl_kw)
    _gdn_chunk_state_kernel[(dvp // bv, hv)](
        w_buf, u_buf, kd_buf, gam, vn_buf, h_buf, state, nt, t_pad,
        DK=dk, DV=dv, DKP=dkp, DVP=dvp, CHUNK=chunk, BV=bv, DOT_PREC=prec,
        num_warps=cfg["state_warps"], num_stages=cfg["state_stages"], **pdl_kw)
    _gdn_chunk_output_kernel[(nt, hv)](
        qkv, z, conv_w, conv_state, pre, t_arg, gam, k_buf, vn_buf, h_buf, norm_w, out,
        T, t_pad, nt, qkv.stride(0), pre.stride(0), z.stride(0), out.stride(0), dk ** -0.5, eps,
        HK=hk, GROUP=hv // hk, DK=dk, DV=dv, DKP=dkp, DVP=dvp, CHUNK=chunk, DOT_PREC=prec,
        num_warps=cfg["out_warps"], **conv, **pdl_kw)
    return out
