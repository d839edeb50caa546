"""kernels/gdn_decode.py against reference.gdn_decode_ref: the recurrence over value tiles
(grouped value heads, odd head sizes, several steps), the z programs of the same launch, and
a whole GDN mixer step through the fused launches against the unfused layer
(reference.gdn_mixer_ref); GPU twins at the 0.8B shape, with PDL and graph replay."""
import pytest
import torch

from tests.kernels.util import DEVICE, DTYPES, EPS, Q08, scratch, tol, vec
from tritonchat.kernels._common import pdl_mode

from tritonchat.kernels.gdn_decode import gdn_decode
from tritonchat.kernels.gemv import gemv
from tritonchat.kernels.reference import gdn_decode_ref, gdn_mixer_ref, matvec_ref, rms_norm_ref


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
def test_gdn_decode_steps(cfg, block_v, dtype):
    hk, hv, dk, dv = cfg
    g = torch.Generator().manual_seed(hk * 100 + dv)
    A_log, dt_bias, state, kw = _core_params(cfg, dtype, g)
    for step in range(2):
        proj = _proj(hk, hv, dk, dv, dtype, g, step)
        want_o, want_state = gdn_decode_ref(proj, A_log, dt_bias, state, **kw)
        o = torch.full((hv * dv,), float("nan"), device=DEVICE, dtype=dtype)
        gdn_decode(proj, A_log, dt_bias, state, o, block_v=block_v, **kw)
        torch.testing.assert_close(state, want_state, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(o, want_o, **tol(dtype))
        state.copy_(want_state)


def _z_case(hv, dv, K, dtype, g):
    """The z programs' operands: in_proj_z [Hv*dv, K], the layer input, the input norm weight
    and a NaN-filled z output."""
    return dict(z_weight=vec(hv * dv * K, g, K ** -0.5, dtype).view(hv * dv, K),
                z_x=vec(K, g, 2.0, dtype), z_norm_w=vec(K, g, 0.2, dtype),
                z_out=torch.full((hv * dv,), float("nan"), device=DEVICE, dtype=dtype), z_eps=EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,z_block_n,z_first", [(40, None, True), (64, 4, False),
                                                  (24, 16, True), (24, 16, False)])
@pytest.mark.parametrize("cfg", CORE_CONFIGS[:3], ids=lambda c: "hk{}hv{}dk{}dv{}".format(*c))
def test_gdn_decode_with_z_programs(cfg, K, z_block_n, z_first, dtype):
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
        torch.testing.assert_close(z["z_out"], want_z, **tol(dtype))


def test_gdn_decode_validates():
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
        input_norm=vec(D, g, 0.2, dtype),
        qkvzba=vec(n_proj * D, g, D ** -0.5, dtype).view(n_proj, D),
        conv_w=vec(conv_dim * kwid, g, 0.5, dtype).view(conv_dim, kwid),
        A_log=(torch.randn(hv, generator=g) * 0.5).to(DEVICE),
        dt_bias=vec(hv, g, 1.0, dtype),
        norm_w=(1 + 0.1 * torch.randn(dv, generator=g)).to(DEVICE),
        out_proj=vec(D * hv * dv, g, (hv * dv) ** -0.5, dtype).view(D, hv * dv))


def _gdn_step_inputs(dims, kwid, D, dtype, g):
    """A GDN layer's weights, its conv and recurrent states, an input h and the proj / o
    buffers, drawn from g in one fixed order: (L, conv_state, state, h, proj, o, conv_dim,
    n_proj)."""
    hk, hv, dk, dv = dims
    L = _gdn_layer(hk, hv, dk, dv, kwid, D, dtype, g)
    conv_dim = 2 * hk * dk + hv * dv
    n_proj = conv_dim + hv * dv + 2 * hv
    conv_state = vec(conv_dim * (kwid - 1), g, 1.0, dtype).view(conv_dim, kwid - 1)
    state = (torch.randn(hv, dk, dv, generator=g) * 0.1).to(DEVICE)
    h = vec(D, g, 2.0, dtype)
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
@pytest.mark.parametrize("dims,split_k", [((2, 4, 24, 40), 1),
                                          pytest.param((2, 2, 32, 32), 2, marks=pytest.mark.slow)])
def test_gdn_mixer_fused_path_matches_unfused(dims, split_k, z_in_core, dtype):
    """z_in_core: the engine's form, the in_proj GEMV on the q|k|v|b|a rows and the z rows in
    the GDN core's launch."""
    hk, hv, dk, dv = dims
    D, kwid = 96, 4
    g = torch.Generator().manual_seed(11)
    L, conv_state, state, h, proj, o, conv_dim, n_proj = _gdn_step_inputs(dims, kwid, D, dtype, g)
    ref_conv, ref_state = conv_state.clone(), state.clone()
    part, cnt = scratch(max(n_proj, D), split_k, 8)
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
        torch.testing.assert_close(conv_state, ref_conv, **tol(dtype))
        torch.testing.assert_close(state, ref_state, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(h, want_h, **tol(dtype))
        h.copy_(want_h)                 # stay on the reference trajectory
        conv_state.copy_(ref_conv)
        state.copy_(ref_state)


# ------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------
# GPU twins: bf16 at the true 0.8B shapes
# ------------------------------------------------------------------------------------------

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
@pytest.mark.parametrize("z_in_core", [False, True], ids=["z_in_proj", "z_in_core"])
def test_gpu_pdl_and_graph_replay_match_eager(z_in_core):
    """With PDL on (sm_90+), a CUDA graph of the fused GDN + MLP sequence replays to the
    same bits as eager launches without PDL. z_in_core: the engine's form, whose z programs
    read h before their PDL wait (h's writer, the down GEMV, is two launches back)."""
    dt = torch.bfloat16
    hk, hv, dk, dv, kwid, D, I = (Q08[k] for k in ("hk", "hv", "dk", "dv", "kw", "D", "I"))
    g = torch.Generator().manual_seed(8)
    L = _gdn_layer(hk, hv, dk, dv, kwid, D, dt, g)
    gate_up = vec(2 * I * D, g, D ** -0.5, dt).view(2 * I, D)
    down = vec(D * I, g, I ** -0.5, dt).view(D, I)
    post = vec(D, g, 0.2, dt)
    conv_dim = 2 * hk * dk + hv * dv
    n_proj = conv_dim + hv * dv + 2 * hv
    part = torch.zeros(8 * 2 * I, device=DEVICE)
    cnt = torch.zeros(2 * I, device=DEVICE, dtype=torch.int32)
    bufs = dict(proj=torch.empty(n_proj, device=DEVICE, dtype=dt),
                o=torch.empty(hv * dv, device=DEVICE, dtype=dt),
                act=torch.empty(I, device=DEVICE, dtype=dt))
    h0 = vec(D, g, 2.0, dt)
    cs0 = vec(conv_dim * (kwid - 1), g, 1.0, dt).view(conv_dim, kwid - 1)
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
