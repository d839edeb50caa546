"""Fused decode kernels (v2) against the unfused reference sequence: the GEMV norm prologues
(zero-centred RMSNorm, gated RMSNorm per head), the conv / SiLU*mul / residual epilogues, the
in-kernel split-K reduce, the split GDN core, the LM head with the final norm fused, a whole GDN
mixer step (fused path vs the old one), PDL staying off under the interpreter, and an offline
sm_90 compile with PDL on."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tritonchat.kernels import _common
from tritonchat.kernels._common import launch_kw, pdl_mode
from tritonchat.kernels import gemv as gemv_mod
from tritonchat.kernels.gdn_decode import gdn_decode
from tritonchat.kernels.gemv import gemv, scratch_numel
from tritonchat.kernels.reference import (gdn_decode_ref, gdn_mixer_ref, gemv_ref,
                                          matvec_ref, lm_head_argmax_ref, rms_norm_ref)
from tritonchat.kernels.sampling import lm_head_argmax, lm_head_partials_numel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# bf16 only on the GPU: the interpreter rounds fp32 -> bf16 toward zero where the reference
# (and the GPU) round to nearest even, and the fused kernels round at several points.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _tol(dtype):
    # fp32: summation-order noise. half: an fp32 value may round one ulp apart at a rounding
    # point (norm output, conv, SiLU), which the GEMV then carries into the output.
    return {torch.float32: dict(rtol=2e-5, atol=2e-5),
            torch.float16: dict(rtol=4e-3, atol=4e-3),
            torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}[dtype]


def _scratch(n_out, split_k, block_n, silu_mul=False):
    """NaN-filled partials (a stale read would show) and zeroed counters."""
    n_p, n_c = scratch_numel(n_out, dict(split_k=split_k, block_n=block_n), silu_mul)
    return (torch.full((max(n_p, 1) + 3,), float("nan"), device=DEVICE),
            torch.zeros(max(n_c, 1) + 3, device=DEVICE, dtype=torch.int32))


def _vec(n, g, scale=1.0, dtype=torch.float32):
    return (torch.randn(n, generator=g) * scale).to(DEVICE, dtype)


def _epilogue_case(epilogue, n_out, g, dtype, conv_channels):
    """(out, launcher kwargs, reference kwargs) for one GEMV epilogue: `out` is NaN-filled (or
    the residual itself for residual_inplace); the conv case holds a state of 3 inputs for the
    first `conv_channels` rows."""
    kw, ref_kw = {}, {}
    if epilogue == "residual_inplace":
        res = _vec(n_out, g, 1.0, dtype)
        out = res.clone()
        kw, ref_kw = dict(residual=out), dict(residual=res)
    else:
        out = torch.full((n_out,), float("nan"), device=DEVICE, dtype=dtype)
    if epilogue == "silu_mul":
        kw, ref_kw = dict(silu_mul=True), dict(silu_mul=True)
    if epilogue == "conv":
        C, kwid = conv_channels, 4
        conv_w = _vec(C * kwid, g, 0.5, dtype).view(C, kwid)
        conv_state = _vec(C * (kwid - 1), g, 1.0, dtype).view(C, kwid - 1)
        ref_kw = dict(conv_state=conv_state.clone(), conv_w=conv_w)
        kw = dict(conv_state=conv_state, conv_w=conv_w)
    return out, kw, ref_kw


# ------------------------------------------------------------------------------------------
# GEMV with the zero-centred RMSNorm prologue
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("epilogue", ["plain", "residual_inplace", "silu_mul", "conv"])
def test_gemv_rms_norm_prologue_epilogues(epilogue, split_k, dtype):
    # 74 rows (37 after SiLU*mul) x K = 200: neither is a multiple of the 8 x 32 tile; the
    # conv epilogue covers 45 channels, so one row block holds conv and plain rows
    g = torch.Generator().manual_seed(split_k * 10 + len(epilogue))
    n_rows, K, block_n = 74, 200, 8
    h = _vec(K, g, 3.0, dtype)
    norm_w = _vec(K, g, 0.2, dtype)
    W = _vec(n_rows * K, g, K ** -0.5, dtype).view(n_rows, K)
    silu = epilogue == "silu_mul"
    n_out = n_rows // 2 if silu else n_rows
    out, kw, ref_kw = _epilogue_case(epilogue, n_out, g, dtype, conv_channels=45)
    if epilogue == "conv":
        kw["conv_w"] = kw["conv_w"].unsqueeze(1)                    # nn.Conv1d layout too
    conv_state = kw.get("conv_state")
    want, want_state = gemv_ref(h, W, norm_w=norm_w, eps=EPS, out_dtype=dtype, **ref_kw)
    part, cnt = _scratch(n_out, split_k, block_n, silu)
    gemv(h, W, out, norm_w=norm_w, eps=EPS, split_k=split_k, partials=part, counters=cnt,
                 block_n=block_n, block_k=32, num_warps=4, **kw)
    torch.testing.assert_close(out, want, **_tol(dtype))
    if epilogue == "conv":
        # the state holds the projection outputs (rounded) of the conv rows
        torch.testing.assert_close(conv_state, want_state, **_tol(dtype))
        assert torch.equal(conv_state[:, :-1], ref_kw["conv_state"][:, 1:])
    assert not cnt.any(), "split-K counters must be left at zero for the next launch"


@pytest.mark.parametrize("n_rows,K,block_n,block_k,split_k", [
    (1, 16, 1, 16, 1),         # a single row
    (5, 17, 4, 16, 2),         # K one past the tile, two splits of uneven length
    (64, 128, 16, 64, 2),      # exact tiling: the unmasked path
    (33, 48, 32, 128, 1),      # tile wider than K
    (130, 80, 64, 16, 4),      # many K steps, four splits
    (24, 96, 8, 16, 8),        # split_k > K blocks / 2: splits of one tile
    (6, 1100, 4, 256, 2),      # K past the one-block norm (1024): the looped norm, split
])
def test_gemv_fused_shapes(n_rows, K, block_n, block_k, split_k):
    g = torch.Generator().manual_seed(n_rows + K)
    h = _vec(K, g)
    norm_w = _vec(K, g, 0.2)
    W = _vec(n_rows * K, g, K ** -0.5).view(n_rows, K)
    for nw in (None, norm_w):
        out = torch.full((n_rows,), float("nan"), device=DEVICE)
        part, cnt = _scratch(n_rows, split_k, block_n)
        gemv(h, W, out, norm_w=nw, eps=EPS, split_k=split_k, partials=part, counters=cnt,
                   block_n=block_n, block_k=block_k)
        want, _ = gemv_ref(h, W, norm_w=nw, eps=EPS)
        torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
        assert not cnt.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_rows,K,block_n", [
    (74, 200, 8),      # 10 row blocks over 4 programs (the interpreter's "SMs"), K masked
    (1, 16, 1),        # one row, one program
    (64, 256, 4),      # 16 blocks: each program takes 4, no masks
    (33, 48, 32),      # one partial block
])
@pytest.mark.parametrize("epilogue", ["plain", "residual_inplace", "silu_mul", "conv"])
def test_gemv_fused_persistent_form(epilogue, n_rows, K, block_n, dtype):
    """The persistent direct form (programs striding over row blocks, one tile of look-ahead)
    equals the reference for every epilogue, with and without the RMSNorm prologue."""
    if epilogue == "silu_mul" and n_rows % 2:
        n_rows += 1
    g = torch.Generator().manual_seed(n_rows * 7 + K + len(epilogue))
    h = _vec(K, g, 3.0, dtype)
    norm_w = _vec(K, g, 0.2, dtype)
    W = _vec(n_rows * K, g, K ** -0.5, dtype).view(n_rows, K)
    silu = epilogue == "silu_mul"
    n_out = n_rows // 2 if silu else n_rows
    for nw in (norm_w, None):
        out, kw, ref_kw = _epilogue_case(epilogue, n_out, g, dtype, conv_channels=min(45, n_out))
        conv_state = kw.get("conv_state")
        want, want_state = gemv_ref(h, W, norm_w=nw, eps=EPS, out_dtype=dtype, **ref_kw)
        gemv(h, W, out, norm_w=nw, eps=EPS, split_k=1, block_n=block_n, num_warps=4,
                   persistent=1, **kw)
        torch.testing.assert_close(out, want, **_tol(dtype))
        if epilogue == "conv":
            torch.testing.assert_close(conv_state, want_state, **_tol(dtype))


def test_gemv_fused_persistent_form_refuses_what_it_cannot_do():
    g = torch.Generator().manual_seed(3)
    x, W = _vec(64, g), _vec(16 * 64, g).view(16, 64)
    out = torch.empty(16, device=DEVICE)
    with pytest.raises(ValueError, match="persistent"):
        gemv(x, W, out, split_k=2, persistent=1,
                   partials=torch.zeros(64, device=DEVICE), counters=torch.zeros(16, device=DEVICE, dtype=torch.int32))
    x3, W3 = _vec(96, g), _vec(16 * 96, g).view(16, 96)      # three heads: not a power of two
    with pytest.raises(ValueError, match="persistent"):
        gemv(x3, W3, out, norm_w=_vec(32, g), gate=_vec(96, g), head_dim=32, split_k=1,
                   block_k=32, persistent=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dv,n_out,block_n", [
    (4, 32, 37, 8),        # 5 row blocks over 4 programs, the last one partial
    (1, 16, 8, 8),         # one head, one block
    (2, 128, 64, 4),       # the 0.8B head size, 16 blocks
])
def test_gemv_gated_norm_residual_persistent_form(heads, dv, n_out, block_n, dtype):
    """The persistent form with the gated-norm prologue (the whole [heads, dv] input one tile)
    and the residual epilogue."""
    g = torch.Generator().manual_seed(heads * dv + n_out)
    K = heads * dv
    o = _vec(K, g, 2.0, dtype)
    z = _vec(K, g, 2.0, dtype)
    norm_w = (1 + 0.1 * torch.randn(dv, generator=g)).to(DEVICE)
    W = _vec(n_out * K, g, K ** -0.5, dtype).view(n_out, K)
    res = _vec(n_out, g, 1.0, dtype)
    h = res.clone()
    gemv(o, W, h, norm_w=norm_w, gate=z, head_dim=dv, eps=EPS, residual=h, split_k=1,
               block_n=block_n, num_warps=4, persistent=1)
    want, _ = gemv_ref(o, W, norm_w=norm_w, gate=z, head_dim=dv, eps=EPS, residual=res)
    torch.testing.assert_close(h, want, **_tol(dtype))


def test_gemv_fused_split_k_reproducible_and_replayable():
    # the same launch twice (as a graph replay would) gives bit-identical results, and a split
    # count that differs only in summation order stays within fp32 noise
    g = torch.Generator().manual_seed(3)
    h, norm_w = _vec(300, g), _vec(300, g, 0.2)
    W = _vec(70 * 300, g, 300 ** -0.5).view(70, 300)
    part, cnt = _scratch(70, 4, 8)
    outs = []
    for _ in range(2):
        out = torch.empty(70, device=DEVICE)
        gemv(h, W, out, norm_w=norm_w, split_k=4, partials=part, counters=cnt,
                   block_n=8, block_k=32)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    one = torch.empty(70, device=DEVICE)
    gemv(h, W, one, norm_w=norm_w, split_k=1, block_n=8, block_k=32)
    torch.testing.assert_close(outs[0], one, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# GEMV with the gated-RMSNorm prologue (GDN out_proj), residual epilogue
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dv,block_k,split_k", [
    (4, 40, 32, 1),        # non-power-of-two head: a masked second tile per head
    (4, 40, 16, 3),        # three tiles per head; 3 splits over 4 heads -> 2 splits of 2
    (3, 24, 32, 2),        # block_k wider than the head
    (4, 32, 32, 4),        # exact tiles, one head per split
    (2, 128, 64, 1),       # the 0.8B head size
])
def test_gemv_gated_norm_residual(heads, dv, block_k, split_k, dtype):
    g = torch.Generator().manual_seed(heads * dv + split_k)
    K, n_out, block_n = heads * dv, 37, 8
    o = _vec(K, g, 2.0, dtype)
    z = _vec(K, g, 2.0, dtype)
    norm_w = (1 + 0.1 * torch.randn(dv, generator=g)).to(DEVICE)          # fp32, as stored
    W = _vec(n_out * K, g, K ** -0.5, dtype).view(n_out, K)
    res = _vec(n_out, g, 1.0, dtype)
    h = res.clone()
    part, cnt = _scratch(n_out, split_k, block_n)
    gemv(o, W, h, norm_w=norm_w, gate=z, head_dim=dv, eps=EPS, residual=h,
               split_k=split_k, partials=part, counters=cnt, block_n=block_n, block_k=block_k)
    want, _ = gemv_ref(o, W, norm_w=norm_w, gate=z, head_dim=dv, eps=EPS, residual=res)
    torch.testing.assert_close(h, want, **_tol(dtype))
    assert not cnt.any()


# ------------------------------------------------------------------------------------------
# GDN core (recurrence only, split over value tiles)
# ------------------------------------------------------------------------------------------

# (num_k_heads, num_v_heads, head_k_dim, head_v_dim)
CORE_CONFIGS = [
    (2, 4, 24, 40),     # Hv = 2 Hk, dk != dv, neither a power of two
    (1, 4, 16, 8),      # Hv = 4 Hk, dv < dk
    (3, 3, 16, 16),     # no grouping, odd head count
    (2, 2, 32, 32),     # power-of-two heads: unmasked tiles
]


def _proj(hk, hv, dk, dv, dtype, g, step):
    """A fused in_proj output [conv out | z | b | a] with softplus tails exercised."""
    conv_dim = 2 * hk * dk + hv * dv
    x = torch.randn(conv_dim + hv * dv, generator=g)
    ba = torch.randn(2 * hv, generator=g) * 2
    ba[hv + step % hv] = 25.0 if step % 2 == 0 else -25.0
    return torch.cat([x, ba]).to(DEVICE, dtype)


def _core_params(cfg, dtype, g):
    """A_log, dt_bias, a recurrent state and the head-count keywords of a core launch."""
    hk, hv, dk, dv = cfg
    A_log = (torch.randn(hv, generator=g) * 0.5).to(DEVICE)
    dt_bias = torch.randn(hv, generator=g).to(DEVICE, dtype)
    state = (torch.randn(hv, dk, dv, generator=g) * 0.1).to(DEVICE)
    return A_log, dt_bias, state, dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_v", [None, 8, 16])
@pytest.mark.parametrize("cfg", CORE_CONFIGS, ids=lambda c: "hk{}hv{}dk{}dv{}".format(*c))
def test_gdn_decode_core_steps(cfg, block_v, dtype):
    hk, hv, dk, dv = cfg
    g = torch.Generator().manual_seed(hk * 100 + dv)
    A_log, dt_bias, state, kw = _core_params(cfg, dtype, g)
    for step in range(2):
        proj = _proj(hk, hv, dk, dv, dtype, g, step)
        want_o, want_state = gdn_decode_ref(proj, A_log, dt_bias, state, **kw)
        o = torch.full((hv * dv,), float("nan"), device=DEVICE, dtype=dtype)
        gdn_decode(proj, A_log, dt_bias, state, o, block_v=block_v, **kw)
        torch.testing.assert_close(state, want_state, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(o, want_o, **_tol(dtype))
        state.copy_(want_state)


def _z_case(hv, dv, K, dtype, g):
    """The z programs' operands: in_proj_z [Hv*dv, K], the layer input, the input norm weight
    and a NaN-filled z output."""
    return dict(z_weight=_vec(hv * dv * K, g, K ** -0.5, dtype).view(hv * dv, K),
                z_x=_vec(K, g, 2.0, dtype), z_norm_w=_vec(K, g, 0.2, dtype),
                z_out=torch.full((hv * dv,), float("nan"), device=DEVICE, dtype=dtype), z_eps=EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,z_block_n,z_first", [(40, None, True), (64, 4, False),
                                                  (24, 16, True), (24, 16, False)])
@pytest.mark.parametrize("cfg", CORE_CONFIGS[:3], ids=lambda c: "hk{}hv{}dk{}dv{}".format(*c))
def test_gdn_decode_core_with_z_programs(cfg, K, z_block_n, z_first, dtype):
    """The engine's launch: z = in_proj_z @ rmsnorm(x) in programs of the core's grid, proj
    without z. The recurrence is bit-equal to the launch without z programs on the old layout,
    and z matches the norm + GEMV reference (rows not a multiple of the block, K not a power of
    two, more z programs than recurrence tiles and fewer)."""
    hk, hv, dk, dv = cfg
    g = torch.Generator().manual_seed(hk * 10 + K)
    A_log, dt_bias, state, kw = _core_params(cfg, dtype, g)
    conv_dim = 2 * hk * dk + hv * dv
    for step in range(2):
        old = _proj(hk, hv, dk, dv, dtype, g, step)          # [conv out | z | b | a]
        new = torch.cat([old[:conv_dim], old[conv_dim + hv * dv:]])   # [conv out | b | a]
        z = _z_case(hv, dv, K, dtype, g)
        want_state = state.clone()
        want_o = torch.full((hv * dv,), float("nan"), device=DEVICE, dtype=dtype)
        gdn_decode(old, A_log, dt_bias, want_state, want_o, **kw)
        o = torch.full((hv * dv,), float("nan"), device=DEVICE, dtype=dtype)
        gdn_decode(new, A_log, dt_bias, state, o, z_block_n=z_block_n, z_first=z_first,
                        **kw, **z)
        assert torch.equal(state, want_state) and torch.equal(o, want_o)
        want_z = matvec_ref(rms_norm_ref(z["z_x"], z["z_norm_w"], EPS), z["z_weight"], out_dtype=dtype)
        torch.testing.assert_close(z["z_out"], want_z, **_tol(dtype))


def test_gdn_decode_core_validates():
    hk, hv, dk, dv = 2, 4, 8, 8
    proj = torch.zeros(2 * hk * dk + 2 * hv * dv + 2 * hv, device=DEVICE)
    state = torch.zeros(hv, dk, dv, device=DEVICE)
    A, dt = torch.zeros(hv, device=DEVICE), torch.zeros(hv, device=DEVICE)
    o = torch.empty(hv * dv, device=DEVICE)
    kw = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)
    with pytest.raises(ValueError):
        gdn_decode(proj[:-1], A, dt, state, o, **kw)
    with pytest.raises(ValueError):
        gdn_decode(proj, A, dt, state.half(), o, **kw)
    with pytest.raises(ValueError):
        gdn_decode(proj, A, dt, state, o, **{**kw, "num_v_heads": 3})
    with pytest.raises(ValueError):
        gdn_decode(proj, A, dt, state, o, block_v=12, **kw)
    # the z programs: proj without z, all four z operands, a power-of-two block
    g = torch.Generator().manual_seed(0)
    z = _z_case(hv, dv, 16, torch.float32, g)
    proj_ba = proj[:2 * hk * dk + hv * dv + 2 * hv].contiguous()
    gdn_decode(proj_ba, A, dt, state, o, **kw, **z)
    with pytest.raises(ValueError):                     # the old layout with z programs
        gdn_decode(proj, A, dt, state, o, **kw, **z)
    with pytest.raises(ValueError):                     # z_out without z_weight
        gdn_decode(proj, A, dt, state, o, z_out=z["z_out"], **kw)
    with pytest.raises(ValueError):                     # z_weight without z_x
        gdn_decode(proj_ba, A, dt, state, o, **kw, **{**z, "z_x": None})
    with pytest.raises(ValueError):                     # z rows != Hv * dv
        gdn_decode(proj_ba, A, dt, state, o, **kw, **{**z, "z_weight": z["z_weight"][1:]})
    with pytest.raises(ValueError):                     # z_x of the wrong length
        gdn_decode(proj_ba, A, dt, state, o, **kw, **{**z, "z_x": z["z_x"][1:]})
    with pytest.raises(ValueError):
        gdn_decode(proj_ba, A, dt, state, o, z_block_n=6, **kw, **z)


# ------------------------------------------------------------------------------------------
# a whole GDN mixer step: fused path == the unfused path the engine ran before
# ------------------------------------------------------------------------------------------

def _gdn_layer(hk, hv, dk, dv, kwid, D, dtype, g):
    conv_dim = 2 * hk * dk + hv * dv
    n_proj = conv_dim + hv * dv + 2 * hv
    return dict(
        input_norm=_vec(D, g, 0.2, dtype),
        qkvzba=_vec(n_proj * D, g, D ** -0.5, dtype).view(n_proj, D),
        conv_w=_vec(conv_dim * kwid, g, 0.5, dtype).view(conv_dim, kwid),
        A_log=(torch.randn(hv, generator=g) * 0.5).to(DEVICE),
        dt_bias=_vec(hv, g, 1.0, dtype),
        norm_w=(1 + 0.1 * torch.randn(dv, generator=g)).to(DEVICE),
        out_proj=_vec(D * hv * dv, g, (hv * dv) ** -0.5, dtype).view(D, hv * dv))


def _gdn_step_inputs(dims, kwid, D, dtype, g):
    """A GDN layer's weights, its conv and recurrent states, an input h and the proj / o
    buffers, drawn from g in one fixed order: (L, conv_state, state, h, proj, o, conv_dim,
    n_proj)."""
    hk, hv, dk, dv = dims
    L = _gdn_layer(hk, hv, dk, dv, kwid, D, dtype, g)
    conv_dim = 2 * hk * dk + hv * dv
    n_proj = conv_dim + hv * dv + 2 * hv
    conv_state = _vec(conv_dim * (kwid - 1), g, 1.0, dtype).view(conv_dim, kwid - 1)
    state = (torch.randn(hv, dk, dv, generator=g) * 0.1).to(DEVICE)
    h = _vec(D, g, 2.0, dtype)
    proj = torch.empty(n_proj, device=DEVICE, dtype=dtype)
    o = torch.empty(hv * dv, device=DEVICE, dtype=dtype)
    return L, conv_state, state, h, proj, o, conv_dim, n_proj


def _unfused_gdn_step(L, h, conv_state, state, dims, dtype):
    """rms_norm -> in_proj GEMV -> gdn_decode (conv, core, gated norm) -> out_proj + residual."""
    hk, hv, dk, dv = dims
    x = rms_norm_ref(h, L["input_norm"], EPS)
    proj = matvec_ref(x, L["qkvzba"], out_dtype=dtype)
    n_qkvz = 2 * hk * dk + 2 * hv * dv
    y, conv_state, state = gdn_mixer_ref(
        proj[:n_qkvz], proj[n_qkvz:], conv_state, L["conv_w"], L["A_log"], L["dt_bias"], state,
        L["norm_w"], num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, eps=EPS)
    return matvec_ref(y, L["out_proj"], residual=h, out_dtype=dtype), conv_state, state


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("z_in_core", [False, True], ids=["z_in_proj", "z_in_core"])
@pytest.mark.parametrize("dims,split_k", [((2, 4, 24, 40), 1), ((2, 2, 32, 32), 2)])
def test_gdn_mixer_fused_path_matches_unfused(dims, split_k, z_in_core, dtype):
    """z_in_core: the engine's form, the in_proj GEMV on the q|k|v|b|a rows and the z rows in
    the GDN core's launch."""
    hk, hv, dk, dv = dims
    D, kwid = 96, 4
    g = torch.Generator().manual_seed(11)
    L, conv_state, state, h, proj, o, conv_dim, n_proj = _gdn_step_inputs(dims, kwid, D, dtype, g)
    ref_conv, ref_state = conv_state.clone(), state.clone()
    part, cnt = _scratch(max(n_proj, D), split_k, 8)
    W = L["qkvzba"]
    if z_in_core:
        zr = slice(conv_dim, conv_dim + hv * dv)
        W = torch.cat([W[:conv_dim], W[conv_dim + hv * dv:]])        # q|k|v|b|a
        proj = proj[:W.shape[0]]
        zbuf = torch.full((hv * dv,), float("nan"), device=DEVICE, dtype=dtype)
        zkw = dict(z_weight=L["qkvzba"][zr].contiguous(), z_x=h, z_norm_w=L["input_norm"],
                   z_out=zbuf, z_eps=EPS)
    for step in range(2):
        want_h, ref_conv, ref_state = _unfused_gdn_step(L, h, ref_conv, ref_state, dims, dtype)
        gemv(h, W, proj, norm_w=L["input_norm"], eps=EPS, conv_state=conv_state,
                     conv_w=L["conv_w"], split_k=split_k, partials=part, counters=cnt,
                     block_n=8, block_k=32)
        gdn_decode(proj, L["A_log"], L["dt_bias"], state, o, num_k_heads=hk,
                        num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, **(zkw if z_in_core else {}))
        gate = zbuf if z_in_core else proj[conv_dim:conv_dim + hv * dv]
        gemv(o, L["out_proj"], h, norm_w=L["norm_w"], gate=gate,
                   head_dim=dv, eps=EPS, residual=h, split_k=split_k, partials=part,
                   counters=cnt, block_n=8, block_k=min(32, dv))
        # the state holds the projection outputs: equal up to the GEMV's summation order
        torch.testing.assert_close(conv_state, ref_conv, **_tol(dtype))
        torch.testing.assert_close(state, ref_state, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(h, want_h, **_tol(dtype))
        h.copy_(want_h)                 # stay on the reference trajectory
        conv_state.copy_(ref_conv)
        state.copy_(ref_state)


# ------------------------------------------------------------------------------------------
# LM head with the final norm fused
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_argmax_with_final_norm(dtype):
    g = torch.Generator().manual_seed(5)
    V, D, valid = 300, 72, 290
    h = _vec(D, g, 3.0, dtype)
    norm_w = _vec(D, g, 0.2, dtype)
    E = _vec(V * D, g, 1.0, dtype).view(V, D)
    logits = torch.full((V,), float("nan"), device=DEVICE)
    tok = torch.full((1,), -1, device=DEVICE, dtype=torch.int64)
    part = torch.empty(lm_head_partials_numel(V, 16), device=DEVICE, dtype=torch.int64)
    lm_head_argmax(h, E, valid, logits, tok, part, norm_w=norm_w, eps=EPS, block_n=16,
                   block_k=32, num_warps=4)
    want_logits, want_tok = lm_head_argmax_ref(h, E, valid, norm_w=norm_w, eps=EPS)
    torch.testing.assert_close(logits, want_logits, **_tol(dtype))
    assert int(tok[0]) == want_tok


# ------------------------------------------------------------------------------------------
# launcher validation, PDL off under the interpreter, sm_90 compile with PDL on
# ------------------------------------------------------------------------------------------

def test_gemv_fused_validates():
    x = torch.zeros(32, device=DEVICE)
    W = torch.zeros(16, 32, device=DEVICE)
    out = torch.zeros(16, device=DEVICE)
    with pytest.raises(ValueError):                     # two epilogues
        gemv(x, W, out, residual=out, silu_mul=True)
    with pytest.raises(ValueError):                     # split-K without scratch
        gemv(x, W, out, split_k=2, block_n=4, block_k=16)
    with pytest.raises(ValueError):                     # gated norm: head_dim must divide K
        gemv(x, W, out, norm_w=torch.zeros(5, device=DEVICE), gate=x, head_dim=5)
    with pytest.raises(ValueError):                     # gated norm: block_k beyond the head
        gemv(x, W, out, norm_w=torch.zeros(16, device=DEVICE), gate=x, head_dim=16,
                   block_k=32)
    with pytest.raises(ValueError):                     # conv state shape
        gemv(x, W, out, conv_state=torch.zeros(8, 2, device=DEVICE),
                   conv_w=torch.zeros(8, 4, device=DEVICE))


@pytest.mark.skipif(DEVICE == "cuda", reason="interpreter-only check")
def test_pdl_switch_is_a_no_op_under_the_interpreter():
    assert pdl_mode(True, False, "cpu") == 0 and pdl_mode(True, True, "cpu") == 0
    assert launch_kw(pdl_mode(True, False, "cpu")) == {}
    g = torch.Generator().manual_seed(1)
    h, nw = _vec(64, g), _vec(64, g, 0.2)
    W = _vec(16 * 64, g, 0.125).view(16, 64)
    out = torch.empty(16, device=DEVICE)
    gemv(h, W, out, norm_w=nw, eps=EPS, block_n=4, block_k=16)
    torch.testing.assert_close(out, gemv_ref(h, W, norm_w=nw, eps=EPS)[0],
                               rtol=2e-5, atol=2e-5)


_COMPILE_SCRIPT = textwrap.dedent("""
    import os
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
    import tritonchat.kernels.attention_decode as A
    import tritonchat.kernels.gemv as G
    import tritonchat.kernels.gdn_decode as C
    import tritonchat.kernels.sampling as S

    def build(fn, args, const, num_warps, pdl=True):
        sig = dict(args)
        sig.update({k: "constexpr" for k in const})
        src = ASTSource(fn=fn, signature=sig, constexprs=const)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=num_warps))
        ptx = k.asm["ptx"]
        if pdl:
            assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, fn
        assert len(k.asm["cubin"]) > 0, fn            # ptxas accepted the PTX
        return k

    gemv_args = dict(x_ptr="*bf16", z_ptr="*bf16", nw_ptr="*bf16", w_ptr="*bf16",
                     out_ptr="*bf16", res_ptr="*bf16", conv_state_ptr="*bf16",
                     conv_w_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32", N_OUT="i32",
                     K="i32", stride_w="i32", eps="fp32", K_PER_SPLIT="i32", CONV_DIM="i32")
    base = dict(DV=1, KW=4, BLOCK_X=1024, ONE_X=True, MASK_N=False, MASK_K=False, PDL=1)
    for pro, epi, split, bn, bk in ((1, 3, 1, 8, 512), (1, 2, 1, 4, 512), (1, 0, 2, 8, 512),
                                    (0, 1, 4, 4, 512)):
        build(G._gemv_kernel, gemv_args,
              dict(base, PRO=pro, EPI=epi, SPLIT_K=split, BLOCK_N=bn, BLOCK_K=bk), 4)
    gated_args = dict(gemv_args, nw_ptr="*fp32")
    build(G._gemv_kernel, gated_args,
          dict(base, PRO=2, EPI=1, DV=128, BLOCK_X=128, SPLIT_K=2, BLOCK_N=4, BLOCK_K=128), 4)
    core_args = dict(proj_ptr="*bf16", A_log_ptr="*fp32", dt_bias_ptr="*bf16",
                     state_ptr="*fp32", o_ptr="*bf16", q_scale="fp32", zw_ptr="*bf16",
                     zx_ptr="*bf16", znw_ptr="*bf16", z_ptr="*bf16", z_eps="fp32", HK="i32",
                     HV="i32", BA_OFF="i32", N_Z="i32")
    # without z programs, with them (first or last in the grid: the engine's launch)
    for bv, z_rows, z_first in ((16, 0, True), (32, 2048, True), (32, 2048, False)):
        build(C._gdn_decode_kernel, core_args,
              dict(DK=128, DV=128, GROUP=1, BLOCK_K=128, BLOCK_V=bv, L2_EPS=1e-6,
                   SP_THRESHOLD=20.0, PDL=True, Z_ROWS=z_rows, ZK=1024 if z_rows else 0,
                   BLOCK_ZN=8, BLOCK_ZK=1024 if z_rows else 1, Z_FIRST=z_first), 4)
    # the persistent direct form, with the trigger-at-start PDL mode (2)
    pers_args = dict(x_ptr="*bf16", z_ptr="*bf16", nw_ptr="*bf16", w_ptr="*bf16",
                     out_ptr="*bf16", res_ptr="*bf16", conv_state_ptr="*bf16",
                     conv_w_ptr="*bf16", ap_ptr="*fp32", pos_ptr="*i32", N_OUT="i32", K="i32",
                     stride_w="i32", eps="fp32", CONV_DIM="i32")
    for pro, epi, bn, bk, pdl in ((1, 3, 8, 1024, 2), (1, 2, 4, 1024, 1), (0, 1, 4, 4096, 1),
                                  (2, 1, 8, 2048, 1)):
        build(G._gemv_persistent_kernel,
              dict(pers_args, nw_ptr="*fp32") if pro == 2 else pers_args,
              dict(PRO=pro, EPI=epi, DV=128 if pro == 2 else 1, KW=4, NPROG=132, BLOCK_N=bn,
                   BLOCK_K=bk, MASK_K=bk == 4096, PDL=pdl, A_NS=1, A_BN=1, A_DEFER=0,
                   A_MERGE=1, A_GROUPS=False), 8)
    # the attention o_proj merging the split (or group) partials the attention left
    # (PRO_ATTN), and the attention launches that leave them
    for groups in (False, True):
        build(G._gemv_persistent_kernel, pers_args,
              dict(PRO=4, EPI=1, DV=256, KW=2, NPROG=128, BLOCK_N=8, BLOCK_K=2048, MASK_K=False,
                   PDL=1, A_NS=66, A_BN=64, A_DEFER=12, A_MERGE=8, A_GROUPS=groups), 8)
    attn_args = dict(qg_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", qn_w_ptr="*bf16",
                     kn_w_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", pos_ptr="*i32",
                     part_ptr="*fp32", cnt_ptr="*i32", out_ptr="*bf16", max_ctx="i32",
                     eps="fp32", qk_scale_log2="fp32", freq_log2_step="fp32")
    for groups in (False, True):
        build(A._attn_decode_kernel, attn_args,
              dict(HD=256, ROT=64, GROUP=4, NUM_SPLITS=66, NUM_HEADS=8, BLOCK_H=16, BLOCK_G=4,
                   BLOCK_D=256, BLOCK_N=64, MERGE=8, MERGE_TOP=16,
                   ONE_LEVEL=0 if groups else 32, DEFER=12, DEFER_GROUPS=groups,
                   DOT_PRECISION=None, PDL=1), 8)
    # the step's last kernel: argmax of the keys + token count + position advance
    build(S._argmax_keys_kernel, dict(part_ptr="*i64", n="i32", token_ptr="*i64",
                                      counts_ptr="*i32", row_offset="i32", pos_ptr="*i32",
                                      ring_ptr="*i64"),
          dict(BLOCK=16384, COUNT=True, ADVANCE=True, RING=4, PDL=2), 16)
    lm_args = dict(h_ptr="*bf16", nw_ptr="*bf16", e_ptr="*bf16", logits_ptr="*fp32",
                   part_ptr="*i64", V="i32", VALID="i32", K="i32", stride_e="i32", eps="fp32")
    build(S._lm_head_kernel, lm_args,
          dict(PRO=1, BLOCK_N=8, BLOCK_K=512, BLOCK_X=1024, ONE_X=True, MASK_N=False,
               MASK_K=False, PDL=True), 4)
    # the persistent LM head (the table's plan): whole rows, 3 pipeline stages
    build(S._lm_head_persistent_kernel, dict(lm_args, NB="i32"),
          dict(PRO=1, BLOCK_N=16, BLOCK_K=1024, MASK_N=False, MASK_K=False, STAGES=3,
               EVICT=False, PDL=True), 8)
    # the sampler's merge levels (bitonic top-k of sorted runs) at the engine's plans for 64
    # candidates (top-k 20) and 256 (top-p alone); the sampler launches without PDL
    for kc, chunk in ((64, 1024), (256, 2048)):
        build(S._topk_merge_kernel, dict(in_ptr="*i64", n_in="i32", out_ptr="*i64",
                                         params_ptr="*fp32"), dict(KC=kc, CHUNK=chunk), 8,
              pdl=False)
    print("OK")
""")


def test_fused_kernels_compile_for_sm90_with_pdl():
    """Offline PTX + cubin for sm_90 (no GPU needed), the PDL instructions present."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True,
                       env=env, timeout=600)
    if r.returncode != 0 and ("ptxas" in r.stderr and "not found" in r.stderr.lower()):
        pytest.skip("no ptxas for an offline sm_90 compile")
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


# ------------------------------------------------------------------------------------------
# GPU twins: bf16 at the true 0.8B shapes
# ------------------------------------------------------------------------------------------

Q08 = dict(D=1024, I=3584, hk=16, hv=16, dk=128, dv=128, kw=4, V=248320)


def _z_split(L, hk, hv, dk, dv):
    """The engine's GDN weights: the in_proj rows q|k|v|b|a and the z rows apart."""
    conv_dim = 2 * hk * dk + hv * dv
    W = L["qkvzba"]
    return (torch.cat([W[:conv_dim], W[conv_dim + hv * dv:]]),
            W[conv_dim:conv_dim + hv * dv].contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("z_in_core", [False, True], ids=["z_in_proj", "z_in_core"])
@pytest.mark.parametrize("split_k", [None, 1, 2])
def test_gpu_gdn_mixer_model_shape(split_k, z_in_core):
    torch.manual_seed(0)
    dt = torch.bfloat16
    hk, hv, dk, dv, kwid, D = (Q08[k] for k in ("hk", "hv", "dk", "dv", "kw", "D"))
    g = torch.Generator().manual_seed(2)
    L, conv_state, state, h, proj, o, conv_dim, n_proj = _gdn_step_inputs(
        (hk, hv, dk, dv), kwid, D, dt, g)
    ref_conv, ref_state = conv_state.clone(), state.clone()
    part = torch.zeros(8 * n_proj, device=DEVICE)
    cnt = torch.zeros(n_proj, device=DEVICE, dtype=torch.int32)
    W, zkw, gate = L["qkvzba"], {}, proj[conv_dim:conv_dim + hv * dv]
    if z_in_core:
        W, z_w = _z_split(L, hk, hv, dk, dv)
        proj = proj[:W.shape[0]]
        gate = torch.empty(hv * dv, device=DEVICE, dtype=dt)
        zkw = dict(z_weight=z_w, z_x=h, z_norm_w=L["input_norm"], z_out=gate, z_eps=EPS)
    for step in range(3):
        want_h, ref_conv, ref_state = _unfused_gdn_step(L, h, ref_conv, ref_state,
                                                        (hk, hv, dk, dv), dt)
        gemv(h, W, proj, norm_w=L["input_norm"], eps=EPS, conv_state=conv_state,
                     conv_w=L["conv_w"], split_k=split_k, partials=part, counters=cnt)
        gdn_decode(proj, L["A_log"], L["dt_bias"], state, o, num_k_heads=hk,
                        num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, **zkw)
        gemv(o, L["out_proj"], h, norm_w=L["norm_w"], gate=gate,
                   head_dim=dv, eps=EPS, residual=h, split_k=split_k, partials=part,
                   counters=cnt)
        # bf16: a rounding point may flip one ulp between summation orders
        torch.testing.assert_close(conv_state.float(), ref_conv.float(), rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(state, ref_state, rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(h.float(), want_h.float(), rtol=3e-2, atol=3e-2)
        h.copy_(want_h)
        conv_state.copy_(ref_conv)
        state.copy_(ref_state)
    assert not cnt.any()


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [None, 1, 2])
def test_gpu_mlp_model_shape(split_k):
    dt = torch.bfloat16
    D, I = Q08["D"], Q08["I"]
    g = torch.Generator().manual_seed(4)
    h = _vec(D, g, 2.0, dt)
    post_norm = _vec(D, g, 0.2, dt)
    gate_up = _vec(2 * I * D, g, D ** -0.5, dt).view(2 * I, D)
    down = _vec(D * I, g, I ** -0.5, dt).view(D, I)
    part = torch.zeros(8 * 2 * I, device=DEVICE)
    cnt = torch.zeros(2 * I, device=DEVICE, dtype=torch.int32)
    act = torch.empty(I, device=DEVICE, dtype=dt)
    want_act, _ = gemv_ref(h, gate_up, norm_w=post_norm, eps=EPS, silu_mul=True)
    gemv(h, gate_up, act, norm_w=post_norm, eps=EPS, silu_mul=True, split_k=split_k,
                 partials=part, counters=cnt)
    torch.testing.assert_close(act.float(), want_act.float(), rtol=2e-2, atol=2e-2)
    want_h = matvec_ref(act, down, residual=h, out_dtype=dt)
    gemv(act, down, h, residual=h, split_k=split_k, partials=part, counters=cnt)
    torch.testing.assert_close(h.float(), want_h.float(), rtol=2e-2, atol=2e-2)
    assert not cnt.any()


@pytest.mark.gpu
def test_gpu_lm_head_final_norm_model_shape():
    dt = torch.bfloat16
    V, D = Q08["V"], Q08["D"]
    g = torch.Generator().manual_seed(6)
    h = _vec(D, g, 2.0, dt)
    norm_w = _vec(D, g, 0.2, dt)
    E = _vec(V * D, g, 0.05, dt).view(V, D)
    from tritonchat.kernels.sampling import lm_head_plan
    p = lm_head_plan(V, D, True)
    logits = torch.empty(V, device=DEVICE)
    tok = torch.empty(1, device=DEVICE, dtype=torch.int64)
    part = torch.empty(lm_head_partials_numel(V, p["block_n"]), device=DEVICE, dtype=torch.int64)
    lm_head_argmax(h, E, V - 243, logits, tok, part, norm_w=norm_w, eps=EPS)
    want_logits, want_tok = lm_head_argmax_ref(h, E, V - 243, norm_w=norm_w, eps=EPS)
    torch.testing.assert_close(logits, want_logits, rtol=1e-3, atol=1e-3)
    assert want_logits[int(tok[0])] >= want_logits[:V - 243].max() - 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("z_in_core", [False, True], ids=["z_in_proj", "z_in_core"])
def test_gpu_pdl_and_graph_replay_match_eager(z_in_core):
    """With PDL on (sm_90+), a CUDA graph of the fused GDN + MLP sequence replays to the
    same bits as eager launches without PDL. z_in_core: the engine's form, whose z programs
    read h before their PDL wait (h's writer, the down GEMV, is two launches back)."""
    dt = torch.bfloat16
    hk, hv, dk, dv, kwid, D, I = (Q08[k] for k in ("hk", "hv", "dk", "dv", "kw", "D", "I"))
    g = torch.Generator().manual_seed(8)
    L = _gdn_layer(hk, hv, dk, dv, kwid, D, dt, g)
    gate_up = _vec(2 * I * D, g, D ** -0.5, dt).view(2 * I, D)
    down = _vec(D * I, g, I ** -0.5, dt).view(D, I)
    post = _vec(D, g, 0.2, dt)
    conv_dim = 2 * hk * dk + hv * dv
    n_proj = conv_dim + hv * dv + 2 * hv
    part = torch.zeros(8 * 2 * I, device=DEVICE)
    cnt = torch.zeros(2 * I, device=DEVICE, dtype=torch.int32)
    bufs = dict(proj=torch.empty(n_proj, device=DEVICE, dtype=dt),
                o=torch.empty(hv * dv, device=DEVICE, dtype=dt),
                act=torch.empty(I, device=DEVICE, dtype=dt))
    h0 = _vec(D, g, 2.0, dt)
    cs0 = _vec(conv_dim * (kwid - 1), g, 1.0, dt).view(conv_dim, kwid - 1)
    st0 = (torch.randn(hv, dk, dv, generator=g) * 0.1).to(DEVICE)

    W, z_w = (_z_split(L, hk, hv, dk, dv) if z_in_core else (L["qkvzba"], None))
    proj = bufs["proj"][:W.shape[0]]
    gate = torch.empty(hv * dv, device=DEVICE, dtype=dt) if z_in_core else \
        bufs["proj"][conv_dim:conv_dim + hv * dv]

    def step(h, cs, st, pdl=0):
        gemv(h, W, proj, norm_w=L["input_norm"], eps=EPS, conv_state=cs,
                     conv_w=L["conv_w"], partials=part, counters=cnt, pdl=pdl)
        zkw = dict(z_weight=z_w, z_x=h, z_norm_w=L["input_norm"], z_out=gate, z_eps=EPS) \
            if z_in_core else {}
        gdn_decode(proj, L["A_log"], L["dt_bias"], st, bufs["o"], num_k_heads=hk,
                        num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, pdl=pdl, **zkw)
        gemv(bufs["o"], L["out_proj"], h, norm_w=L["norm_w"], gate=gate, head_dim=dv,
                   eps=EPS, residual=h, partials=part, counters=cnt, pdl=pdl)
        gemv(h, gate_up, bufs["act"], norm_w=post, eps=EPS, silu_mul=True, partials=part,
                     counters=cnt, pdl=pdl)
        gemv(bufs["act"], down, h, residual=h, partials=part, counters=cnt, pdl=pdl)

    eager = [h0.clone(), cs0.clone(), st0.clone()]
    for _ in range(3):
        step(*eager)
    pdl = pdl_mode(True, False, DEVICE)
    graphed = [h0.clone(), cs0.clone(), st0.clone()]
    warm = [t.clone() for t in graphed]
    step(*warm, pdl=pdl)                          # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(*graphed, pdl=pdl)
    for t, t0 in zip(graphed, (h0, cs0, st0)):
        t.copy_(t0)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    assert not cnt.any()


# ------------------------------------------------------------------------------------------
# the tuning table: launchers read it by key, fall back to heuristics without it
# ------------------------------------------------------------------------------------------

@pytest.fixture
def own_table(tmp_path, monkeypatch):
    """use(text): the decode table is a file of the test's own with this text (again for a new
    text); the table's cache is cleared each time and after the test, so later tests read the
    packaged table again."""
    path = tmp_path / "decode_tuning.json"
    monkeypatch.setattr(_common, "DECODE_TABLE_PATH", str(path))

    def use(text: str):
        path.write_text(text)
        _common.decode_table.cache_clear()
        return path

    yield use
    _common.decode_table.cache_clear()


def test_decode_tuning_table_is_read_and_optional(own_table):
    from tritonchat.kernels import gdn_decode as gdn_mod
    from tritonchat.kernels import sampling as samp_mod
    own_table('{"entries": ['
              '{"key": "gemv:1024x2048:gated:residual", "split_k": 4, "block_n": 4,'
              ' "block_k": 64, "num_warps": 8},'
              '{"key": "gdn_core:16x128x128", "block_v": 32, "num_warps": 2,'
              ' "z_block_n": 16, "z_first": false},'
              '{"key": "gdn_core:8x64x64", "block_v": 16, "num_warps": 4,'
              ' "z_block_n": 12},'
              '{"key": "lm_head:248320x1024:rms", "block_n": 16, "block_k": 256,'
              ' "num_warps": 8},'
              '{"key": "lm_head:1000x64:rms", "block_n": 8, "block_k": 64,'
              ' "num_warps": 4, "persistent": 2, "num_stages": 3, "evict": false},'
              '{"key": "gemv:1024x3584:none:residual", "split_k": 1, "block_n": 4,'
              ' "block_k": 1024, "num_warps": 4, "persistent": 2},'
              '{"key": "attention:8x2x256", "block_n": 64, "num_warps": 8,'
              ' "num_stages": 1},'
              '{"key": "attention:4x1x64", "block_n": 48, "num_stages": "x"}]}')
    assert gemv_mod.plan(1024, 2048, "gated", "residual", 128) == dict(
        split_k=4, block_n=4, block_k=64, num_warps=8, persistent=0)
    # the in-step tuner's persistent form is read, and kept when split-K is switched off
    want = dict(split_k=1, block_n=4, block_k=1024, num_warps=4, persistent=2)
    assert gemv_mod.plan(1024, 3584, "none", "residual") == want
    assert gemv_mod.plan(1024, 3584, "none", "residual", split_k_enabled=False) == want
    # an entry whose block_k exceeds the head would be invalid: the heuristic wins
    assert gemv_mod.plan(1024, 2048, "gated", "residual", 32)["block_k"] <= 32
    assert gdn_mod._plan(16, 128, 128) == (32, 2, 16, False)
    assert gdn_mod._plan(8, 64, 64) == (16, 4, 2, True)   # 12: the default block
    # an LM head entry without the persistent keys is the grid form
    assert samp_mod.lm_head_plan(248320, 1024, True) == dict(
        block_n=16, block_k=256, num_warps=8, persistent=0, num_stages=1, evict=True)
    assert samp_mod.lm_head_plan(1000, 64, True) == dict(
        block_n=8, block_k=64, num_warps=4, persistent=2, num_stages=3, evict=False)
    from tritonchat.kernels.attention_decode import attention_plan
    assert attention_plan(8, 2, 256) == dict(block_n=64, num_warps=8, num_stages=1)
    assert attention_plan(4, 1, 64) == {}         # not a power of two, not a number
    assert attention_plan(4, 2, 64) == {}         # no entry
    own_table("{not json")
    assert gemv_mod.plan(1024, 2048, "gated", "residual", 128) == \
        gemv_mod.heuristic_plan(1024, 2048, "gated", 128)


def test_context_range_plans_from_the_table(own_table):
    """An entry's context_ranges (plans for contexts shorter than `below` positions) are read in
    ascending order; malformed ones, a repeated bound, a persistent plan with split-K, a split-K
    plan with split-K off and a gated plan wider than its head are left out."""
    from tritonchat.engine.triton_backend import context_ranges
    ok = '"split_k": 1, "block_n": 8, "block_k": 1024, "num_warps": 8, "persistent": 2'
    own_table(
        '{"entries": [{"key": "gemv:5120x1024:rms:plain", "split_k": 1, "block_n": 8,'
        ' "block_k": 512, "num_warps": 4, "context_ranges": ['
        '{"below": 1792, "split_k": 1, "block_n": 8, "block_k": 1024, "num_warps": 4, "persistent": 2},'
        '{"below": 768, ' + ok + '},'
        '{"below": 768, "split_k": 1, "block_n": 4, "block_k": 256, "num_warps": 4},'
        '{"below": 4096, "split_k": 2, "block_n": 8, "block_k": 256, "num_warps": 4},'
        '{"below": 5000, "split_k": 2, "block_n": 8, "block_k": 256, "num_warps": 4, "persistent": 1},'
        '{"below": 6000, "split_k": 1, "block_n": 6, "block_k": 256, "num_warps": 4},'
        '{"below": 0, ' + ok + '}, {"below": "x", ' + ok + '}, {"split_k": 1}, 7]},'
        '{"key": "gemv:1024x2048:gated:residual", "split_k": 1, "block_n": 4, "block_k": 64,'
        ' "num_warps": 4, "context_ranges": [{"below": 512, "split_k": 1, "block_n": 4,'
        ' "block_k": 256, "num_warps": 4}]},'
        '{"key": "gemv:3584x1024:rms:silu_mul", "split_k": 1, "block_n": 4, "block_k": 512,'
        ' "num_warps": 4, "context_ranges": "all"}]}')
    p8 = dict(split_k=1, block_n=8, block_k=1024, num_warps=8, persistent=2)
    p4 = dict(p8, num_warps=4)
    s2 = dict(split_k=2, block_n=8, block_k=256, num_warps=4, persistent=0)
    assert gemv_mod.range_plans(5120, 1024, "rms", "plain") == [
        (768, p8), (1792, p4), (4096, s2)]
    assert gemv_mod.range_plans(5120, 1024, "rms", "plain", split_k_enabled=False) == [
        (768, p8), (1792, p4)]
    assert gemv_mod.range_plans(1024, 2048, "gated", "residual", 128) == []
    assert gemv_mod.range_plans(3584, 1024, "rms", "silu_mul") == []
    assert gemv_mod.range_plans(1024, 3584, "none", "residual") == []    # no entry
    # the engine's ranges: each range's plans are the base with the plan covering its start
    base = {"qkv": "b0", "mlp": "m0", "other": "o0"}
    r = context_ranges(base, {"qkv": [(0, 768, "q1"), (768, 1792, "q2")],
                              "mlp": [(0, 1024, "m1")]})
    assert [(b, p["qkv"], p["mlp"], p["other"]) for b, p in r] == [
        (768, "q1", "m1", "o0"), (1024, "q2", "m1", "o0"), (1792, "q2", "m0", "o0"),
        (None, "b0", "m0", "o0")]
    assert r[-1][1] is base
    assert context_ranges(base, {}) == [(None, base)]
    # a plan from a position to the end (the attention's long contexts) and one for a
    # middle range: the last range is no longer the base itself; a key absent from the base
    # is None where no range of it applies
    r = context_ranges(base, {"qkv": [(0, 768, "q1")], "attn": [(4096, None, "a2")],
                              "mlp": [(1024, 2048, "m1")]})
    assert [(b, p["qkv"], p["mlp"], p["attn"]) for b, p in r] == [
        (768, "q1", "m0", None), (1024, "b0", "m0", None), (2048, "b0", "m1", None),
        (4096, "b0", "m0", None), (None, "b0", "m0", "a2")]
    assert r[-1][1] is not base and r[-1][1]["other"] == "o0" and "attn" not in base


def test_attention_range_plans_from_the_table(own_table):
    """The attention entry's context_ranges (launch plans over ranges of positions, to the end
    where `below` is absent) are read in ascending order of their start; malformed ones, a
    repeated start, an empty range and sizes out of range or not powers of two are left out;
    the entry's own plan is read as before."""
    from tritonchat.kernels.attention_decode import attention_plan, attention_range_plans
    ok = '"splits_per_sm": 2, "block_n": 32, "num_warps": 4, "num_stages": 2, "merge_splits": 16'
    bad = [  # each breaks one rule
        '{"from": 100, "splits_per_sm": 2, "block_n": 48, "num_warps": 4, "num_stages": 2, "merge_splits": 16}',
        '{"from": 200, "splits_per_sm": 2, "block_n": 8, "num_warps": 4, "num_stages": 2, "merge_splits": 16}',
        '{"from": 300, "splits_per_sm": 5, "block_n": 32, "num_warps": 4, "num_stages": 2, "merge_splits": 16}',
        '{"from": 400, "splits_per_sm": 2, "block_n": 32, "num_warps": 4, "num_stages": 0, "merge_splits": 16}',
        '{"from": 500, "splits_per_sm": 2, "block_n": 32, "num_warps": 4, "num_stages": 2, "merge_splits": 32}',
        '{"from": 600, "splits_per_sm": 2, "block_n": 32, "num_warps": 3, "num_stages": 2, "merge_splits": 16}',
        '{"from": 700, "below": 700, ' + ok + '}', '{"from": -1, ' + ok + '}',
        '{"from": "x", ' + ok + '}', '{"from": 800, "block_n": 32}', '7']
    own_table(
        '{"entries": [{"key": "attention:8x2x256", "block_n": 64, "num_warps": 8, "num_stages": 1,'
        ' "context_ranges": [{"from": 22528, ' + ok + '}, {"from": 1000, "below": 2000, '
        '"splits_per_sm": 1, "block_n": 16, "num_warps": 2, "num_stages": 1, "merge_splits": 2},'
        ' {"from": 22528, ' + ok.replace('"block_n": 32', '"block_n": 64') + '}, '
        + ", ".join(bad) + ']},'
        '{"key": "attention:4x2x64", "context_ranges": {"from": 1}}]}')
    long = dict(splits_per_sm=2, block_n=32, num_warps=4, num_stages=2, merge_splits=16)
    short = dict(splits_per_sm=1, block_n=16, num_warps=2, num_stages=1, merge_splits=2)
    assert attention_range_plans(8, 2, 256) == [(1000, 2000, short), (22528, None, long)]
    assert attention_plan(8, 2, 256) == dict(block_n=64, num_warps=8, num_stages=1)
    assert attention_range_plans(4, 2, 64) == []          # not a list
    assert attention_range_plans(4, 1, 64) == []          # no entry


def test_the_packaged_table_has_the_long_context_attention_range():
    """The packaged table's attention plan for long contexts (measured on the H200) is read."""
    from tritonchat.kernels.attention_decode import attention_range_plans
    _common.decode_table.cache_clear()
    plans = attention_range_plans(8, 2, 256)
    assert [(lo, hi) for lo, hi, _ in plans] == [(22528, None)]
    assert plans[0][2] == dict(splits_per_sm=2, block_n=32, num_warps=4, num_stages=2, merge_splits=16)


def test_a_persistent_gated_plan_gives_way_to_an_explicit_split(own_table):
    """The table's plan for a gated GEMV is the persistent form (whole K one tile); a caller
    asking for split-K gets the grid form's head-sized tiles, not the persistent block_k."""
    own_table('{"entries": [{"key": "gemv:24x64:gated:residual", "split_k": 1,'
              ' "block_n": 8, "block_k": 64, "num_warps": 4, "persistent": 1}]}')
    g = torch.Generator().manual_seed(9)
    o, z, W = _vec(64, g, 2.0), _vec(64, g, 2.0), _vec(24 * 64, g, 0.125).view(24, 64)
    norm_w = (1 + 0.1 * torch.randn(16, generator=g)).to(DEVICE)
    res = _vec(24, g)
    want, _ = gemv_ref(o, W, norm_w=norm_w, gate=z, head_dim=16, eps=EPS, residual=res)
    for split_k in (None, 1, 2):
        h = res.clone()
        part, cnt = _scratch(24, 2, 8)
        gemv(o, W, h, norm_w=norm_w, gate=z, head_dim=16, eps=EPS, residual=h,
                   split_k=split_k, partials=part, counters=cnt)
        torch.testing.assert_close(h, want, **_tol(torch.float32))


@pytest.mark.parametrize("n_out,k,pro,epi", [(8224, 1024, "rms", "conv"),
                                             (3584, 1024, "rms", "silu_mul"),
                                             (1024, 2048, "gated", "residual"),
                                             (1024, 3584, "none", "residual"),
                                             (37, 200, "rms", "plain")])
def test_fused_heuristic_plans_are_valid(n_out, k, pro, epi):
    p = gemv_mod.heuristic_plan(n_out, k, pro, 128 if pro == "gated" else 0,
                                      epi == "silu_mul")
    assert p["block_k"] & (p["block_k"] - 1) == 0 and p["block_k"] >= 16
    assert p["block_n"] & (p["block_n"] - 1) == 0
    assert 1 <= p["split_k"] <= gemv_mod.MAX_SPLIT_K
    if pro == "gated":
        assert p["block_k"] <= 128
    # enough programs to cover an H200 (132 SMs) for the model's shapes
    programs = -(-n_out // p["block_n"]) * p["split_k"]
    assert n_out < 1000 or programs >= 132


def test_tune_decode_quick_grid_is_small_and_valid():
    from tritonchat.engine.tuning import decode as td
    total = 0
    for _key, n_out, k, pro, _epi, _what in td.GEMVS:
        for p in td._gemv_grid(n_out, k, pro, True):
            total += 1
            assert p["block_n"] * p["block_k"] <= 8192
            assert pro != "gated" or p["block_k"] <= td.DV
    assert 0 < total <= 80                       # ~2 s a config on the device: < 4 minutes


def test_tuner_keeps_the_fastest_plan_that_runs(monkeypatch):
    """tune_decode._fastest (the LM head's and the GDN core's sweeps): the fastest plan of
    those that compile and launch, the others logged and skipped; an error when none ran."""
    from tritonchat.engine.tuning import decode as td
    cost = {1: 5.0, 2: 3.0, 3: None, 4: 4.0}          # plan 3 does not compile

    def launch(p):
        if cost[p["n"]] is None:
            raise RuntimeError("compile error")
        return p["n"]
    monkeypatch.setattr(td, "_bench_us", lambda fn, rep: cost[fn])
    logs = []
    us, plan = td._fastest([dict(n=i) for i in (1, 2, 3, 4)], launch, 10, "x", logs.append)
    assert (us, plan) == (3.0, dict(n=2)) and len(logs) == 1 and "skip x" in logs[0]
    with pytest.raises(RuntimeError, match="no x plan ran"):
        td._fastest([dict(n=3)], launch, 10, "x", logs.append)


def test_in_step_tuner_candidates_are_valid_plans():
    """engine/tune_step.py's candidates: the persistent form only where the kernel has it
    (direct form; a gated prologue of power-of-two heads), tiles gemv accepts,
    persistent ones first."""
    from tritonchat.engine import tune_step as ts
    from tritonchat.kernels import gemv as G
    from tritonchat.engine.tuning import decode as td
    for _key, n_out, k, pro, epi, _what in td.GEMVS:
        cands = list(ts._gemv_candidates(n_out, k, pro, td.DV if pro == "gated" else 0,
                                         epi == "silu_mul"))
        assert cands and len(cands) <= 48
        flags = [bool(c["persistent"]) for c in cands]
        assert flags == sorted(flags, reverse=True)      # the structural candidates first
        for c in cands:
            assert c["block_n"] & (c["block_n"] - 1) == 0 and c["block_k"] >= 16
            assert c["block_k"] & (c["block_k"] - 1) == 0 and 1 <= c["split_k"] <= 8
            if c["persistent"]:
                assert c["split_k"] == 1
                assert pro != "gated" or G.gated_persistent_ok(k, td.DV)
            if pro == "gated" and not c["persistent"]:
                assert c["block_k"] <= td.DV


def test_in_step_tuner_needs_a_gpu(capsys):
    from tritonchat.engine import tune_step as ts
    if torch.cuda.is_available():
        pytest.skip("runs the real tuner on a GPU")
    assert ts.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
