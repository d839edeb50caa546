"""kernels/gdn_chunk.py: the causal conv1d + SiLU and the chunked Gated DeltaNet prefill (WY
form) of the raw projection, against the conv and T recurrent steps of
reference.gdn_prefill_ref: outputs, recurrent state and conv state, from start states that are
not zero, with inert padding rows (t_dev); the PDL modes give the same bits."""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.util import launches
from tritonchat.kernels import gdn_chunk as gdn_mod
from tritonchat.kernels._common import pdl_mode
from tritonchat.kernels.gdn_chunk import gdn_launches, gdn_prefill
from tritonchat.kernels.reference import gdn_conv_ref, gdn_gates_ref, gdn_prefill_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# lengths 1 and 2 (shorter than the conv window), the chunk boundaries 63/64/65 and three
# chunks in the fast run; the rest of the sweep is slow
T_LIST = [1, 2, 63, 64, 65, 130] + [pytest.param(t, marks=pytest.mark.slow) for t in (3, 4, 127, 200)]
# grouped value heads (Hv = 2 Hk), dk != dv, neither a power of two
SMALL = dict(num_k_heads=2, num_v_heads=4, head_k_dim=24, head_v_dim=40)


def _assert_close(x, ref, dtype):
    """fp32 (IEEE dots): elementwise. Half: the chunk path rounds q/k/W/U/Vn/S0 before its
    tensor-core dots and the gated RMSNorm magnifies that on rows of small norm, so compare the
    relative L2 error and bound the worst element."""
    x, ref = x.float(), ref.float()
    assert torch.isfinite(x).all()
    if dtype == torch.float32:
        tol = 2e-4 if DEVICE == "cpu" else 1e-3
        torch.testing.assert_close(x, ref, rtol=tol, atol=tol)
        return
    rel = ((x - ref).norm() / ref.norm()).item()
    worst = (x - ref).abs().max().item() / ref.abs().max().item()
    assert rel < 5e-3 and worst < 3e-2, f"relative L2 error {rel:.2e}, worst element {worst:.2e}"


def _inputs(T, dims, dtype, seed, decay="mixed", state_scale=0.5, kc=4):
    """(qkv raw projection, z, b, a, conv_w, conv_state, A_log, dt_bias, state, norm_w), both
    states random (a later turn)."""
    hk, hv, dk, dv = dims["num_k_heads"], dims["num_v_heads"], dims["head_k_dim"], dims["head_v_dim"]
    cd = 2 * hk * dk + hv * dv
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, cd, generator=g)
    conv_w = torch.randn(cd, kc, generator=g) * 0.5
    conv_state = torch.randn(cd, kc - 1, generator=g)
    z = torch.randn(T, hv * dv, generator=g)
    b = torch.randn(T, hv, generator=g) * 2
    a = torch.randn(T, hv, generator=g) * 2
    if decay == "mixed":        # A in (0.5, 16) as at init: from almost no decay to strong decay
        A_log = torch.log(torch.empty(hv).uniform_(0.5, 16, generator=g))
    elif decay == "strong":     # g ~ -100 per token: exp of a cumulative sum would underflow/overflow
        A_log = torch.full((hv,), math.log(60.0))
        a = a.abs() + 2
    else:                       # "none": g ~ 0, the delta rule alone
        A_log = torch.full((hv,), -30.0)
    dt_bias = torch.randn(hv, generator=g) * 0.5
    norm_w = torch.rand(dv, generator=g) + 0.5
    state = torch.randn(hv, dk, dv, generator=g) * state_scale
    cast = lambda t: t.to(DEVICE, dtype)
    return (cast(qkv), cast(z), cast(b), cast(a), cast(conv_w), cast(conv_state), A_log.to(DEVICE),
            cast(dt_bias), state.to(DEVICE), norm_w.to(DEVICE))


def _run(fn, inputs, dims, eps=1e-6, **kw):
    """(out, recurrent state, conv state) after fn, run on copies of the inputs' states."""
    qkv, z, b, a, conv_w, conv_state, A_log, dt_bias, state, norm_w = inputs
    st, cst = state.clone(), conv_state.clone()
    out = torch.full_like(z, float("nan"))
    fn(qkv, z, b, a, conv_w, cst, A_log, dt_bias, st, norm_w, out, eps=eps, **dims, **kw)
    return out, st, cst


def _rows(inputs, lo, hi, conv_state=None, state=None):
    """The inputs of rows lo..hi-1, continuing from the given states (default the inputs')."""
    qkv, z, b, a, conv_w, cst, A_log, dt_bias, st, norm_w = inputs
    return (qkv[lo:hi], z[lo:hi], b[lo:hi], a[lo:hi], conv_w, cst if conv_state is None else conv_state,
            A_log, dt_bias, st if state is None else state, norm_w)


def _check(inputs, dims, dtype, **kw):
    out, st, cst = _run(gdn_prefill, inputs, dims, **kw)
    ref, st_ref, cst_ref = _run(gdn_prefill_ref, inputs, dims, t_dev=kw.get("t_dev"))
    _assert_close(out, ref, dtype)
    _assert_close(st, st_ref, dtype)
    assert torch.equal(cst, cst_ref)                      # the conv state is copied, not computed
    return out, st, cst


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", T_LIST)
def test_gdn_chunked_equals_recurrence(T, dtype):
    _check(_inputs(T, SMALL, dtype, seed=T), SMALL, dtype)


@pytest.mark.parametrize("seed", [6, 7])
def test_gdn_state_decays_by_the_stored_cumulative_gate(seed):
    """The keys' decay to the chunk end and the state's decay use one gamma_last: with two sums
    of the gates in different orders the state drifted 3e-4 (seeds 6, 7) under the mix of
    strong and weak decays; one value keeps it at fp32 rounding."""
    inputs = _inputs(63, SMALL, torch.float32, seed=seed)
    _, st, _ = _run(gdn_prefill, inputs, SMALL)
    _, st_ref, _ = _run(gdn_prefill_ref, inputs, SMALL)
    torch.testing.assert_close(st, st_ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("decay", ["strong", "none"])
@pytest.mark.parametrize("T", [65, 130])
def test_gdn_decay_extremes(T, decay):
    """Strong decay (|cumsum g| ~ 1e4 in a chunk) stays finite; no decay exercises the pure delta rule."""
    _check(_inputs(T, SMALL, torch.float32, seed=7, decay=decay), SMALL, torch.float32)


@pytest.mark.parametrize("chunk", [pytest.param(16, marks=pytest.mark.slow), 32])
def test_gdn_smaller_chunks(chunk):
    inputs = _inputs(70, SMALL, torch.float32, seed=3)
    out, st, _ = _check(inputs, SMALL, torch.float32, chunk=chunk)
    out64, st64, _ = _run(gdn_prefill, inputs, SMALL)
    _assert_close(out, out64, torch.float32)
    _assert_close(st, st64, torch.float32)


@pytest.mark.parametrize("bv", [16, 32, 64])
def test_gdn_state_pass_v_tiles(bv):
    """The tuner's override path: the sequential state pass split into dv / BV programs."""
    inputs = _inputs(70, SMALL, torch.float32, seed=30 + bv)
    cfg = dict(BV=bv, prep_warps=4, state_warps=4, state_stages=2, out_warps=4, solve=1)
    _check(inputs, SMALL, torch.float32, config=cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,chunk", [(1, 64), (65, 64), (130, 64), (40, 32), pytest.param(40, 16, marks=pytest.mark.slow)])
def test_gdn_batched_block_solve(T, chunk, dtype):
    """solve = 2 (the diagonal blocks inverted as a batch of 16 x 16) against the reference,
    and against solve = 1 to summation-order noise."""
    inputs = _inputs(T, SMALL, dtype, seed=50 + T)
    cfg = dict(BV=16, prep_warps=4, state_warps=4, state_stages=2, out_warps=4)
    out, st, _ = _check(inputs, SMALL, dtype, chunk=chunk, config=dict(cfg, solve=2))
    out1, st1, _ = _run(gdn_prefill, inputs, SMALL, chunk=chunk, config=dict(cfg, solve=1))
    _assert_close(out, out1, dtype)
    _assert_close(st, st1, dtype)


_BASE_CFG = dict(BV=16, prep_warps=4, state_warps=4, state_stages=2, out_warps=4, solve=1)


@pytest.mark.parametrize("T,t,solve", [(64, 0, 1), (64, 40, 1), (128, 65, 1), (130, 129, 1), (64, 40, 2),
                                       (128, 17, 2)])
def test_gdn_padding_rows_are_inert_override(T, t, solve):
    """Rows >= t_dev[0] stay inert with a config override: the t real rows alone, pad outputs 0."""
    cfg = dict(_BASE_CFG, solve=solve)
    inputs = _inputs(T, SMALL, torch.float32, seed=T + t + 7)
    t_dev = torch.tensor([t], dtype=torch.int32, device=DEVICE)
    out, st, cst = _check(inputs, SMALL, torch.float32, t_dev=t_dev, config=cfg)
    assert torch.all(out[t:] == 0)
    if t:
        alone, st_alone, cst_alone = _run(gdn_prefill, _rows(inputs, 0, t), SMALL, config=cfg)
        _assert_close(out[:t], alone, torch.float32)
        _assert_close(st, st_alone, torch.float32)
        assert torch.equal(cst, cst_alone)
    else:
        assert torch.equal(st, inputs[8]) and torch.equal(cst, inputs[5])


@pytest.mark.parametrize("bv,solve,chunk", [(32, 2, 64), (64, 1, 64), (16, 2, 32)])
def test_gdn_other_knobs(bv, solve, chunk):
    """Wider V tiles, the batched block solve, a smaller chunk."""
    inputs = _inputs(70, SMALL, torch.float32, seed=bv + solve + chunk)
    _check(inputs, SMALL, torch.float32, chunk=chunk, config=dict(_BASE_CFG, BV=bv, solve=solve))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gdn_model_head_dims(dtype):
    """The model's head dims (dk = dv = 128) at a small head count; in fp16 the prepare's W and
    U dots take Tinv and their right sides rounded to the dtype (WU_ACT: dims >= 64 only)."""
    assert gdn_mod.WU_ACT_MIN_DIM <= 128
    dims = dict(num_k_heads=2, num_v_heads=2, head_k_dim=128, head_v_dim=128)
    _check(_inputs(66, dims, dtype, seed=13), dims, dtype, config=dict(_BASE_CFG, BV=32))


def test_gdn_config_reads_the_table(tmp_path):
    """gdn_config: an entry of exactly GDN_KEYS is taken as it is; one with other keys (a
    retired knob) is not; no entry: the built-in config."""
    import json
    from tritonchat.kernels import gdn_chunk
    from tritonchat.kernels.gemm import clear_tuning_cache
    entry = dict(BV=32, prep_warps=4, state_warps=4, state_stages=3, out_warps=4, solve=2)
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"version": 1, "configs": {
        gdn_chunk.gdn_kernel_name(4, 24, 40): {"2048": entry, "8192": dict(entry, state_form=2)}}}))
    clear_tuning_cache()
    try:
        builtin = gdn_chunk.gdn_config(4, 24, 40, 2048, None)
        assert set(builtin) == set(gdn_chunk.GDN_KEYS) and builtin != entry
        assert gdn_chunk.gdn_config(4, 24, 40, 2048, str(path)) == entry
        assert gdn_chunk.gdn_config(4, 24, 40, 8192, str(path)) == builtin
    finally:
        clear_tuning_cache()


def test_gdn_power_of_two_heads_ungrouped():
    """The model's own layout (Hk = Hv, dk = dv = 128) at a small head count."""
    dims = dict(num_k_heads=2, num_v_heads=2, head_k_dim=128, head_v_dim=128)
    _check(_inputs(66, dims, torch.float32, seed=11), dims, torch.float32)


def test_gdn_group_of_four_tiny_dims():
    dims = dict(num_k_heads=1, num_v_heads=4, head_k_dim=8, head_v_dim=12)
    _check(_inputs(40, dims, torch.float32, seed=12), dims, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [(64, 1), (63, 2), (2, 65), pytest.param((1, 64), marks=pytest.mark.slow),
                                   pytest.param((3, 130), marks=pytest.mark.slow)])
def test_gdn_continuation_equals_one_prefill(split, dtype):
    """prefill(x1) then prefill(x2) from its final states == prefill([x1 | x2]) (a later turn,
    or the next PREFILL_CHUNK): x2's first rows convolve x1's last inputs, read from the conv
    state, and the padded rows of x1's last chunk must not leak into the states handed over."""
    t1, t2 = split
    inputs = _inputs(t1 + t2, SMALL, dtype, seed=t1 + 100 * t2)
    whole, st_whole, cst_whole = _run(gdn_prefill, inputs, SMALL)
    out1, st1, cst1 = _run(gdn_prefill, _rows(inputs, 0, t1), SMALL)
    out2, st2, cst2 = _run(gdn_prefill, _rows(inputs, t1, t1 + t2, cst1, st1), SMALL)
    _assert_close(torch.cat([out1, out2]), whole, dtype)
    _assert_close(st2, st_whole, dtype)
    assert torch.equal(cst2, cst_whole)


@pytest.mark.parametrize("T,t", [(64, 0), (64, 1), (64, 2), (64, 40), (128, 63), (128, 64), (128, 65),
                                 (128, 128), pytest.param(192, 130, marks=pytest.mark.slow)])
def test_gdn_padding_rows_are_inert(T, t):
    """Rows >= t_dev[0] are padding: the states and the real rows' outputs are those of the t
    real rows alone (reference, and the kernel without padding), the pad rows' outputs 0."""
    inputs = _inputs(T, SMALL, torch.float32, seed=T + t)
    t_dev = torch.tensor([t], dtype=torch.int32, device=DEVICE)
    out, st, cst = _check(inputs, SMALL, torch.float32, t_dev=t_dev)
    assert torch.all(out[t:] == 0)
    if t:
        alone, st_alone, cst_alone = _run(gdn_prefill, _rows(inputs, 0, t), SMALL)
        _assert_close(out[:t], alone, torch.float32)
        _assert_close(st, st_alone, torch.float32)
        assert torch.equal(cst, cst_alone)
    else:
        assert torch.equal(st, inputs[8]) and torch.equal(cst, inputs[5])


def test_gdn_padding_count_past_the_rows_reads_as_all():
    """t_dev[0] > T reads as T."""
    inputs = _inputs(20, SMALL, torch.float32, seed=4)
    out, st, cst = _check(inputs, SMALL, torch.float32,
                          t_dev=torch.tensor([50], dtype=torch.int32, device=DEVICE))
    alone, st_alone, cst_alone = _run(gdn_prefill, inputs, SMALL)
    assert torch.equal(out, alone) and torch.equal(st, st_alone) and torch.equal(cst, cst_alone)


@pytest.mark.parametrize("kc", [2, 3, 5])
@pytest.mark.parametrize("T", [1, 3, 65])
def test_gdn_conv_kernel_sizes(T, kc):
    _check(_inputs(T, SMALL, torch.float32, seed=10 * kc + T, kc=kc), SMALL, torch.float32)


def test_conv_reference_is_pytorch_conv1d():
    """The conv reference equals F.conv1d (cross-correlation, left padding Kc-1) + SiLU on a
    zero state, and keeps the last Kc-1 inputs."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 16, generator=g).to(DEVICE)
    w = (torch.randn(16, 4, generator=g) * 0.5).to(DEVICE)
    st = torch.zeros(16, 3, device=DEVICE)
    ref = gdn_conv_ref(x, w, st)
    y = F.conv1d(x.t()[None], w[:, None, :], padding=3, groups=16)[0, :, :37].t()
    torch.testing.assert_close(ref, F.silu(y), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st, x[-3:].t())


def test_gdn_strided_views_of_merged_projections():
    """qkv, b, a, z as column views of one merged projection output [qkv | b | a | z] (the
    engine's layout), out a column view of a wider buffer."""
    T = 70
    inputs = _inputs(T, SMALL, torch.float32, seed=21)
    qkv, z, b, a, conv_w, cst, A_log, dt_bias, st, norm_w = inputs
    hv, cd = SMALL["num_v_heads"], qkv.shape[1]
    proj = torch.cat([qkv, b, a, z], dim=1)
    views = (proj[:, :cd], proj[:, cd + 2 * hv:], proj[:, cd:cd + hv], proj[:, cd + hv:cd + 2 * hv])
    out_buf = torch.zeros(T, z.shape[1] + 6, device=DEVICE)
    ref, st_ref, cst_ref = _run(gdn_prefill_ref, inputs, SMALL)
    st, cst = st.clone(), cst.clone()
    gdn_prefill(*views, conv_w, cst, A_log, dt_bias, st, norm_w, out_buf[:, 3:3 + z.shape[1]],
                eps=1e-6, **SMALL)
    _assert_close(out_buf[:, 3:3 + z.shape[1]], ref, torch.float32)
    _assert_close(st, st_ref, torch.float32)
    assert torch.equal(cst, cst_ref)
    assert torch.all(out_buf[:, :3] == 0) and torch.all(out_buf[:, 3 + z.shape[1]:] == 0)


def test_reference_matches_transformers():
    """The recurrent reference against HF's own fp32 recurrence + RMSNormGated (the oracle),
    on the conv reference's output (itself checked against F.conv1d above)."""
    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    T = 9
    dims = SMALL
    hk, hv, dk, dv = 2, 4, 24, 40
    inputs = _inputs(T, dims, torch.float32, seed=5)
    qkv, z, b, a, conv_w, conv_state, A_log, dt_bias, state, norm_w = inputs
    ref, st_ref, _ = _run(gdn_prefill_ref, inputs, dims)
    x = gdn_conv_ref(qkv, conv_w, conv_state.clone())
    q = x[:, :hk * dk].view(1, T, hk, dk)
    k = x[:, hk * dk:2 * hk * dk].view(1, T, hk, dk)
    v = x[:, 2 * hk * dk:].view(1, T, hv, dv)
    beta, g = gdn_gates_ref(b, a, A_log, dt_bias)
    core, st_hf = mod.torch_recurrent_gated_delta_rule(
        q, k, v, g[None], beta[None], initial_state=state[None].clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    norm = mod.Qwen3_5RMSNormGated(dv, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(norm_w)
        hf = norm(core[0].reshape(T * hv, dv), z.view(T * hv, dv)).view(T, hv * dv)
    torch.testing.assert_close(ref, hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st_ref, st_hf[0], rtol=1e-5, atol=1e-5)


def test_gdn_rejects_bad_arguments():
    inputs = _inputs(5, SMALL, torch.float32, seed=0)
    qkv, z, b, a, conv_w, cst, A_log, dt_bias, state, norm_w = inputs
    out = torch.empty_like(z)
    kw = dict(eps=1e-6, **SMALL)
    with pytest.raises(ValueError):
        gdn_prefill(qkv, z, b, a, conv_w, cst, A_log, dt_bias, state.half(), norm_w, out, **kw)
    with pytest.raises(ValueError):
        gdn_prefill(qkv[:, 1:], z, b, a, conv_w, cst, A_log, dt_bias, state, norm_w, out, **kw)
    with pytest.raises(ValueError):
        gdn_prefill(qkv, z, b, a, conv_w, cst, A_log, dt_bias, state, norm_w, out, chunk=48, **kw)
    with pytest.raises(ValueError):
        gdn_prefill(qkv, z, b, a, conv_w, cst, A_log, dt_bias, state, norm_w, out,
                    **dict(kw, num_v_heads=3))
    with pytest.raises(ValueError):
        gdn_prefill(qkv, z, b, a, conv_w, cst[:, :2].contiguous(), A_log, dt_bias, state, norm_w, out, **kw)
    with pytest.raises(TypeError):
        gdn_prefill(qkv, z, b, a, conv_w.half(), cst, A_log, dt_bias, state, norm_w, out, **kw)
    with pytest.raises(ValueError):
        gdn_prefill(qkv, z, b, a, conv_w, cst, A_log, dt_bias, state, norm_w, out, config=dict(
            BV=16, prep_warps=4, state_warps=4, state_stages=2, out_warps=4, solve=3), **kw)
    with pytest.raises(ValueError):                                         # t_dev must be int32
        gdn_prefill(qkv, z, b, a, conv_w, cst, A_log, dt_bias, state, norm_w, out,
                    t_dev=torch.tensor([3], device=DEVICE), **kw)


def _run_pdl(inputs, dims, cfg, pdl, t_dev=None):
    """_run of gdn_prefill with `pdl`, its launches checked: those gdn_launches names, in
    order, each a PDL launch of mode pdl."""
    with launches(gdn_mod) as seen:
        got = _run(gdn_prefill, inputs, dims, config=cfg, t_dev=t_dev, pdl=pdl)
    assert [k for k, _, _ in seen] == [k.fn.__name__ for _, k in gdn_launches()]
    assert all(mode == pdl and asked == bool(pdl) for _, mode, asked in seen), seen
    return got


@pytest.mark.parametrize("pdl,t,solve", [(1, None, 1), (2, 50, 1), (1, 50, 2), (2, None, 2)])
def test_gdn_pdl_modes_give_the_same_bits(pdl, t, solve):
    """pdl 1 / 2 (weights loaded or sent to L2 before the wait) leaves the output and both
    states pdl 0 leaves, with and without padding rows; other pdl values are refused."""
    inputs = _inputs(70, SMALL, torch.float32, seed=pdl + 4)
    cfg = dict(_BASE_CFG, solve=solve)
    t_dev = None if t is None else torch.tensor([t], dtype=torch.int32, device=DEVICE)
    plain = _run_pdl(inputs, SMALL, cfg, 0, t_dev)
    got = _run_pdl(inputs, SMALL, cfg, pdl, t_dev)
    for x, want in zip(got, plain):
        assert torch.equal(x, want)
    for bad in (3, -1):
        with pytest.raises(ValueError):
            _run(gdn_prefill, inputs, SMALL, pdl=bad)


# ------------------------------------------------------------------------------------------
# GPU twins: bf16, the true 0.8B GDN shape (16 heads, dk = dv = 128, conv_dim 6144, Kc = 4)
# ------------------------------------------------------------------------------------------
TRUE = dict(num_k_heads=16, num_v_heads=16, head_k_dim=128, head_v_dim=128)


def _rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def _check_bf16(inputs, dims, cfg, t_dev=None):
    """bf16 on the device against the fp32 reference: finite, the conv state exact, the real
    rows' output within 1e-2 and the state within 5e-3 relative L2 error. (A torch emulation
    of this kernel's bf16 rounding points gives 5.5e-3 / 2.4e-3 at the true shape, T = 2048.)
    Returns the kernel's output and the reference's."""
    out, st, cst = _run(gdn_prefill, inputs, dims, config=cfg, t_dev=t_dev)
    ref, st_ref, cst_ref = _run(gdn_prefill_ref, inputs, dims, t_dev=t_dev)  # fp32, output rounded
    assert torch.isfinite(out).all() and torch.isfinite(st).all()
    assert torch.equal(cst, cst_ref)
    n = out.shape[0] if t_dev is None else int(t_dev[0])
    assert _rel_err(out[:n], ref[:n]) < 1e-2, _rel_err(out[:n], ref[:n])
    assert _rel_err(st, st_ref) < 5e-3, _rel_err(st, st_ref)
    return out, ref


@pytest.mark.gpu
@pytest.mark.parametrize("T,solve", [(2048, None), (32768, None), (2048, 1), (2048, 2)])
def test_gdn_true_shape_bf16(T, solve):
    """The table's config (solve None) and each form of the inverse; the worst element (1.7e-2
    of the largest in the emulation) too."""
    cfg = None if solve is None else dict(gdn_mod.gdn_config(16, 128, 128, T), solve=solve)
    out, ref = _check_bf16(_inputs(T, TRUE, torch.bfloat16, seed=T), TRUE, cfg)
    assert (out.float() - ref.float()).abs().max().item() < 5e-2 * ref.float().abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [SMALL, dict(SMALL, head_k_dim=16, head_v_dim=24),
                                  dict(num_k_heads=1, num_v_heads=1, head_k_dim=64, head_v_dim=64)],
                         ids=["24x40", "16x24", "64x64"])
@pytest.mark.parametrize("t,solve", [(None, 1), (None, 2), (100, 1)])
def test_gdn_small_head_dims_bf16(dims, t, solve):
    """bf16 on the device at head dims below and at WU_ACT_MIN_DIM (grouped value heads, dims
    not powers of two), plain and padded. (The bf16 W / U form gave NaN at 16 x 24 here,
    which only a GPU compile shows.)"""
    T = 130
    cfg = dict(gdn_mod.gdn_config(dims["num_v_heads"], dims["head_k_dim"], dims["head_v_dim"], T),
               solve=solve)
    t_dev = None if t is None else torch.tensor([t], dtype=torch.int32, device=DEVICE)
    _check_bf16(_inputs(T, dims, torch.bfloat16, seed=dims["head_k_dim"] + dims["head_v_dim"]),
                dims, cfg, t_dev)


@pytest.mark.gpu
def test_gdn_padded_true_shape_bf16():
    """The prefill graph's form: 2,048 rows of which 1,500 are real, equal to the 1,500 alone."""
    T, t = 2048, 1500
    inputs = _inputs(T, TRUE, torch.bfloat16, seed=9)
    out, st, cst = _run(gdn_prefill, inputs, TRUE, t_dev=torch.tensor([t], dtype=torch.int32, device=DEVICE))
    alone, st_alone, cst_alone = _run(gdn_prefill, _rows(inputs, 0, t), TRUE)
    assert torch.all(out[t:] == 0)
    assert _rel_err(out[:t], alone) < 1e-3 and _rel_err(st, st_alone) < 1e-3
    assert torch.equal(cst, cst_alone)


@pytest.mark.gpu
@pytest.mark.parametrize("T,t,solve", [(128, 100, 1), (2048, None, 1), (128, 100, 2), (2048, None, 2)])
def test_gdn_pdl_true_shape_bf16_gives_the_same_bits(T, t, solve):
    """On the device: the true shape with PDL (its launches overlapping each other's tails)
    leaves the bits it leaves without PDL, padded and not."""
    pdl = pdl_mode(True, False, DEVICE)
    assert pdl
    cfg = dict(_BASE_CFG, BV=16, solve=solve)
    t_dev = None if t is None else torch.tensor([t], dtype=torch.int32, device=DEVICE)
    inputs = _inputs(T, TRUE, torch.bfloat16, seed=T)
    want = _run(gdn_prefill, inputs, TRUE, config=cfg, t_dev=t_dev)
    for _ in range(2):
        for x, w in zip(_run(gdn_prefill, inputs, TRUE, config=cfg, t_dev=t_dev, pdl=pdl), want):
            assert torch.equal(x, w)
