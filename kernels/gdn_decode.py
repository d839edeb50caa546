"""Gated DeltaNet decode: the delta-rule recurrence of one token (spec sections 6 and 8).

The layer's other operators are fused into the GEMVs around it (kernels/gemv.py): the causal
conv update + SiLU into the in_proj's epilogue, the gated RMSNorm into the out_proj's
prologue. What is left here, per value head h (key head h // (Hv/Hk)):

    norms   q = q / sqrt(|q|^2 + 1e-6) * dk^-0.5;  k = k / sqrt(|k|^2 + 1e-6)      fp32
    gates   beta = round(sigmoid(b));  g = -exp(A_log) * softplus(a + dt_bias)   (threshold 20)
    delta   S = exp(g) S;  r = S^T k;  d = beta (v - r);  S += k d^T;  o = S^T q    fp32 state
    output  o = round(o)

`round` is a rounding to the activation dtype, placed where HF rounds, so a prefill that
follows HF hands over to this kernel without a seam. dk and dv are compile-time constants (one
compile per model), so exact head sizes drop every mask.

PyTorch reference: kernels/reference.py, section "gdn_decode": gdn_decode_ref (gdn_mixer_ref: the whole GDN layer's token step).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, cdiv, check_pdl, decode_table, launch_kw, next_pow2, pdl_start,
                      pdl_wait)

L2NORM_EPS = 1e-6          # HF l2norm: inside the sqrt, added to the sum of squares
SOFTPLUS_THRESHOLD = 20.0  # softplus(x) = x above this, as torch.nn.functional.softplus


@triton.jit
def _softplus(x, THRESHOLD: tl.constexpr):
    # log1p(e^x) with the (1+u)-1 correction, so tiny e^x keep their precision
    u = tl.exp(tl.minimum(x, THRESHOLD))
    one_u = 1.0 + u
    tiny = one_u == 1.0
    lp = tl.where(tiny, u, tl.log(one_u) * (u / tl.where(tiny, 1.0, one_u - 1.0)))
    return tl.where(x > THRESHOLD, x, lp)


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError("gdn_decode: " + msg)


# ------------------------------------------------------------------------------------------
# the recurrence, split over value tiles
# ------------------------------------------------------------------------------------------
#
#   proj = [x = conv output q|k|v (conv_dim) | z (Hv*dv) | b (Hv) | a (Hv)]
#   program (h, t): value head h, value columns t*BLOCK_V .. +BLOCK_V, key head h // (Hv/Hk)
#     q = l2norm(q) * dk^-0.5;  k = l2norm(k)                      fp32 (every tile recomputes
#                                                                   its head's norms: 2 x dk)
#     beta = round(sigmoid(b));  g = -exp(A_log) softplus(a + dt_bias)
#     S = exp(g) S[:, tile];  r = S^T k;  S += k (beta (v - r))^T;  o = S^T q
#   The delta rule is column-separable: the columns of S never mix, so tiles are independent
#   and the grid grows from Hk programs to Hv * dv / BLOCK_V (16 -> 128 at BLOCK_V = 16).
#
#   The engine also hands this launch the z projection (proj is then [x | b | a]): z is read
#   only by the out_proj after it, and its rows need only the layer input, which is final
#   before the in_proj starts. So its programs (first in the grid) stream W_z without any wait
#   while the in_proj drains and the recurrence tiles wait for it.

@triton.jit
def _delta_rule(S, q, k, v, b, a, dt_b, a_log, q_scale, act, L2_EPS: tl.constexpr,
                SP_THRESHOLD: tl.constexpr):
    """One token of the gated delta rule on a [DK, BLOCK_V] tile S of the fp32 state, from the
    raw q, k [DK] and v [BLOCK_V] (fp32), b and a (beta and decay inputs), dt_bias and A_log:
    (S updated, o). Every reduction reads only the loaded values, so they are independent (one
    round of cross-warp reductions instead of three in a row: the l2 norms, then S^T k, then
    S^T q of the updated state). With g = exp(g_log), rk = 1/|k|, rq = scale/|q| (scalars):
      S_new = g S + (rk k) delta^T,  delta = beta (v - g rk S^T k)
      o = S_new^T (rq q) = g rq S^T q + delta (rk rq k.q)"""
    rq = tl.rsqrt(tl.sum(q * q, axis=0) + L2_EPS) * q_scale
    rk = tl.rsqrt(tl.sum(k * k, axis=0) + L2_EPS)
    qk = tl.sum(q * k, axis=0)
    sk = tl.sum(S * k[:, None], axis=0)                   # S^T k, S^T q of the old state
    sq = tl.sum(S * q[:, None], axis=0)
    beta = tl.sigmoid(b).to(act).to(tl.float32)
    g = tl.exp(-tl.exp(a_log) * _softplus(a + dt_b, SP_THRESHOLD))
    delta = beta * (v - (g * rk) * sk)
    S = S * g + (k * rk)[:, None] * delta[None, :]
    o = (g * rq) * sq + delta * (rk * rq * qk)
    return S, o


@triton.jit
def _gdn_decode_tile(proj_ptr, A_log_ptr, dt_bias_ptr, state_ptr, o_ptr, q_scale, cpid,
                   HK, HV, BA_OFF, DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                   L2_EPS: tl.constexpr, SP_THRESHOLD: tl.constexpr, PDL: tl.constexpr):
    h = cpid % HV                  # value heads fastest: the order of the former (Hv, tiles) grid
    tile = cpid // HV
    hk = h // GROUP
    act = proj_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < DK
    mv = offs_v < DV
    key_dim = HK * DK

    # The recurrent state is this kernel's own (last written by the previous token's launch).
    # With PDL mode 1 (the previous kernel let this one launch only after its own wait) that
    # launch is complete, so the tile is loaded before waiting for the producer of proj. Mode 2
    # lets launches run ahead by more than one kernel, so the state is read after the wait.
    s_ptrs = (state_ptr + h.to(tl.int64) * DK * DV + offs_k.to(tl.int64)[:, None] * DV
              + offs_v[None, :])
    s_mask = mk[:, None] & mv[None, :]
    if PDL == 2:
        pdl_wait(PDL)
    S = tl.load(s_ptrs, mask=s_mask, other=0.0)
    dt_b = tl.load(dt_bias_ptr + h).to(tl.float32)          # parameters: no kernel writes them
    a_log = tl.load(A_log_ptr + h).to(tl.float32)
    if PDL != 2:
        pdl_wait(PDL)

    # every load of the producer's output issued before the first value that waits on one
    q = tl.load(proj_ptr + hk * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(proj_ptr + key_dim + hk * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(proj_ptr + 2 * key_dim + h * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
    b = tl.load(proj_ptr + BA_OFF + h).to(tl.float32)
    a = tl.load(proj_ptr + BA_OFF + HV + h).to(tl.float32)
    S, o = _delta_rule(S, q, k, v, b, a, dt_b, a_log, q_scale, act, L2_EPS, SP_THRESHOLD)
    tl.store(s_ptrs, S, mask=s_mask)
    tl.store(o_ptr + h * DV + offs_v, o.to(o_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _z_rows(zw_ptr, zx_ptr, znw_ptr, z_ptr, eps, zp, Z_ROWS: tl.constexpr, ZK: tl.constexpr,
            BLOCK_ZN: tl.constexpr, BLOCK_ZK: tl.constexpr, PDL: tl.constexpr):
    """z[rows] = W_z[rows] @ round(x * rsqrt(mean(x^2) + eps) * (1 + w)) (the in_proj's RMSNorm
    prologue, rounded the same way), for the BLOCK_ZN rows of program zp, whole rows at once.
    x is the layer input: its writer is the kernel before the in_proj, which had completed when
    the in_proj's programs passed their PDL wait and let this launch start (mode 1), so no wait
    is needed (mode 2 lets launches run further ahead: wait first)."""
    rows = zp * BLOCK_ZN + tl.arange(0, BLOCK_ZN)
    ks = tl.arange(0, BLOCK_ZK)
    rm = rows < Z_ROWS
    km = ks < ZK
    w = tl.load(zw_ptr + rows.to(tl.int64)[:, None] * ZK + ks[None, :],
                mask=rm[:, None] & km[None, :], other=0.0, eviction_policy="evict_first")
    nw = tl.load(znw_ptr + ks, mask=km, other=0.0)
    if PDL == 2:
        pdl_wait(PDL)
    v = tl.load(zx_ptr + ks, mask=km, other=0.0)
    xf = v.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / ZK + eps)
    x = (xf * inv_rms * (1.0 + nw.to(tl.float32))).to(v.dtype).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(z_ptr + rows, acc.to(z_ptr.dtype.element_ty), mask=rm)


@triton.jit
def _gdn_decode_kernel(proj_ptr, A_log_ptr, dt_bias_ptr, state_ptr, o_ptr, q_scale,
                     zw_ptr, zx_ptr, znw_ptr, z_ptr, z_eps,
                     HK, HV, BA_OFF, N_Z, DK: tl.constexpr, DV: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                     L2_EPS: tl.constexpr, SP_THRESHOLD: tl.constexpr, PDL: tl.constexpr,
                     Z_ROWS: tl.constexpr, ZK: tl.constexpr, BLOCK_ZN: tl.constexpr,
                     BLOCK_ZK: tl.constexpr, Z_FIRST: tl.constexpr):
    # Z_ROWS > 0: N_Z programs of the z GEMV, first in the grid (Z_FIRST) or last; the others
    # are the (value head, value tile) programs of the recurrence
    pdl_start(PDL)
    pid = tl.program_id(0)
    if Z_ROWS > 0:
        if Z_FIRST:
            zp = pid
            cpid = pid - N_Z
        else:
            cpid = pid
            zp = pid - (tl.num_programs(0) - N_Z)
        if zp >= 0 and zp < N_Z:
            _z_rows(zw_ptr, zx_ptr, znw_ptr, z_ptr, z_eps, zp, Z_ROWS, ZK, BLOCK_ZN, BLOCK_ZK,
                    PDL)
        else:
            _gdn_decode_tile(proj_ptr, A_log_ptr, dt_bias_ptr, state_ptr, o_ptr, q_scale, cpid,
                           HK, HV, BA_OFF, DK, DV, GROUP, BLOCK_K, BLOCK_V, L2_EPS, SP_THRESHOLD,
                           PDL)
    else:
        _gdn_decode_tile(proj_ptr, A_log_ptr, dt_bias_ptr, state_ptr, o_ptr, q_scale, pid,
                       HK, HV, BA_OFF, DK, DV, GROUP, BLOCK_K, BLOCK_V, L2_EPS, SP_THRESHOLD, PDL)


def default_block_v(head_v_dim: int, num_v_heads: int, target_programs: int = 128) -> int:
    """Default BLOCK_V: about target_programs programs, tiles of 16..next_pow2(dv) columns
    (decode_tuning.json overrides it)."""
    full = next_pow2(int(head_v_dim))
    tiles = next_pow2(max(1, cdiv(target_programs, int(num_v_heads))))
    return min(full, max(16, full // tiles))


def _plan(hv: int, dk: int, dv: int) -> tuple[int, int, int, bool]:
    """(block_v, num_warps, z_block_n, z_first) from the decode table, else the defaults."""
    e = decode_table().get(f"gdn_core:{hv}x{dk}x{dv}")
    bv = next_pow2(dv)
    z_bn, z_first = 2, True          # measured best in the 0.8B step (decode_tuning.json)
    if e is not None:
        try:
            zb = int(e.get("z_block_n", z_bn))
            if zb >= 1 and zb & (zb - 1) == 0:
                z_bn = zb
            z_first = bool(e.get("z_first", True))
            return min(int(e["block_v"]), bv), int(e["num_warps"]), z_bn, z_first
        except (KeyError, TypeError, ValueError, AttributeError):
            pass
    block_v = default_block_v(dv, hv)
    return block_v, max(1, min(8, next_pow2(dk) * block_v // 512)), z_bn, z_first


def gdn_decode(proj: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    state: torch.Tensor, o_out: torch.Tensor, *, num_k_heads: int,
                    num_v_heads: int, head_k_dim: int, head_v_dim: int,
                    block_v: int | None = None, num_warps: int | None = None,
                    z_weight: torch.Tensor | None = None, z_x: torch.Tensor | None = None,
                    z_norm_w: torch.Tensor | None = None, z_out: torch.Tensor | None = None,
                    z_eps: float = 1e-6, z_block_n: int | None = None,
                    z_first: bool | None = None, pdl: int = 0) -> torch.Tensor:
    """The delta-rule step of one GDN token on the fused in_proj output.

    proj [conv_dim + Hv*dv + 2*Hv] = [conv output q|k|v | z | b | a] (what gemv with the
    conv epilogue writes), A_log, dt_bias [Hv], state float32 [Hv, dk, dv] (updated in place),
    o_out [Hv*dv] (the core output, rounded to o_out.dtype; the gated norm is the out_proj
    prologue's). Returns o_out.

    With z_weight [Hv*dv, K] (in_proj_z), z_x [K] (the layer input), z_norm_w [K] (the input
    RMSNorm's weight) and z_out [Hv*dv], the same launch also computes
    z = z_weight @ rmsnorm(z_x) in programs of its own, and proj is [q|k|v | b | a]: z is not
    needed before the out_proj and its programs need nothing from the in_proj, so its weights
    stream while the in_proj drains and the recurrence waits (the in_proj reads a quarter fewer
    bytes). Grid: cdiv(Hv*dv, z_block_n) z programs and Hv * cdiv(dv, block_v) recurrence
    tiles, the z programs first unless z_first is False (both from the decode table). `pdl`:
    see _common.pdl_mode."""
    hk, hv, dk, dv = int(num_k_heads), int(num_v_heads), int(head_k_dim), int(head_v_dim)
    pdl = check_pdl(pdl, "gdn_decode")
    _expect(hk >= 1 and hv >= hk and hv % hk == 0,
            f"num_v_heads ({hv}) must be a multiple of num_k_heads ({hk})")
    conv_dim = 2 * hk * dk + hv * dv
    with_z = z_weight is not None
    ba_off = conv_dim if with_z else conv_dim + hv * dv
    n_proj = ba_off + 2 * hv
    _expect(proj.numel() == n_proj and proj.is_contiguous() and proj.dtype in FLOAT_DTYPES,
            f"proj must be a contiguous float vector of {n_proj}, got {tuple(proj.shape)}")
    _expect(tuple(state.shape) == (hv, dk, dv) and state.is_contiguous()
            and state.dtype == torch.float32,
            f"state must be a contiguous float32 [{hv}, {dk}, {dv}] tensor")
    _expect(A_log.numel() == hv and dt_bias.numel() == hv, f"A_log and dt_bias must hold {hv}")
    _expect(o_out.numel() == hv * dv and o_out.is_contiguous() and o_out.dtype in FLOAT_DTYPES,
            f"o_out must be a contiguous float vector of {hv * dv}")
    for t, name in ((proj, "proj"), (A_log, "A_log"), (dt_bias, "dt_bias"), (o_out, "o_out")):
        _expect(t.device == state.device, f"{name} is not on the state's device")
    zk = 0
    if with_z:
        _expect(z_x is not None and z_norm_w is not None and z_out is not None,
                "the z programs need z_weight, z_x, z_norm_w and z_out together")
        _expect(z_weight.dim() == 2 and z_weight.shape[0] == hv * dv and z_weight.is_contiguous()
                and z_weight.dtype in FLOAT_DTYPES and z_weight.device == state.device,
                f"z_weight must be a contiguous [{hv * dv}, K] float matrix on the state's device")
        zk = int(z_weight.shape[1])
        for t, name, n in ((z_x, "z_x", zk), (z_norm_w, "z_norm_w", zk), (z_out, "z_out", hv * dv)):
            _expect(t.numel() == n and t.is_contiguous() and t.dtype in FLOAT_DTYPES
                    and t.device == state.device,
                    f"{name} must be a contiguous float vector of {n} on the state's device")
    else:
        _expect(z_x is None and z_norm_w is None and z_out is None,
                "z_x, z_norm_w and z_out need z_weight")
    bv_plan, nw_plan, zbn_plan, zf_plan = _plan(hv, dk, dv)
    block_v = int(block_v or bv_plan)
    num_warps = int(num_warps or nw_plan)
    z_block_n = int(z_block_n or zbn_plan)
    z_first = zf_plan if z_first is None else bool(z_first)
    _expect(block_v >= 1 and block_v & (block_v - 1) == 0, "block_v must be a power of 2")
    _expect(z_block_n >= 1 and z_block_n & (z_block_n - 1) == 0, "z_block_n must be a power of 2")
    n_core = hv * cdiv(dv, block_v)
    n_z = cdiv(hv * dv, z_block_n) if with_z else 0
    zt = (z_weight, z_x, z_norm_w, z_out) if with_z else (proj,) * 4   # unused without z
    _gdn_decode_kernel[(n_z + n_core,)](
        proj, A_log, dt_bias, state, o_out, float(dk) ** -0.5, *zt, float(z_eps), hk, hv,
        ba_off, n_z, DK=dk, DV=dv, GROUP=hv // hk, BLOCK_K=next_pow2(dk), BLOCK_V=block_v,
        L2_EPS=L2NORM_EPS, SP_THRESHOLD=SOFTPLUS_THRESHOLD, PDL=pdl,
        Z_ROWS=hv * dv if with_z else 0, ZK=zk, BLOCK_ZN=z_block_n,
        BLOCK_ZK=next_pow2(zk) if with_z else 1, Z_FIRST=z_first,
        num_warps=num_warps, **launch_kw(pdl))
    return o_out
