"""Gated full attention for a prompt chunk: q/k RMSNorm, partial RoPE, KV-cache write, causal
GQA flash attention over the whole cached history, sigmoid output gate (spec section 5).

For new tokens t = 0..T-1 at positions p = start_pos + t, head h, kv head h // (H / Hkv):

    q, g      = qg[t, h*2hd : h*2hd+hd], qg[t, h*2hd+hd : (h+1)*2hd]
    x'        = round(x32 * rsqrt(mean(x32^2) + eps) * (1 + w))            for x in {q, k}
    rope(x')  = [x'_r * cos + rot_half(x'_r) * sin, x'_pass],  x'_r = x'[:rotary_dim]
                 angle_j = p * theta^(-2j/rotary_dim), cos/sin rounded to the dtype
    k_cache[kv, p], v_cache[kv, p] = rope(k'), v
    o         = softmax_{s <= p}(q . K_s * hd^-0.5) V                       fp32 online softmax
    out[t, h] = round(o) * round(sigmoid(g))

Two launches: the K/V pass writes the cache and a cos/sin table of the new positions (every
query block reads keys written by other programs), then the attention pass normalises and
rotates its queries on load. One attention program serves all GROUP = H / Hkv query heads of a
KV head (their rows stacked in one Q tile), so each K/V tile is loaded once per group; blocks
past the diagonal are skipped, blocks before it run unmasked. The output is allocated by the
caller.

Hopper knobs, each a config key (see ATTN_KEYS): KV_LOAD picks per-thread pointer loads or
tensor descriptors (the copy engine, TMA, on sm_90+: no address registers, so a 128 x 256 fp32
accumulator leaves room for 64-key tiles); LOOP runs the unmasked key loop plain or warp
specialised (Triton's producer/consumer split of tl.range). The softmax scale is fused into the
exp2 argument (one FMA a score).

PDL (`pdl`, _common.pdl_mode; both launches): before the wait for the previous kernel a program
does its index math, loads the RoPE frequencies and sends the norm weights to L2; the start
position, the projections, the caches and the cos/sin table are read, and everything is
written, after the wait.

PyTorch reference: kernels/reference.py, section "flash_attention": attention_prefill_ref.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

try:                          # host tensor descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:           # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

from ._common import (FLOAT_DTYPES, _sm90_plus, cdiv, check_pdl, interpreting, launch_kw, next_pow2,
                      pdl_start, pdl_wait, prefetch_l2)

from .gemm import TUNING_PATH, _check_rows, dot_precision, tuned_config

_LOG2E = 1.4426950408889634
# config key KV_LOAD: how the attention pass reads K/V tiles (the table holds positive ints)
KV_POINTERS = 1      # per-thread pointer loads (cp.async pipelining)
KV_TMA = 2           # host tensor descriptors (TMA on sm_90+); pointers where they cannot be used
# config key LOOP: how the unmasked key loop is scheduled
LOOP_PLAIN = 1
LOOP_WARP_SPEC = 2   # tl.range(..., warp_specialize=True)
# rows of the query tile normalised + rotated at a time (keeps the prologue out of spills)
_PROLOGUE_ROWS = 16


@triton.jit
def _norm_rope_tile(src_ptr, row_off, row_mask, cos, sin, w_ptr, eps,
                    HD: tl.constexpr, HDP: tl.constexpr, ROT: tl.constexpr):
    """Load x[row, row_off : row_off+HD] for each row, apply the zero-centred RMSNorm and the
    partial rotate-half RoPE with HF's roundings (cos/sin: [BT, HDP] in the dtype, already
    rounded, only the first ROT columns used); returns the tile in the source dtype.
    Rounded intermediates stay in the dtype until used: with a 64 x 256 query tile every fp32
    copy costs 64 registers a thread."""
    dtype = src_ptr.dtype.element_ty
    cols = tl.arange(0, HDP)
    in_head = cols < HD
    # partner column of rot_half: (c + rot/2) mod rot inside the rotary part, itself elsewhere
    is_rot = cols < ROT
    partner = tl.where(is_rot, tl.where(cols < ROT // 2, cols + ROT // 2, cols - ROT // 2), cols)
    sign = tl.where(cols < ROT // 2, -1.0, 1.0)
    ptrs = src_ptr + row_off[:, None]
    x = tl.load(ptrs + cols[None, :], mask=row_mask[:, None] & in_head[None, :], other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=1) / HD + eps)
    w1 = 1.0 + tl.load(w_ptr + cols, mask=in_head, other=0.0).to(tl.float32)
    xn = (x.to(tl.float32) * rstd[:, None] * w1[None, :]).to(dtype)
    xp = tl.load(ptrs + partner[None, :], mask=row_mask[:, None] & is_rot[None, :], other=0.0)
    w1p = 1.0 + tl.load(w_ptr + partner, mask=is_rot, other=0.0).to(tl.float32)
    xpn = (xp.to(tl.float32) * rstd[:, None] * w1p[None, :]).to(dtype)
    rot = ((xn.to(tl.float32) * cos.to(tl.float32)).to(dtype).to(tl.float32)
           + (sign[None, :] * xpn.to(tl.float32) * sin.to(tl.float32)).to(dtype).to(tl.float32))
    return tl.where(is_rot[None, :], rot.to(dtype), xn)


@triton.jit
def _start(start_pos, START_PTR: tl.constexpr):
    """The first new position: the int argument, or read from a device int32 (a captured
    prefill graph serves every turn of a conversation)."""
    if START_PTR:
        s0 = tl.load(start_pos).to(tl.int32)
    else:
        s0 = start_pos
    return s0


@triton.jit
def _kv_cache_write_kernel(k_ptr, v_ptr, k_norm_w_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr,
                           cos_ptr, sin_ptr, T, start_pos, max_ctx, stride_k, stride_v, eps,
                           HD: tl.constexpr, HDP: tl.constexpr, ROT: tl.constexpr,
                           BLOCK_T: tl.constexpr, START_PTR: tl.constexpr = False,
                           PDL: tl.constexpr = 0):
    pdl_start(PDL)
    pid_t = tl.program_id(0)
    kvh = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    cols = tl.arange(0, HDP)
    m = row_mask[:, None] & (cols < HD)[None, :]
    dtype = k_ptr.dtype.element_ty
    # emb = [angles, angles]: column c uses frequency c mod rot/2; cos/sin rounded like HF's
    is_rot = cols < ROT
    inv_freq = tl.load(inv_freq_ptr + (cols % (ROT // 2)), mask=is_rot, other=0.0)
    if PDL != 0:
        prefetch_l2(k_norm_w_ptr + tl.minimum(cols, HD - 1))
    pdl_wait(PDL)
    pos = _start(start_pos, START_PTR) + rows
    ang = pos.to(tl.float32)[:, None] * inv_freq[None, :]
    cos = tl.cos(ang).to(dtype)
    sin = tl.sin(ang).to(dtype)
    # the query pass reads the same rounded table instead of recomputing it per head
    first_kv = (rows * 0 + kvh) == 0                  # one of the Hkv programs writes it
    half = (row_mask & first_kv)[:, None] & (cols < ROT // 2)[None, :]
    tab = rows.to(tl.int64)[:, None] * (ROT // 2) + cols[None, :]
    tl.store(cos_ptr + tab, cos, mask=half)
    tl.store(sin_ptr + tab, sin, mask=half)
    k = _norm_rope_tile(k_ptr, rows.to(tl.int64) * stride_k + kvh * HD, row_mask,
                        cos, sin, k_norm_w_ptr, eps, HD, HDP, ROT)
    v = tl.load(v_ptr + rows.to(tl.int64)[:, None] * stride_v + kvh * HD + cols[None, :], mask=m)
    cache_rows = (kvh.to(tl.int64) * max_ctx + pos)[:, None] * HD + cols[None, :]
    tl.store(k_cache_ptr + cache_rows, k.to(k_cache_ptr.dtype.element_ty), mask=m)
    tl.store(v_cache_ptr + cache_rows, v.to(v_cache_ptr.dtype.element_ty), mask=m)


@triton.jit
def _attend_block(q, acc, m_i, l_i, k_src, v_src, kv_base, n0, kv_len, pos,
                  qk_scale, HD: tl.constexpr, HDP: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL_MASK: tl.constexpr, KV_DESC: tl.constexpr, DOT_PREC: tl.constexpr):
    """One online-softmax step over keys n0 .. n0+BLOCK_N-1 (exp2 domain, fp32; the scale is
    applied inside the exponent's FMA). Blocks before the diagonal are fully visible and in
    range: they load without any mask. k_src / v_src: the caches' tensor descriptors over
    [Hkv * max_ctx, HD] (KV_DESC) or their pointers."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, HDP)
    if KV_DESC:
        # columns past HD and rows past the cache come back as zeros; rows past kv_len inside
        # the cache hold whatever was there (NaN in the tests): masked below
        k = k_src.load([(kv_base + n0).to(tl.int32), 0])
        v = v_src.load([(kv_base + n0).to(tl.int32), 0])
        if CAUSAL_MASK:
            # their p is 0, but 0 * NaN is not
            v = tl.where((offs_n < kv_len)[:, None], v, 0.0)
    else:
        kv_ptrs = (kv_base + offs_n.to(tl.int64))[:, None] * HD + cols[None, :]
        if CAUSAL_MASK:
            kv_mask = (offs_n < kv_len)[:, None] & (cols < HD)[None, :]
            k = tl.load(k_src + kv_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_src + kv_ptrs, mask=kv_mask, other=0.0)
        elif HD == HDP:
            k = tl.load(k_src + kv_ptrs)
            v = tl.load(v_src + kv_ptrs)
        else:
            kv_mask = (cols < HD)[None, :]
            k = tl.load(k_src + kv_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_src + kv_ptrs, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if CAUSAL_MASK:
        visible = (offs_n[None, :] <= pos[:, None]) & (offs_n < kv_len)[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row with no visible key so far keeps m = -inf; shift by 0 so exp2 gives 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
    else:
        # every key is visible: m_new is finite, no guard needed
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        m_safe = m_new
        p = tl.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _attention_prefill_kernel(qg_ptr, q_norm_w_ptr, cos_ptr, sin_ptr, k_src, v_src,
                              out_ptr, T, start_pos, max_ctx, stride_qg, stride_o, qk_scale, eps,
                              GROUP: tl.constexpr, GROUP_P: tl.constexpr, TOK: tl.constexpr,
                              HD: tl.constexpr, HDP: tl.constexpr, ROT: tl.constexpr,
                              BLOCK_N: tl.constexpr, PRO_ROWS: tl.constexpr,
                              KV_DESC: tl.constexpr, WARP_SPEC: tl.constexpr,
                              DOT_PREC: tl.constexpr, START_PTR: tl.constexpr = False,
                              PDL: tl.constexpr = 0):
    # One program = TOK query tokens x all GROUP query heads of one KV head, stacked as the
    # BLOCK_M = TOK * GROUP_P rows of one Q tile (row r: token r // GROUP_P, head r % GROUP_P),
    # so every K/V tile is loaded once for the whole group and all rows share one causal edge.
    pdl_start(PDL)
    kvh = tl.program_id(0)
    # the heaviest query blocks (most keys) start first: the causal tail wave is short
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    BLOCK_M: tl.constexpr = TOK * GROUP_P
    r = tl.arange(0, BLOCK_M)
    tok = pid_m * TOK + r // GROUP_P
    head = kvh * GROUP + r % GROUP_P
    row_mask = (tok < T) & (r % GROUP_P < GROUP)
    cols = tl.arange(0, HDP)
    col_mask = (cols < HD)[None, :]
    q_off = tok.to(tl.int64) * stride_qg + head * (2 * HD)
    o_off = tok.to(tl.int64) * stride_o + head * HD
    if PDL != 0:
        prefetch_l2(q_norm_w_ptr + tl.minimum(cols, HD - 1))
    pdl_wait(PDL)
    s0 = _start(start_pos, START_PTR)
    pos = s0 + tok

    # Prologue, PRO_ROWS rows at a time: normalise + rotate the queries and park them in this
    # program's own rows of `out` (overwritten by the epilogue). A whole-tile prologue keeps
    # several fp32 copies of [BLOCK_M, HD] live and spills at BLOCK_M x 256.
    for c0 in range(0, BLOCK_M, PRO_ROWS):
        rc = c0 + tl.arange(0, PRO_ROWS)
        tok_c = pid_m * TOK + rc // GROUP_P
        head_c = kvh * GROUP + rc % GROUP_P
        mask_c = (tok_c < T) & (rc % GROUP_P < GROUP)
        tab = tok_c.to(tl.int64)[:, None] * (ROT // 2) + (cols % (ROT // 2))[None, :]
        tab_mask = mask_c[:, None] & (cols < ROT)[None, :]
        cos = tl.load(cos_ptr + tab, mask=tab_mask, other=0.0)
        sin = tl.load(sin_ptr + tab, mask=tab_mask, other=0.0)
        qc = _norm_rope_tile(qg_ptr, tok_c.to(tl.int64) * stride_qg + head_c * (2 * HD), mask_c,
                             cos, sin, q_norm_w_ptr, eps, HD, HDP, ROT)
        tl.store(out_ptr + (tok_c.to(tl.int64) * stride_o + head_c * HD)[:, None] + cols[None, :],
                 qc, mask=mask_c[:, None] & col_mask)
    tl.debug_barrier()                        # the parked rows were written by other threads
    # the normalised, rotated Q tile: loaded once, kept for the whole key loop
    q = tl.load(out_ptr + o_off[:, None] + cols[None, :], mask=row_mask[:, None] & col_mask,
                other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HDP), dtype=tl.float32)
    kv_base = kvh.to(tl.int64) * max_ctx
    kv_len = s0 + T
    # keys before the block's first position are visible to every row: no mask needed
    first_pos = s0 + pid_m * TOK
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    for n0 in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPEC):
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_src, v_src, kv_base, n0, kv_len, pos,
                                      qk_scale, HD, HDP, BLOCK_N, False, KV_DESC, DOT_PREC)
    # the diagonal: blocks holding the group's own positions (keys past them are skipped)
    diag_end = tl.minimum(first_pos + TOK, kv_len)
    for n0 in range(full_end, diag_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_src, v_src, kv_base, n0, kv_len, pos,
                                      qk_scale, HD, HDP, BLOCK_N, True, KV_DESC, DOT_PREC)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    dtype = out_ptr.dtype.element_ty
    o = (acc / l_i[:, None]).to(dtype).to(tl.float32)
    m = row_mask[:, None] & col_mask
    gate = tl.load(qg_ptr + (q_off + HD)[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    y = o * tl.sigmoid(gate).to(dtype).to(tl.float32)
    tl.store(out_ptr + o_off[:, None] + cols[None, :], y.to(dtype), mask=m)


@functools.lru_cache(maxsize=16)
def _inv_freq(rotary_dim: int, rope_theta: float, device: torch.device) -> torch.Tensor:
    """theta^(-2j/rotary_dim) in fp32, built the way HF builds it (so angles match bit for bit)."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return (1.0 / (rope_theta ** exps)).to(device)


ATTN_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "KV_LOAD", "LOOP")


def attention_kernel_name(H: int, Hkv: int, hd: int) -> str:
    return f"flash_attention_H{H}_KV{Hkv}_D{hd}"


def _attention_config(T: int, head_dim_pad: int, group_pad: int) -> dict:
    """Static tiles. BLOCK_M counts the stacked rows (query tokens x the padded head group).
    The fp32 accumulator is BLOCK_M x head_dim: at a 256-wide head, 128 rows over 8 warps (two
    warpgroups of 64 rows, as FlashAttention-3 splits them) take 128 registers a thread, and
    with the K/V tiles fetched by the copy engine (no address registers) 64-key tiles fit
    beside them. Prompts under 1024 tokens take 32-row tiles on 4 warps, so that the few
    tokens still spread over many programs (and are not mostly padding)."""
    if T >= 1024:
        cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
    else:
        cfg = dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2)
    cfg.update(KV_LOAD=KV_TMA, LOOP=LOOP_PLAIN)
    rows = max(16, next_pow2(T) * group_pad)
    cfg["BLOCK_M"] = max(min(cfg["BLOCK_M"], rows), group_pad)
    return cfg


def _kv_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int, hdp: int):
    """Tensor descriptors of the two caches viewed as [Hkv * max_ctx, hd] with [block_n, hdp]
    tiles, or None where they cannot serve: a Triton without them, a GPU older than sm_90, rows
    not 16-byte aligned. Under the interpreter they run as indexed loads (the same semantics:
    zeros outside the tensor)."""
    if TensorDescriptor is None:
        return None
    dev = k_cache.device
    if not (interpreting() or _sm90_plus(dev.type, dev.index)):
        return None
    hkv, max_ctx, hd = k_cache.shape
    if (hd * k_cache.element_size()) % 16 or k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        return None
    shape, strides, block = [hkv * max_ctx, hd], [hd, 1], [block_n, hdp]
    return (TensorDescriptor(k_cache, shape, strides, block),
            TensorDescriptor(v_cache, shape, strides, block))


def attention_prefill(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, start_pos,
                      out: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int,
                      rotary_dim: int, rope_theta: float, eps: float,
                      config: Optional[dict] = None,
                      table: Optional[str] = TUNING_PATH, pdl: int = 0) -> torch.Tensor:
    """Gated attention for T new tokens at positions start_pos.. (see module docstring).
    start_pos: an int, or a device int32 [1] the kernels read (for a captured prefill graph).

    qg [T, H*2*hd] (per-head [query | gate]), k, v [T, Hkv*hd] (rows may be strided views),
    q_norm_w, k_norm_w [hd], k_cache, v_cache [Hkv, max_ctx, hd] contiguous (written at the new
    positions), out [T, H*hd] (allocated by the caller). Returns out. `config` (ATTN_KEYS)
    overrides the tile table of the attention pass (BLOCK_M = rows of the stacked Q tile =
    query tokens x next_power_of_2(H / Hkv); KV_LOAD: KV_POINTERS or KV_TMA; LOOP: LOOP_PLAIN
    or LOOP_WARP_SPEC; keys left out keep the built-in choice): the tuner sweeps through it. `table`: the tile
    table file (gemm.TUNING_PATH; None: the built-in tiles only). `pdl`: see _common.pdl_mode
    (both launches).
    """
    pdl = check_pdl(pdl, "attention_prefill")
    H, Hkv, hd = num_heads, num_kv_heads, head_dim
    if min(H, Hkv, hd) <= 0 or H % Hkv:
        raise ValueError("num_heads must be a positive multiple of num_kv_heads")
    if rotary_dim % 2 or not 0 < rotary_dim <= hd:
        raise ValueError("rotary_dim must be even and within head_dim")
    if qg.dim() != 2:
        raise ValueError("qg must be [T, num_heads*2*head_dim]")
    T = qg.shape[0]
    dt = qg.dtype
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"attention_prefill supports {FLOAT_DTYPES}, got {dt}")
    _check_rows("qg", qg, T, H * 2 * hd, dt)
    _check_rows("k", k, T, Hkv * hd, dt)
    _check_rows("v", v, T, Hkv * hd, dt)
    _check_rows("out", out, T, H * hd, dt)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 3 or c.shape[0] != Hkv or c.shape[2] != hd or not c.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{Hkv}, max_ctx, {hd}]")
        if c.dtype != dt:
            raise TypeError(f"{name} must be {dt}")
    for name, w in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)):
        if w.dim() != 1 or w.shape[0] != hd or not w.is_contiguous():
            raise ValueError(f"{name} must be a contiguous vector of {hd}")
    max_ctx = k_cache.shape[1]
    if v_cache.shape[1] != max_ctx:
        raise ValueError("k_cache and v_cache must have the same max_ctx")
    start_ptr = isinstance(start_pos, torch.Tensor)
    if start_ptr:
        # a device int32 [1] read by the kernels (a CUDA graph replays with any start): the
        # caller guarantees start + T <= max_ctx
        if start_pos.dtype != torch.int32 or start_pos.numel() != 1 or start_pos.device != qg.device:
            raise ValueError("a device start_pos must be one int32 on the activations' device")
    else:
        start_pos = int(start_pos)
        if start_pos < 0 or start_pos + T > max_ctx:
            raise ValueError(f"positions {start_pos}..{start_pos + T - 1} exceed the cache ({max_ctx})")
    if T == 0:
        return out

    hdp = max(16, next_pow2(hd))
    group = H // Hkv
    group_p = next_pow2(group)
    inv_freq = _inv_freq(rotary_dim, float(rope_theta), qg.device)
    # cos/sin of the new positions, rounded to the dtype: written by the K/V pass, read by the
    # query pass (one table for every head)
    cos_tab = torch.empty(T, rotary_dim // 2, dtype=dt, device=qg.device)
    sin_tab = torch.empty_like(cos_tab)
    # the norm + rope tile keeps ~6 fp32 copies of [BLOCK_T, head_dim] live: 16 x 256 fits
    block_t = min(max(16, 4096 // hdp), max(16, next_pow2(T)))
    _kv_cache_write_kernel[(cdiv(T, block_t), Hkv)](
        k, v, k_norm_w, inv_freq, k_cache, v_cache, cos_tab, sin_tab, T, start_pos, max_ctx,
        k.stride(0), v.stride(0), eps, HD=hd, HDP=hdp, ROT=rotary_dim, BLOCK_T=block_t,
        START_PTR=start_ptr, PDL=pdl, num_warps=4, **launch_kw(pdl))
    if config is not None:
        # an explicit config may leave the Hopper knobs out: they keep the built-in choice
        cfg = dict(_attention_config(T, hdp, group_p), **config)
    else:
        cfg = (tuned_config(attention_kernel_name(H, Hkv, hd), T, ATTN_KEYS, table)
               or _attention_config(T, hdp, group_p))
    block_m = cfg["BLOCK_M"]
    if block_m < 16 or block_m & (block_m - 1) or block_m < group_p:
        raise ValueError(f"BLOCK_M must be a power of two >= max(16, {group_p}), got {block_m}")
    if cfg["KV_LOAD"] not in (KV_POINTERS, KV_TMA) or cfg["LOOP"] not in (LOOP_PLAIN, LOOP_WARP_SPEC):
        raise ValueError(f"KV_LOAD must be {KV_POINTERS} or {KV_TMA} and LOOP "
                         f"{LOOP_PLAIN} or {LOOP_WARP_SPEC}, got {cfg['KV_LOAD']}, {cfg['LOOP']}")
    tok = block_m // group_p                  # query tokens per program
    qk_scale = hd ** -0.5 * _LOG2E                        # softmax in the exp2 domain
    descs = _kv_descriptors(k_cache, v_cache, cfg["BLOCK_N"], hdp) \
        if cfg["KV_LOAD"] == KV_TMA else None
    k_src, v_src = descs or (k_cache, v_cache)
    _attention_prefill_kernel[(Hkv, cdiv(T, tok))](
        qg, q_norm_w, cos_tab, sin_tab, k_src, v_src, out, T, start_pos, max_ctx,
        qg.stride(0), out.stride(0), qk_scale, eps,
        GROUP=group, GROUP_P=group_p, TOK=tok, HD=hd, HDP=hdp, ROT=rotary_dim,
        BLOCK_N=cfg["BLOCK_N"], PRO_ROWS=min(block_m, _PROLOGUE_ROWS), KV_DESC=descs is not None,
        WARP_SPEC=cfg["LOOP"] == LOOP_WARP_SPEC,
        DOT_PREC=dot_precision(dt), START_PTR=start_ptr, PDL=pdl, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **launch_kw(pdl))
    return out
