"""The whole decode step of Qwen3.5 as ONE persistent Triton kernel (issue #59): read it beside
engine/decode_step.py, whose launches it fuses, and engine/reference.py.

    embed -> for each layer: (norm -> Gated DeltaNet | gated attention) + residual,
                             (norm -> MLP) + residual
          -> final norm -> LM head -> next token

The grid is the GPU's SMs x a few programs, all resident at once. Each operator of the step is
a list of tasks (row blocks of a GEMV, state tiles of the recurrence, KV splits of the
attention); task t of an operator is program t mod G's, so every program walks the same static
list of operators, in order:

    q = 0                embed            the token's embedding row into h
    per Gated DeltaNet layer:
      in_proj            rows of [qkv | b | a]: input RMSNorm prologue, causal conv1d + SiLU
                         epilogue (conv state shifted in place; kernels.gemv's epilogue)
      core + z           state tiles (value head x V-tile) of the gated delta rule, and rows of
                         z = in_proj_z @ norm(h), which need only the layer input: a program
                         streams its z rows before it waits for the in_proj
      out_proj           rows (x K-splits) of out_proj @ gated_norm(o, silu(z)), + residual
    per gated-attention layer:
      qkv                rows of [q|gate per head | k | v]: input RMSNorm prologue
      attention          (KV head x split) tasks: q/k RMSNorm, partial RoPE, KV-cache append
                         (split 0), online softmax over the split's positions; partials out
      merge              (head x dim chunk) tasks: the splits' partials merged in split order,
                         the sigmoid output gate
      o_proj             rows (x K-splits) of o_proj @ attention output, + residual
    per layer, the MLP:
      gate_up            rows of silu(Wg x) * (Wu x), x = post-attention RMSNorm of h
      down               rows (x K-splits) of down @ act, + residual
    lm_head              row blocks of the tied LM head on the final RMSNorm of h: fp32 logits,
                         and per program the best (logit, lowest id) key
    argmax               one task: the keys -> the token (tok, tok ring, counts, pos + 1);
                         left out when the sampler runs after the kernel

Operators are ordered by counters: a program finishing operator q adds 1 to cnt[q]; operator q
starts once cnt[q - 1] reaches step x G, the step being the program's epoch slot + 1, so no
counter is reset between steps or graph replays (engine/persistent_step.py keeps the slots).
Before it waits, a program loads what does not depend on the previous operator: the weights of
its first task (and, in each task, the next task's: persist_sw0 of benchmarks/persistent_gdn.py),
the recurrent and conv state it wrote itself in the previous step, residual rows, norm weights,
the first cached K/V tile. Sums are in a fixed order: a K-split row block's partials are added
by the split drawing its last ticket, in split order (the ticket is reset by its holder), the
attention's split partials by the merge task in split order, the LM head's keys by max (exact).
No float atomics: the step is bit-reproducible.

PHASE >= 0 runs one operator kind per launch (phase_layer the layer), with no counters and no
spinning: the same task code, on the same grid, which the Triton interpreter runs (the CPU
tests) and which serves the head alone after a prefill.

Per-layer weights and states are reached through a table of addresses (`lw`, int64, N_SLOTS a
layer) and the small vectors (norm weights, A_log, dt_bias) through one fp32 table (`sp`), both
built once by engine/persistent_step.py.
"""
from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl

from ._common import cdiv, next_pow2, pdl_wait
from ._persistent import globaltimer, rows_load, signal, stall, wait_counter
from .attention_decode import (_kv_tile, _merge_chunk, _norm_rope, _norm_weights, _rope_partner,
                               _rope_table, _row, _split_partials, split_layout, tile_positions)
from .gdn_decode import L2NORM_EPS, SOFTPLUS_THRESHOLD, _delta_rule, default_block_v
from .gemv import EPI_CONV, _epi_pre, _epilogue
from .sampling import _KEY_EMPTY, _count_and_advance, _pack, _unpack_idx

# operator kinds: the PHASE of a one-operator launch (-1: the persistent kernel, all of them)
PERSISTENT = -1
OP_EMBED, OP_GDN_IN, OP_GDN_CORE, OP_GDN_OUT = 0, 1, 2, 3
OP_ATT_QKV, OP_ATT_CORE, OP_ATT_MERGE, OP_ATT_O = 4, 5, 6, 7
OP_MLP_GATE_UP, OP_MLP_DOWN, OP_LM_HEAD, OP_ARGMAX = 8, 9, 10, 11
GDN_OPS = (OP_GDN_IN, OP_GDN_CORE, OP_GDN_OUT)
ATT_OPS = (OP_ATT_QKV, OP_ATT_CORE, OP_ATT_MERGE, OP_ATT_O)
MLP_OPS = (OP_MLP_GATE_UP, OP_MLP_DOWN)
# the name of each operator kind in the timing rows: DecodeStep's kernel names where the
# operator is what that kernel does
OP_NAMES = {OP_EMBED: "embedding_gather", OP_GDN_IN: "gemv_gdn_in_proj_norm_conv",
            OP_GDN_CORE: "gdn_decode", OP_GDN_OUT: "gemv_gdn_out_proj_gatednorm",
            OP_ATT_QKV: "gemv_attn_qkv_norm", OP_ATT_CORE: "attention_decode",
            OP_ATT_MERGE: "attention_merge", OP_ATT_O: "gemv_attn_o_proj",
            OP_MLP_GATE_UP: "gemv_mlp_gate_up_norm_silu", OP_MLP_DOWN: "gemv_mlp_down",
            OP_LM_HEAD: "lm_head_norm", OP_ARGMAX: "argmax"}

# a layer's row of the address table
N_SLOTS = 8
SLOT_W_IN = 0        # GDN: in_proj [qkv | b | a | z] rows;   attention: [q|gate | k | v] rows
SLOT_CONV_W = 1      # GDN: conv weights [conv_dim, taps];   attention: K cache [KV, ctx, hd]
SLOT_CONV = 2        # GDN: conv state [conv_dim, taps - 1]; attention: V cache
SLOT_REC = 3         # GDN: recurrent state (fp32)
SLOT_OUT = 4         # out_proj / o_proj
SLOT_GATE_UP = 5
SLOT_DOWN = 6
KIND_GDN, KIND_ATTENTION = 0, 1

N_SLOTS_K = tl.constexpr(N_SLOTS)
EPI_CONV_K = tl.constexpr(EPI_CONV)
L2_EPS_K = tl.constexpr(L2NORM_EPS)
SP_THRESHOLD_K = tl.constexpr(SOFTPLUS_THRESHOLD)
MERGE_K = tl.constexpr(8)          # split partials the merge reads at once


# ------------------------------------------------------------------------------------------
# ordering: the wait before an operator, the count after it
# ------------------------------------------------------------------------------------------

@triton.jit
def _op_begin(cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
              timeout_ns, n_stamp, SPIN: tl.constexpr, PERSIST: tl.constexpr,
              STALL: tl.constexpr, STAMP: tl.constexpr, PDL: tl.constexpr):
    """Wait for operator q's inputs: every program done with operator q - 1 (persistent; the
    step's first operator waits for nothing) or the previous launch (PDL, a one-operator
    launch). Then the injected stall (benchmarks: the program of operator stall_op's first task
    spins stall_ns) and the operator's start stamp."""
    if PERSIST:
        if q > 0:
            wait_counter(cnt_ptr + q - 1, base * G, err_ptr, timeout_ns, SPIN)
    pdl_wait(PDL)
    if STALL:
        if (q == stall_op) & (pid == 0):
            stall(stall_ns, stall_rec_ptr)
    if PERSIST and STAMP:
        tl.store(stamp_ptr + pid * n_stamp + 2 * q, globaltimer())


@triton.jit
def _op_end(cnt_ptr, stamp_ptr, q, pid, n_stamp, PERSIST: tl.constexpr, STAMP: tl.constexpr):
    """This program is done with operator q: its end stamp, then its count (release)."""
    if PERSIST:
        if STAMP:
            tl.store(stamp_ptr + pid * n_stamp + 2 * q + 1, globaltimer())
        signal(cnt_ptr + q, 1)


@triton.jit
def _my_tasks(pid, G, N: tl.constexpr, BN: tl.constexpr):
    """This program's share of an operator of N rows in tasks of BN rows (task t is program
    t mod G's): how many tasks, and the rows of the first with their mask."""
    T: tl.constexpr = (N + BN - 1) // BN
    n_mine = (T - pid + G - 1) // G
    rows = pid * BN + tl.arange(0, BN)
    return n_mine, rows, rows < N


@triton.jit
def _rms_x(v_ptr, nw, offs, eps, K: tl.constexpr):
    """round(v * rsqrt(mean(v^2) + eps) * (1 + nw)) over the whole vector, fp32 (v written in
    this launch: read from L2, .cg)."""
    v = tl.load(v_ptr + offs, mask=offs < K, other=0.0, cache_modifier=".cg")
    vf = v.to(tl.float32)
    inv = tl.rsqrt(tl.sum(vf * vf, axis=0) / K + eps)
    return (vf * inv * (1.0 + nw)).to(v.dtype).to(tl.float32)


@triton.jit
def _layer_ptr(lw_ptr, l, slot: tl.constexpr, dtype: tl.constexpr, ALIGN: tl.constexpr):
    """Layer l's tensor in address-table slot `slot`, as a pointer to `dtype` (16-byte aligned
    where the engine checked it: vector loads)."""
    p = tl.load(lw_ptr + l * N_SLOTS_K + slot).to(tl.pointer_type(dtype))
    if ALIGN:
        p = tl.multiple_of(p, 16)
    return p


# ------------------------------------------------------------------------------------------
# the operators (each @triton.jit; the SYNC arguments are _op_begin's)
# ------------------------------------------------------------------------------------------

@triton.jit
def _embed(tok_ptr, emb_ptr, h_ptr,
           cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
           timeout_ns, n_stamp,
           D: tl.constexpr, BN: tl.constexpr, SPIN: tl.constexpr, PERSIST: tl.constexpr,
           STALL: tl.constexpr, STAMP: tl.constexpr):
    """h = embed[tok], in column blocks of BN."""
    T: tl.constexpr = (D + BN - 1) // BN
    _op_begin(cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
              timeout_ns, n_stamp, SPIN, PERSIST, STALL, STAMP, 0)
    row = emb_ptr + tl.load(tok_ptr).to(tl.int64) * D
    for t in range(pid, T, G):
        cols = t * BN + tl.arange(0, BN)
        m = cols < D
        tl.store(h_ptr + cols, tl.load(row + cols, mask=m, other=0.0), mask=m)
    _op_end(cnt_ptr, stamp_ptr, q, pid, n_stamp, PERSIST, STAMP)


@triton.jit
def _gdn_in_proj(h_ptr, proj_ptr, w_l, nw_l, cw_l, cs_l, eps,
                 cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op,
                 stall_ns, timeout_ns, n_stamp,
                 D: tl.constexpr, N_IN: tl.constexpr, CONV_DIM: tl.constexpr, KW: tl.constexpr,
                 BN: tl.constexpr, SPIN: tl.constexpr, PERSIST: tl.constexpr,
                 STALL: tl.constexpr, STAMP: tl.constexpr, PDL: tl.constexpr):
    """proj[rows] for rows of [qkv | b | a] (the engine's qkvba), the input norm in the
    prologue, the engine's conv epilogue on the qkv rows (state shifted in place). Returns x
    (the normed input), which the z rows of the next operator reuse."""
    DP: tl.constexpr = triton.next_power_of_2(D)
    n_mine, rows, ok = _my_tasks(pid, G, N_IN, BN)
    offs = tl.arange(0, DP)
    # before the wait: my first tile, its conv weights and state (this program wrote that state
    # in the previous step), the norm weights
    w_c = rows_load(w_l, rows, ok, offs, D, DP)
    r0, w2, s2, sn = _epi_pre(rows, ok, h_ptr, cs_l, cw_l, CONV_DIM, EPI_CONV_K, KW, BN)
    nw = tl.load(nw_l + offs, mask=offs < D, other=0.0).to(tl.float32)
    _op_begin(cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
              timeout_ns, n_stamp, SPIN, PERSIST, STALL, STAMP, PDL)
    x = _rms_x(h_ptr, nw, offs, eps, D)
    for i in range(n_mine):
        nrows = rows + G * BN
        nok = nrows < N_IN                  # past my last task: nothing is loaded
        w_n = rows_load(w_l, nrows, nok, offs, D, DP)
        r0n, w2n, s2n, snn = _epi_pre(nrows, nok, h_ptr, cs_l, cw_l, CONV_DIM, EPI_CONV_K, KW, BN)
        y = tl.sum(w_c.to(tl.float32) * x[None, :], axis=1)
        _epilogue(y, y, rows, ok, proj_ptr, cs_l, CONV_DIM, r0, w2, s2, sn, EPI_CONV_K, KW)
        rows, ok, w_c = nrows, nok, w_n
        r0, w2, s2, sn = r0n, w2n, s2n, snn
    _op_end(cnt_ptr, stamp_ptr, q, pid, n_stamp, PERSIST, STAMP)
    return x


@triton.jit
def _state_tile(rec_l, c, offs_k, offs_v0, DK: tl.constexpr, DV: tl.constexpr,
                HV: tl.constexpr, BV: tl.constexpr):
    """Pointers and mask of core task c's fp32 state tile S[h, :, v0:v0 + BV] (value heads
    fastest: h = c % HV, v0 = (c // HV) * BV, the engine's order)."""
    hh = c % HV
    offs_v = (c // HV) * BV + offs_v0
    ptrs = (rec_l + hh.to(tl.int64) * (DK * DV) + offs_k.to(tl.int64)[:, None] * DV
            + offs_v[None, :])
    mask = (offs_k < DK)[:, None] & (offs_v < DV)[None, :]
    return ptrs, mask


@triton.jit
def _core_tile(S, c, proj_ptr, o_ptr, rec_l, alog_l, dtb_l, q_scale, offs_k, offs_v0,
               HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BV: tl.constexpr):
    """The delta rule of one token on core task c's state tile S (loaded by the caller):
    kernels/gdn_decode.py's formulas (every reduction on the loaded values), S and o stored."""
    KEY_DIM: tl.constexpr = HK * DK
    CONV_DIM: tl.constexpr = 2 * KEY_DIM + HV * DV
    GROUP: tl.constexpr = HV // HK
    act = proj_ptr.dtype.element_ty
    hh = c % HV
    hk = hh // GROUP
    offs_v = (c // HV) * BV + offs_v0
    mk = offs_k < DK
    mv = offs_v < DV
    q = tl.load(proj_ptr + hk * DK + offs_k, mask=mk, other=0.0,
                cache_modifier=".cg").to(tl.float32)
    k = tl.load(proj_ptr + KEY_DIM + hk * DK + offs_k, mask=mk, other=0.0,
                cache_modifier=".cg").to(tl.float32)
    v = tl.load(proj_ptr + 2 * KEY_DIM + hh * DV + offs_v, mask=mv, other=0.0,
                cache_modifier=".cg").to(tl.float32)
    b = tl.load(proj_ptr + CONV_DIM + hh, cache_modifier=".cg").to(tl.float32)
    a = tl.load(proj_ptr + CONV_DIM + HV + hh, cache_modifier=".cg").to(tl.float32)
    dt_b = tl.load(dtb_l + hh).to(tl.float32)
    a_log = tl.load(alog_l + hh).to(tl.float32)
    S, o = _delta_rule(S, q, k, v, b, a, dt_b, a_log, q_scale, act, L2_EPS_K, SP_THRESHOLD_K)
    ptrs, mask = _state_tile(rec_l, c, offs_k, offs_v0, DK, DV, HV, BV)
    tl.store(ptrs, S, mask=mask)
    tl.store(o_ptr + hh * DV + offs_v, o.to(o_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _gdn_core_z(x, proj_ptr, z_ptr, o_ptr, wz_l, rec_l, alog_l, dtb_l, q_scale,
                cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op,
                stall_ns, timeout_ns, n_stamp,
                D: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                DV: tl.constexpr, BV: tl.constexpr, BN_Z: tl.constexpr, SPIN: tl.constexpr,
                PERSIST: tl.constexpr, STALL: tl.constexpr, STAMP: tl.constexpr,
                PDL: tl.constexpr):
    """Tasks [core tiles (value head x V-tile) | z row tiles], task t program t mod G's. A
    program's z rows first (z = W_z x needs only the layer input x: no wait), then the wait for
    the in_proj, then its core tiles."""
    DP: tl.constexpr = triton.next_power_of_2(D)
    DKP: tl.constexpr = triton.next_power_of_2(DK)
    VD: tl.constexpr = HV * DV
    T_C: tl.constexpr = HV * ((DV + BV - 1) // BV)
    T_1: tl.constexpr = T_C + (VD + BN_Z - 1) // BN_Z
    n_c = (T_C - pid + G - 1) // G                      # my core tiles: pid, pid + G, ...
    n_all = (T_1 - pid + G - 1) // G
    n_z = n_all - n_c                                   # then my z tiles
    offs_k = tl.arange(0, DKP)
    offs_v0 = tl.arange(0, BV)
    offs_h = tl.arange(0, DP)
    # my first state tile (mine since the previous step) and my first z rows, before anything
    s_ptrs, s_mask = _state_tile(rec_l, pid, offs_k, offs_v0, DK, DV, HV, BV)
    # (a task that does not exist: its bound is 0, every lane masked off)
    S_c = tl.load(s_ptrs, mask=s_mask & (offs_v0[None, :] < tl.where(pid < T_C, BV, 0)),
                  other=0.0)
    zrows = (pid + n_c * G - T_C) * BN_Z + tl.arange(0, BN_Z)
    zok = zrows < tl.where(n_z > 0, VD, 0)
    wz_c = rows_load(wz_l, zrows, zok, offs_h, D, DP)
    for j in range(n_z):
        nz = zrows + G * BN_Z
        nzok = nz < VD
        wz_n = rows_load(wz_l, nz, nzok, offs_h, D, DP)
        y = tl.sum(wz_c.to(tl.float32) * x[None, :], axis=1)
        tl.store(z_ptr + zrows, y.to(z_ptr.dtype.element_ty), mask=zok)
        zrows, zok, wz_c = nz, nzok, wz_n
    _op_begin(cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
              timeout_ns, n_stamp, SPIN, PERSIST, STALL, STAMP, PDL)
    for j in range(n_c):
        c = pid + j * G
        n_ptrs, n_mask = _state_tile(rec_l, c + G, offs_k, offs_v0, DK, DV, HV, BV)
        S_n = tl.load(n_ptrs, mask=n_mask & (offs_v0[None, :] < tl.where(c + G < T_C, BV, 0)),
                      other=0.0)
        _core_tile(S_c, c, proj_ptr, o_ptr, rec_l, alog_l, dtb_l, q_scale, offs_k, offs_v0,
                   HK, HV, DK, DV, BV)
        S_c = S_n
    _op_end(cnt_ptr, stamp_ptr, q, pid, n_stamp, PERSIST, STAMP)


@triton.jit
def _narrow_task(t, offs, N: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr,
                 HV: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr):
    """Task t of a narrow projection: row block t // KS, K-split t % KS. Its rows and their
    mask, and its columns of W with their mask (GATED: the input is laid out [HV', DV'] in
    powers of two, column j of the split is W's column (j // DV') * DV + j % DV')."""
    DVP: tl.constexpr = triton.next_power_of_2(DV)
    HVP: tl.constexpr = triton.next_power_of_2(HV)
    KP: tl.constexpr = HVP * DVP if GATED else triton.next_power_of_2(K)
    KC: tl.constexpr = KP // KS
    T: tl.constexpr = ((N + BN - 1) // BN) * KS
    rows = (t // KS) * BN + tl.arange(0, BN)
    ok = (rows < N) & ((rows * 0 + t) < T)      # (a vector: the interpreter rejects scalar & vector)
    j = (t % KS) * KC + offs
    if GATED:
        cols = (j // DVP) * DV + j % DVP
        cok = ((j // DVP) < HV) & ((j % DVP) < DV)
    else:
        cols = j
        cok = j < K
    return rows, ok, cols, cok


@triton.jit
def _narrow_x(x_ptr, z_ptr, gw, s, eps, K: tl.constexpr, GATED: tl.constexpr,
              HV: tl.constexpr, DV: tl.constexpr, KC: tl.constexpr):
    """K-split s of a narrow projection's input, fp32 [KC]: x itself, or (GATED) whole value
    heads of round(w * round(o_j * rsqrt(mean(o_j^2) + eps)) * silu(z_j)) (x = o)."""
    if GATED:
        DVP: tl.constexpr = triton.next_power_of_2(DV)
        HC: tl.constexpr = KC // DVP                   # value heads in a split
        hh = s * HC + tl.arange(0, HC)[:, None]
        dd = tl.arange(0, DVP)[None, :]
        m = (hh < HV) & (dd < DV)
        o2 = tl.load(x_ptr + hh * DV + dd, mask=m, other=0.0, cache_modifier=".cg")
        zf = tl.load(z_ptr + hh * DV + dd, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        act = o2.dtype
        of = o2.to(tl.float32)
        inv = tl.rsqrt(tl.sum(of * of, axis=1) / DV + eps)
        n = (of * inv[:, None]).to(act).to(tl.float32)
        x2 = (gw[None, :] * n * (zf * tl.sigmoid(zf))).to(act).to(tl.float32)
        return tl.reshape(x2, (KC,))
    else:
        j = s * KC + tl.arange(0, KC)
        return tl.load(x_ptr + j, mask=j < K, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _narrow(x_ptr, z_ptr, gw_l, w_l, h_ptr, kpart_ptr, tick_ptr, eps,
            cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
            timeout_ns, n_stamp,
            N: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr, HV: tl.constexpr,
            DV: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr, SPIN: tl.constexpr,
            PERSIST: tl.constexpr, STALL: tl.constexpr, STAMP: tl.constexpr,
            PDL: tl.constexpr):
    """h[rows] += W[rows] @ x for the narrow projections (out_proj with the gated norm of
    (o, z) as x, o_proj, down): tasks of BN rows x K-split. KS = 1: row-only tasks, each row's
    sum whole. KS > 1: each task stores its fp32 partial and takes the row block's ticket; the
    task drawing the last one adds the KS partials in split order, and the residual (a fixed
    order whoever draws it), and resets the ticket."""
    DVP: tl.constexpr = triton.next_power_of_2(DV)
    HVP: tl.constexpr = triton.next_power_of_2(HV)
    KP: tl.constexpr = HVP * DVP if GATED else triton.next_power_of_2(K)
    KC: tl.constexpr = KP // KS
    T: tl.constexpr = ((N + BN - 1) // BN) * KS
    n_mine = (T - pid + G - 1) // G
    offs = tl.arange(0, KC)
    t = pid
    rows, ok, cols, cok = _narrow_task(t, offs, N, K, GATED, HV, DV, BN, KS)
    # before the wait: my first tile, my residual rows (last written two operators back,
    # complete before the operator this one waits for started), the gated norm's weight
    w_c = tl.load(w_l + rows.to(tl.int64)[:, None] * K + cols[None, :],
                  mask=ok[:, None] & cok[None, :], other=0.0, eviction_policy="evict_first")
    r_c = tl.load(h_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    gw = tl.zeros((DVP,), dtype=tl.float32)
    if GATED:
        gw = tl.load(gw_l + tl.arange(0, DVP), mask=tl.arange(0, DVP) < DV,
                     other=0.0).to(tl.float32)
    _op_begin(cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
              timeout_ns, n_stamp, SPIN, PERSIST, STALL, STAMP, PDL)
    for i in range(n_mine):
        tn = t + G
        rows_n, ok_n, cols_n, cok_n = _narrow_task(tn, offs, N, K, GATED, HV, DV, BN, KS)
        w_n = tl.load(w_l + rows_n.to(tl.int64)[:, None] * K + cols_n[None, :],
                      mask=ok_n[:, None] & cok_n[None, :], other=0.0,
                      eviction_policy="evict_first")
        r_n = tl.load(h_ptr + rows_n, mask=ok_n, other=0.0, cache_modifier=".cg").to(tl.float32)
        x = _narrow_x(x_ptr, z_ptr, gw, t % KS, eps, K, GATED, HV, DV, KC)
        y = tl.sum(w_c.to(tl.float32) * x[None, :], axis=1)
        if KS == 1:
            tl.store(h_ptr + rows, (y + r_c).to(h_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(kpart_ptr + (t % KS) * N + rows, y, mask=ok)
            tl.debug_barrier()       # every partial store issued before the ticket (release)
            ticket = tl.atomic_add(tick_ptr + t // KS, 1, sem="acq_rel", scope="gpu")
            if ticket == KS - 1:
                acc = tl.zeros((BN,), dtype=tl.float32)
                for s in tl.static_range(KS):
                    acc += tl.load(kpart_ptr + s * N + rows, mask=ok, other=0.0,
                                   cache_modifier=".cg")
                tl.store(h_ptr + rows, (acc + r_c).to(h_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(tick_ptr + t // KS, 0, sem="relaxed", scope="gpu")
        t, rows, ok, cols, cok, w_c, r_c = tn, rows_n, ok_n, cols_n, cok_n, w_n, r_n
    _op_end(cnt_ptr, stamp_ptr, q, pid, n_stamp, PERSIST, STAMP)


@triton.jit
def _rms_gemv(h_ptr, out_ptr, w_l, nw_l, eps,
              cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
              timeout_ns, n_stamp,
              N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, SILU_MUL: tl.constexpr,
              SPIN: tl.constexpr, PERSIST: tl.constexpr, STALL: tl.constexpr,
              STAMP: tl.constexpr, PDL: tl.constexpr):
    """out[rows] = round(W[rows] x) (the attention's q|gate|k|v) or, SILU_MUL with W = [Wg; Wu]
    ([2N, K]), round(silu(Wg[rows] x) * (Wu[rows] x)) (the MLP's gate|up); x = the zero-centred
    RMSNorm of h (h final before this operator's wait)."""
    KP: tl.constexpr = triton.next_power_of_2(K)
    n_mine, rows, ok = _my_tasks(pid, G, N, BN)
    offs = tl.arange(0, KP)
    wg_c = rows_load(w_l, rows, ok, offs, K, KP)
    wu_c = wg_c
    if SILU_MUL:
        wu_c = rows_load(w_l + N * K, rows, ok, offs, K, KP)
    nw = tl.load(nw_l + offs, mask=offs < K, other=0.0).to(tl.float32)
    _op_begin(cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
              timeout_ns, n_stamp, SPIN, PERSIST, STALL, STAMP, PDL)
    x = _rms_x(h_ptr, nw, offs, eps, K)
    for i in range(n_mine):
        nrows = rows + G * BN
        nok = nrows < N
        wg_n = rows_load(w_l, nrows, nok, offs, K, KP)
        wu_n = wg_n
        if SILU_MUL:
            wu_n = rows_load(w_l + N * K, nrows, nok, offs, K, KP)
        y = tl.sum(wg_c.to(tl.float32) * x[None, :], axis=1)
        if SILU_MUL:
            u = tl.sum(wu_c.to(tl.float32) * x[None, :], axis=1)
            y = y * tl.sigmoid(y) * u
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=ok)
        rows, ok, wg_c, wu_c = nrows, nok, wg_n, wu_n
    _op_end(cnt_ptr, stamp_ptr, q, pid, n_stamp, PERSIST, STAMP)


@triton.jit
def _attn_task(qg_ptr, part_ptr, kc, vc, g, s, p, start, end, cache_end, kt0, vt0, nm0, cos, sin,
               qw, qwp, kw, kwp, offs_d, d_mask, partner, eps, qk_scale_log2, max_ctx,
               H: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr, GROUP: tl.constexpr,
               NS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Split s of KV head g (an active split): kernels/attention_decode.py's split program.
    The group's queries and this token's key / value normed and rotated, the key / value into
    cache slot p (split 0; no task reads slot p in this step), the online softmax over the
    split's cached positions (the first tile kt0 / vt0 loaded by the caller) and the new token,
    the partials stored: acc rows [H, NS, HD], then (m, l) pairs [H, NS, 2]."""
    cdt = kc.dtype.element_ty
    act = qg_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    heads = g * GROUP + offs_h
    qrows = qg_ptr + heads[:, None] * (2 * HD)
    qm = h_mask[:, None] & d_mask[None, :]
    K_OFF: tl.constexpr = H * 2 * HD
    V_OFF: tl.constexpr = K_OFF + (H // GROUP) * HD
    # this token's key and value as [1, BLOCK_D] rows (fewer registers than attention_decode's
    # rows repeated per query head: the persistent kernel holds every operator's live values)
    kv_off = g * HD + offs_d[None, :]
    dm = d_mask[None, :]
    qx = tl.load(qrows + offs_d[None, :], mask=qm, other=0.0, cache_modifier=".cg").to(tl.float32)
    qxp = tl.load(qrows + partner[None, :], mask=qm, other=0.0,
                  cache_modifier=".cg").to(tl.float32)
    kx = tl.load(qg_ptr + K_OFF + kv_off, mask=dm, other=0.0, cache_modifier=".cg").to(tl.float32)
    kxp = tl.load(qg_ptr + K_OFF + g * HD + partner[None, :], mask=dm, other=0.0,
                  cache_modifier=".cg").to(tl.float32)
    v_new = tl.load(qg_ptr + V_OFF + kv_off, mask=dm, other=0.0, cache_modifier=".cg").to(cdt)
    qv = _norm_rope(qx, qxp, qw, qwp, cos, sin, offs_d, eps, act, HD, ROT)
    k_new = _norm_rope(kx, kxp, kw, kwp, cos, sin, offs_d, eps, act, HD, ROT)
    k_new = k_new.to(cdt).to(tl.float32)
    if s == 0:
        slot_ok = dm & ((offs_d * 0 + p) < max_ctx)[None, :]
        dst = p.to(tl.int64) * HD + offs_d[None, :]
        tl.store(kc + dst, k_new.to(cdt), mask=slot_ok)
        tl.store(vc + dst, v_new, mask=slot_ok)
    _split_partials(qv, k_new, v_new, kt0, vt0, nm0, kc, vc, start, end, cache_end, p, heads,
                    h_mask, offs_d, d_mask, part_ptr, s, qk_scale_log2, H, NS, HD, BLOCK_H,
                    BLOCK_D, BLOCK_N, DOT_PRECISION)


@triton.jit
def _split_range(t, p, per_split, max_ctx, KV: tl.constexpr, T: tl.constexpr):
    """Task t of the attention: KV head t % KV, split t // KV, its positions [start, end) and
    the end of its cached ones (none for a task past T)."""
    g = t % KV
    s = t // KV
    start = s * per_split
    end = tl.minimum(start + per_split, p + 1)
    cache_end = tl.minimum(tl.minimum(end, p), max_ctx)
    cache_end = tl.where(t < T, cache_end, 0)
    return g, s, start, end, cache_end


@triton.jit
def _attn_core(qg_ptr, part_ptr, kc_l, vc_l, qn_l, kn_l, pos_ptr, max_ctx, eps, qk_scale_log2,
               freq_log2_step,
               cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
               timeout_ns, n_stamp,
               H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
               NS: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
               SPIN: tl.constexpr, PERSIST: tl.constexpr, STALL: tl.constexpr,
               STAMP: tl.constexpr, PDL: tl.constexpr):
    """(KV head, split) tasks over positions 0..p; the split length is ceil((p+1)/NS) rounded
    up to BLOCK_N, so splits past the end have nothing to do (and store nothing). Before the
    wait: the norm weights, the RoPE table of p and the first task's first K/V tile (earlier
    steps wrote them); each later task's first tile is loaded after the task before it."""
    GROUP: tl.constexpr = H // KV
    # (the host's sizes of attention_decode; tl.dot needs M >= 16)
    BLOCK_H: tl.constexpr = 16 if GROUP <= 16 else triton.next_power_of_2(GROUP)
    BLOCK_D: tl.constexpr = 16 if HD <= 16 else triton.next_power_of_2(HD)
    T: tl.constexpr = KV * NS
    n_mine = (T - pid + G - 1) // G
    act = qg_ptr.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HD
    partner = _rope_partner(offs_d, ROT)
    wq2 = _norm_weights(qn_l, offs_d, HD, ROT)
    wk2 = _norm_weights(kn_l, offs_d, HD, ROT)
    p, per_split, n_active = split_layout(pos_ptr, NS, BLOCK_N)
    cos, sin = _rope_table(p.to(tl.float32), freq_log2_step, offs_d, act, ROT, BLOCK_D)
    qw, qwp = _row(wq2, 0), _row(wq2, 1)
    kw, kwp = _row(wk2, 0), _row(wk2, 1)
    t = pid
    g, s, start, end, cache_end = _split_range(t, p, per_split, max_ctx, KV, T)
    kt0, vt0, nm0 = _kv_tile(kc_l + g.to(tl.int64) * max_ctx * HD,
                             vc_l + g.to(tl.int64) * max_ctx * HD, start, cache_end, offs_d,
                             d_mask, HD, BLOCK_N)
    _op_begin(cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
              timeout_ns, n_stamp, SPIN, PERSIST, STALL, STAMP, PDL)
    for i in range(n_mine):
        if s < n_active:
            _attn_task(qg_ptr, part_ptr, kc_l + g.to(tl.int64) * max_ctx * HD,
                       vc_l + g.to(tl.int64) * max_ctx * HD, g, s, p, start, end, cache_end,
                       kt0, vt0, nm0, cos, sin, qw, qwp, kw, kwp, offs_d, d_mask, partner, eps,
                       qk_scale_log2, max_ctx, H, HD, ROT, GROUP, NS, BLOCK_H, BLOCK_D,
                       BLOCK_N, DOT_PRECISION)
        # the next task's first tile (after this task: two tiles in flight would not fit the
        # shared memory of two programs an SM)
        t = t + G
        g, s, start, end, cache_end = _split_range(t, p, per_split, max_ctx, KV, T)
        kt0, vt0, nm0 = _kv_tile(kc_l + g.to(tl.int64) * max_ctx * HD,
                                 vc_l + g.to(tl.int64) * max_ctx * HD, start, cache_end, offs_d,
                                 d_mask, HD, BLOCK_N)
    _op_end(cnt_ptr, stamp_ptr, q, pid, n_stamp, PERSIST, STAMP)


@triton.jit
def _attn_merge(qg_ptr, part_ptr, out_ptr, pos_ptr,
                cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op,
                stall_ns, timeout_ns, n_stamp,
                H: tl.constexpr, HD: tl.constexpr, NS: tl.constexpr, BLOCK_N: tl.constexpr,
                BDM: tl.constexpr, SPIN: tl.constexpr, PERSIST: tl.constexpr,
                STALL: tl.constexpr, STAMP: tl.constexpr, PDL: tl.constexpr):
    """(head, BDM dims) tasks: the active splits' partials max-rescaled and summed in split
    order, MERGE_K at a time (kernels/attention_decode.py's _merge_chunk), then
    out = round(round(o) * round(sigmoid(gate)))."""
    ND: tl.constexpr = (HD + BDM - 1) // BDM
    T: tl.constexpr = H * ND
    act = out_ptr.dtype.element_ty
    p, per_split, n_active = split_layout(pos_ptr, NS, BLOCK_N)
    ml_ptr = part_ptr + H * NS * HD
    two = tl.arange(0, 2)
    g_mask = two < 1                 # one head a task (a two-row tile: _merge_chunk's layout)
    _op_begin(cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
              timeout_ns, n_stamp, SPIN, PERSIST, STALL, STAMP, PDL)
    for t in range(pid, T, G):
        hrow = t // ND + two
        offs_d = (t % ND) * BDM + tl.arange(0, BDM)
        d_mask = offs_d < HD
        run_max = tl.full((2,), float("-inf"), dtype=tl.float32)
        num = tl.zeros((2, BDM), dtype=tl.float32)
        den = tl.zeros((2,), dtype=tl.float32)
        for c0 in range(0, n_active, MERGE_K):
            run_max, num, den = _merge_chunk(part_ptr, ml_ptr, hrow, g_mask, NS, c0, n_active,
                                             run_max, num, den, offs_d, d_mask, HD, MERGE_K)
        o = (num / tl.where(den > 0.0, den, 1.0)[:, None]).to(act).to(tl.float32)
        gd_mask = g_mask[:, None] & d_mask[None, :]
        gate = tl.load(qg_ptr + hrow[:, None] * (2 * HD) + HD + offs_d[None, :], mask=gd_mask,
                       other=0.0, cache_modifier=".cg").to(tl.float32)
        sg = tl.sigmoid(gate).to(act).to(tl.float32)
        tl.store(out_ptr + hrow[:, None] * HD + offs_d[None, :], (o * sg).to(act), mask=gd_mask)
    _op_end(cnt_ptr, stamp_ptr, q, pid, n_stamp, PERSIST, STAMP)


@triton.jit
def _lm_head(h_ptr, fn_ptr, e_ptr, logits_ptr, keys_ptr, valid_vocab, eps,
             cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
             timeout_ns, n_stamp,
             V: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, SPIN: tl.constexpr,
             PERSIST: tl.constexpr, STALL: tl.constexpr, STAMP: tl.constexpr,
             PDL: tl.constexpr):
    """logits[rows] = E[rows] @ round(rms_norm(h) * (1 + w_final)) in fp32, and this program's
    best key (logit, then the lowest id; ids past valid_vocab never win) into keys[pid]."""
    KP: tl.constexpr = triton.next_power_of_2(K)
    n_mine, rows, ok = _my_tasks(pid, G, V, BN)
    offs = tl.arange(0, KP)
    w_c = rows_load(e_ptr, rows, ok, offs, K, KP)
    nw = tl.load(fn_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
    _op_begin(cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
              timeout_ns, n_stamp, SPIN, PERSIST, STALL, STAMP, PDL)
    x = _rms_x(h_ptr, nw, offs, eps, K)
    best = tl.full((BN,), _KEY_EMPTY, dtype=tl.int64)
    for i in range(n_mine):
        nrows = rows + G * BN
        nok = nrows < V
        w_n = rows_load(e_ptr, nrows, nok, offs, K, KP)
        logit = tl.sum(w_c.to(tl.float32) * x[None, :], axis=1)
        tl.store(logits_ptr + rows, logit, mask=ok)
        best = tl.maximum(best, tl.where(rows < valid_vocab, _pack(logit, rows), _KEY_EMPTY))
        rows, ok, w_c = nrows, nok, w_n
    tl.store(keys_ptr + pid, tl.max(best, axis=0))
    _op_end(cnt_ptr, stamp_ptr, q, pid, n_stamp, PERSIST, STAMP)


@triton.jit
def _argmax(keys_ptr, tok_ptr, counts_ptr, row_offset, pos_ptr, ring_ptr,
            cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
            timeout_ns, n_stamp,
            BLOCK: tl.constexpr, ADVANCE: tl.constexpr, RING: tl.constexpr, SPIN: tl.constexpr,
            PERSIST: tl.constexpr, STALL: tl.constexpr, STAMP: tl.constexpr,
            PDL: tl.constexpr):
    """One task (program 0's): the programs' keys -> the token into tok; counted in the
    generated row of counts; ADVANCE: ring[pos % RING] = token and pos += 1 (the step's last
    writes: nothing in this step reads tok or pos after the embedding and the attention)."""
    _op_begin(cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q, base, pid, G, stall_op, stall_ns,
              timeout_ns, n_stamp, SPIN, PERSIST, STALL, STAMP, PDL)
    if pid == 0:
        best = tl.full((BLOCK,), _KEY_EMPTY, dtype=tl.int64)
        for i0 in range(0, G, BLOCK):
            offs = i0 + tl.arange(0, BLOCK)
            best = tl.maximum(best, tl.load(keys_ptr + offs, mask=offs < G, other=_KEY_EMPTY,
                                            cache_modifier=".cg"))
        tok = _unpack_idx(tl.max(best, axis=0))
        tl.store(tok_ptr, tok.to(tok_ptr.dtype.element_ty))
        _count_and_advance(tok, counts_ptr, row_offset, pos_ptr, ring_ptr, True, ADVANCE, RING)
    _op_end(cnt_ptr, stamp_ptr, q, pid, n_stamp, PERSIST, STAMP)


# ------------------------------------------------------------------------------------------
# the step kernel: persistent (PHASE -1) or one operator kind per launch (PHASE >= 0)
# ------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["phase_layer", "G", "stall_op", "stall_ns", "timeout_ns",
                               "n_stamp", "valid_vocab", "row_offset", "q_lm", "max_ctx"])
def _step_kernel(h_ptr, proj_ptr, z_ptr, o_ptr, qg_ptr, part_ptr, attn_ptr, act_ptr,
                 logits_ptr, keys_ptr, kpart_ptr, tick_ptr,
                 tok_ptr, pos_ptr, ring_ptr, counts_ptr, emb_ptr, fn_ptr, lm_ptr,
                 lw_ptr, sp_ptr, kind_ptr, q0_ptr,
                 cnt_ptr, epoch_ptr, err_ptr, stamp_ptr, stall_rec_ptr,
                 phase_layer, G, q_lm, eps, q_scale, qk_scale_log2, freq_log2_step, max_ctx,
                 valid_vocab, row_offset, stall_op, stall_ns, timeout_ns, n_stamp,
                 NL: tl.constexpr, D: tl.constexpr, I: tl.constexpr, V: tl.constexpr,
                 HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 KW: tl.constexpr, H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr,
                 ROT: tl.constexpr, SP: tl.constexpr,
                 BN_E: tl.constexpr, BN_IN: tl.constexpr, BN_Z: tl.constexpr, BV: tl.constexpr,
                 BN_O: tl.constexpr, KS_O: tl.constexpr, BN_QKV: tl.constexpr,
                 NS: tl.constexpr, BLOCK_N: tl.constexpr, BDM: tl.constexpr,
                 BN_AO: tl.constexpr, KS_AO: tl.constexpr, BN_GU: tl.constexpr,
                 BN_D: tl.constexpr, KS_D: tl.constexpr, BN_LM: tl.constexpr,
                 ARG_BLOCK: tl.constexpr,
                 PHASE: tl.constexpr, SAMPLED: tl.constexpr, ADVANCE: tl.constexpr,
                 RING: tl.constexpr, ALIGN: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 SPIN: tl.constexpr, STALL: tl.constexpr, STAMP: tl.constexpr):
    # Activations: h [D] (residual stream, in place), proj [qkv conv out | b | a], z, o
    # [HV DV], qg [q|gate | k | v] of the attention, part its split partials (fp32), attn its
    # gated output [H HD], act [I], logits [V] fp32, keys [G] int64, kpart [KS, D] fp32 and
    # tick [D / BN] int32 (the K-split partials and tickets). Operator q of the step: 0 the
    # embedding, layer l's from q0[l] on (5 for a Gated DeltaNet layer, 6 for attention), q_lm
    # the LM head, q_lm + 1 the argmax.
    pid = tl.program_id(0)
    PERSIST: tl.constexpr = PHASE == -1
    ACT = h_ptr.dtype.element_ty
    KEY_DIM: tl.constexpr = HK * DK
    CONV_DIM: tl.constexpr = 2 * KEY_DIM + HV * DV
    N_IN: tl.constexpr = CONV_DIM + 2 * HV
    N_QKV: tl.constexpr = 2 * H * HD + 2 * KV * HD
    DP: tl.constexpr = triton.next_power_of_2(D)
    LAYER_OP: tl.constexpr = (PHASE >= 1) & (PHASE <= 9)
    base = 1
    if PERSIST:
        base = tl.load(epoch_ptr + pid) + 1               # this step's counter multiple
    if PERSIST or PHASE == 0:
        _embed(tok_ptr, emb_ptr, h_ptr, cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, 0, base, pid,
               G, stall_op, stall_ns, timeout_ns, n_stamp, D, BN_E, SPIN, PERSIST, STALL, STAMP)
    l_lo = 0
    l_hi = NL
    if not PERSIST:
        l_lo = phase_layer
        l_hi = phase_layer                                # no layer: an empty loop
        if LAYER_OP:
            l_hi = phase_layer + 1
    for l in range(l_lo, l_hi):
        kind = tl.load(kind_ptr + l)
        q0 = tl.load(q0_ptr + l)
        sp_l = sp_ptr + l * SP                            # fp32: norms, A_log, dt_bias
        w_in = _layer_ptr(lw_ptr, l, 0, ACT, ALIGN)
        w_out = _layer_ptr(lw_ptr, l, 4, ACT, ALIGN)
        qm = q0 + 3
        if kind == 0:                                      # Gated DeltaNet
            cw_l = _layer_ptr(lw_ptr, l, 1, ACT, ALIGN)
            cs_l = _layer_ptr(lw_ptr, l, 2, ACT, ALIGN)
            rec_l = _layer_ptr(lw_ptr, l, 3, tl.float32, ALIGN)
            if PERSIST or PHASE == 1:
                x = _gdn_in_proj(h_ptr, proj_ptr, w_in, sp_l, cw_l, cs_l, eps,
                                 cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q0, base, pid, G,
                                 stall_op, stall_ns, timeout_ns, n_stamp,
                                 D, N_IN, CONV_DIM, KW, BN_IN, SPIN, PERSIST, STALL, STAMP, 0)
            if PERSIST or PHASE == 2:
                if PHASE == 2:
                    # its own launch: the normed layer input again (h is final)
                    offs_h = tl.arange(0, DP)
                    x = _rms_x(h_ptr, tl.load(sp_l + offs_h, mask=offs_h < D, other=0.0),
                               offs_h, eps, D)
                _gdn_core_z(x, proj_ptr, z_ptr, o_ptr, w_in + N_IN * D, rec_l, sp_l + 2 * D,
                            sp_l + 2 * D + HV, q_scale,
                            cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q0 + 1, base, pid, G,
                            stall_op, stall_ns, timeout_ns, n_stamp,
                            D, HK, HV, DK, DV, BV, BN_Z, SPIN, PERSIST, STALL, STAMP, 0)
            if PERSIST or PHASE == 3:
                _narrow(o_ptr, z_ptr, sp_l + 2 * D + 2 * HV, w_out, h_ptr, kpart_ptr, tick_ptr,
                        eps, cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q0 + 2, base, pid, G,
                        stall_op, stall_ns, timeout_ns, n_stamp,
                        D, HV * DV, True, HV, DV, BN_O, KS_O, SPIN, PERSIST, STALL, STAMP, 0)
        else:                                              # gated attention
            kc_l = _layer_ptr(lw_ptr, l, 1, ACT, ALIGN)
            vc_l = _layer_ptr(lw_ptr, l, 2, ACT, ALIGN)
            if PERSIST or PHASE == 4:
                _rms_gemv(h_ptr, qg_ptr, w_in, sp_l, eps,
                          cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q0, base, pid, G, stall_op,
                          stall_ns, timeout_ns, n_stamp,
                          N_QKV, D, BN_QKV, False, SPIN, PERSIST, STALL, STAMP, 0)
            if PERSIST or PHASE == 5:
                _attn_core(qg_ptr, part_ptr, kc_l, vc_l, sp_l + 2 * D, sp_l + 2 * D + HD, pos_ptr,
                           max_ctx, eps, qk_scale_log2, freq_log2_step,
                           cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q0 + 1, base, pid, G,
                           stall_op, stall_ns, timeout_ns, n_stamp,
                           H, KV, HD, ROT, NS, BLOCK_N, DOT_PRECISION, SPIN, PERSIST, STALL,
                           STAMP, 0)
            if PERSIST or PHASE == 6:
                _attn_merge(qg_ptr, part_ptr, attn_ptr, pos_ptr,
                            cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q0 + 2, base, pid, G,
                            stall_op, stall_ns, timeout_ns, n_stamp,
                            H, HD, NS, BLOCK_N, BDM, SPIN, PERSIST, STALL, STAMP, 0)
            if PERSIST or PHASE == 7:
                _narrow(attn_ptr, attn_ptr, sp_l, w_out, h_ptr, kpart_ptr, tick_ptr, eps,
                        cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q0 + 3, base, pid, G,
                        stall_op, stall_ns, timeout_ns, n_stamp,
                        D, H * HD, False, 1, 1, BN_AO, KS_AO, SPIN, PERSIST, STALL, STAMP, 0)
            qm = q0 + 4
        if PERSIST or PHASE == 8:
            _rms_gemv(h_ptr, act_ptr, _layer_ptr(lw_ptr, l, 5, ACT, ALIGN), sp_l + D, eps,
                      cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, qm, base, pid, G, stall_op,
                      stall_ns, timeout_ns, n_stamp,
                      I, D, BN_GU, True, SPIN, PERSIST, STALL, STAMP, 0)
        if PERSIST or PHASE == 9:
            _narrow(act_ptr, act_ptr, sp_l, _layer_ptr(lw_ptr, l, 6, ACT, ALIGN), h_ptr,
                    kpart_ptr, tick_ptr, eps,
                    cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, qm + 1, base, pid, G, stall_op,
                    stall_ns, timeout_ns, n_stamp,
                    D, I, False, 1, 1, BN_D, KS_D, SPIN, PERSIST, STALL, STAMP, 0)
    if PERSIST or PHASE == 10:
        _lm_head(h_ptr, fn_ptr, lm_ptr, logits_ptr, keys_ptr, valid_vocab, eps,
                 cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q_lm, base, pid, G, stall_op,
                 stall_ns, timeout_ns, n_stamp, V, D, BN_LM, SPIN, PERSIST, STALL, STAMP, 0)
    if not SAMPLED:
        if PERSIST or PHASE == 11:
            _argmax(keys_ptr, tok_ptr, counts_ptr, row_offset, pos_ptr, ring_ptr,
                    cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q_lm + 1, base, pid, G, stall_op,
                    stall_ns, timeout_ns, n_stamp, ARG_BLOCK, ADVANCE, RING, SPIN, PERSIST,
                    STALL, STAMP, 0)
    if PERSIST:
        tl.store(epoch_ptr + pid, base)


# ------------------------------------------------------------------------------------------
# host: the plan (tile sizes, grid), the scratch it needs, the launch
# ------------------------------------------------------------------------------------------

TILE = 8192                 # weight elements a task's tile holds (two tiles in flight a program)
MAX_SPLIT = 4               # K-splits of a narrow projection at most
PROGRAMS_PER_SM = 2
NUM_WARPS = 4


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def step_plan(dims: dict, *, sm_count: int, max_context: int, split_k: bool, tile: int = TILE,
              overrides: Optional[dict] = None) -> dict:
    """The kernel's grid and tile sizes for a model of `dims` (D, I, V, HK, HV, DK, DV, KW, H,
    KV, HD, ROT): grid = sm_count x programs_per_sm (PROGRAMS_PER_SM), rows per task so a
    task's tile is about `tile` weight elements; split_k: the narrow projections (N = D rows)
    split K into up to MAX_SPLIT tasks a row block, as many as it takes to give every program
    two tasks (row-only tasks without); the attention's split count covers the grid at long
    contexts (attention_decode's rule). `overrides` replaces entries by name (tests, tuning):
    any of the returned keys, programs_per_sm included."""
    overrides = dict(overrides or {})
    ppsm = int(overrides.pop("programs_per_sm", PROGRAMS_PER_SM))
    grid = int(sm_count) * ppsm
    d = dims
    rows = lambda k: max(1, min(16, _prev_pow2(tile // next_pow2(k))))  # noqa: E731

    def narrow(kp: int, most: int) -> tuple[int, int]:
        bn = rows(kp)
        ks = 1
        if split_k:
            want = cdiv(2 * grid, cdiv(d["D"], bn))
            while ks < min(want, MAX_SPLIT, most) and kp // (2 * ks) >= 16:
                ks *= 2
        return bn, ks

    hvp, dvp = next_pow2(d["HV"]), next_pow2(d["DV"])
    # K/V tiles of at most 8K elements: the attention's dot operands live in shared memory, and
    # two programs an SM must fit
    block_n = max(16, min(tile_positions(d["H"], d["KV"], d["HD"]), 8192 // next_pow2(d["HD"])))
    bn_o, ks_o = narrow(hvp * dvp, hvp)
    bn_ao, ks_ao = narrow(next_pow2(d["H"] * d["HD"]), MAX_SPLIT)
    bn_d, ks_d = narrow(next_pow2(d["I"]), MAX_SPLIT)
    p = dict(BN_E=min(1024, next_pow2(d["D"])), BN_IN=rows(d["D"]), BN_Z=rows(d["D"]),
             BV=min(dvp, default_block_v(d["DV"], d["HV"])), BN_O=bn_o, KS_O=ks_o,
             BN_QKV=rows(d["D"]), NS=max(1, min(max(1, grid // d["KV"]), cdiv(max_context, block_n))),
             BLOCK_N=block_n, BDM=max(16, min(64, next_pow2(d["HD"]))), BN_AO=bn_ao, KS_AO=ks_ao,
             BN_GU=max(1, rows(d["D"]) // 2), BN_D=bn_d, KS_D=ks_d, BN_LM=rows(d["D"]),
             ARG_BLOCK=min(1024, next_pow2(grid)), num_warps=NUM_WARPS)
    p.update(overrides)
    p.update(grid=grid, programs_per_sm=ppsm)
    return p


def scratch_sizes(dims: dict, plan: dict) -> dict:
    """Elements of each scratch buffer the kernel needs: attention partials (fp32), K-split
    partials (fp32) and tickets (int32, zeroed once: every ticket holder resets its ticket),
    LM-head keys (int64, one a program)."""
    d, p = dims, plan
    ks = max(p["KS_O"], p["KS_AO"], p["KS_D"])
    blocks = max(cdiv(d["D"], p[k]) for k in ("BN_O", "BN_AO", "BN_D"))
    return dict(part=d["H"] * p["NS"] * (d["HD"] + 2), kpart=max(1, ks) * d["D"], tick=blocks,
                keys=p["grid"])


def launch(args: dict, meta: dict, grid: int, *, phase: int, layer: int = 0) -> None:
    """One launch of the step kernel on `grid` programs: `args` its runtime arguments by name
    (phase_layer set here), `meta` its constexprs and num_warps; phase PERSISTENT or an
    operator kind (one operator of layer `layer`, or the embedding / LM head / argmax)."""
    _step_kernel[(grid,)](**args, phase_layer=int(layer), PHASE=phase, **meta)
