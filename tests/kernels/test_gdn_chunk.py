"""kernels/gdn_chunk.py: chunked Gated DeltaNet prefill (WY form) against T recurrent steps of
reference.gdn_prefill_ref."""
import math

import pytest
import torch

from tritonchat.kernels.gdn_chunk import gdn_prefill
from tritonchat.kernels.reference import gdn_gates_ref, gdn_prefill_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# length 1 and the chunk boundaries 63/64/65 in the fast run; the rest of the sweep is slow
T_LIST = [1, 63, 64, 65] + [pytest.param(t, marks=pytest.mark.slow) for t in (2, 3, 4, 127, 200)]
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


def _inputs(T, dims, dtype, seed, decay="mixed", state_scale=0.5):
    hk, hv, dk, dv = dims["num_k_heads"], dims["num_v_heads"], dims["head_k_dim"], dims["head_v_dim"]
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, 2 * hk * dk + hv * dv, generator=g)
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
    return (cast(qkv), cast(z), cast(b), cast(a), A_log.to(DEVICE), cast(dt_bias),
            state.to(DEVICE), norm_w.to(DEVICE))


def _run(fn, inputs, dims, eps=1e-6, **kw):
    qkv, z, b, a, A_log, dt_bias, state, norm_w = inputs
    st = state.clone()
    out = torch.full_like(z, float("nan"))
    fn(qkv, z, b, a, A_log, dt_bias, st, norm_w, out, eps=eps, **dims, **kw)
    return out, st


def _check(inputs, dims, dtype, **kw):
    out, st = _run(gdn_prefill, inputs, dims, **kw)
    ref, st_ref = _run(gdn_prefill_ref, inputs, dims)
    _assert_close(out, ref, dtype)
    _assert_close(st, st_ref, dtype)
    return out, st


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", T_LIST)
def test_gdn_chunked_equals_recurrence(T, dtype):
    _check(_inputs(T, SMALL, dtype, seed=T), SMALL, dtype)


@pytest.mark.parametrize("decay", ["strong", "none"])
@pytest.mark.parametrize("T", [65, 130])
def test_gdn_decay_extremes(T, decay):
    """Strong decay (|cumsum g| ~ 1e4 in a chunk) stays finite; no decay exercises the pure delta rule."""
    _check(_inputs(T, SMALL, torch.float32, seed=7, decay=decay), SMALL, torch.float32)


@pytest.mark.parametrize("chunk", [pytest.param(16, marks=pytest.mark.slow), 32])
def test_gdn_smaller_chunks(chunk):
    inputs = _inputs(70, SMALL, torch.float32, seed=3)
    out, st = _check(inputs, SMALL, torch.float32, chunk=chunk)
    out64, st64 = _run(gdn_prefill, inputs, SMALL)
    _assert_close(out, out64, torch.float32)
    _assert_close(st, st64, torch.float32)


@pytest.mark.parametrize("bv", [16, 32, 64])
def test_gdn_state_pass_v_tiles(bv):
    """The tuner's override path: the sequential state pass split into dv / BV programs."""
    inputs = _inputs(70, SMALL, torch.float32, seed=30 + bv)
    cfg = dict(BV=bv, prep_warps=4, state_warps=4, state_stages=2, out_warps=4)
    _check(inputs, SMALL, torch.float32, config=cfg)


def test_gdn_power_of_two_heads_ungrouped():
    """The model's own layout (Hk = Hv, dk = dv = 128) at a small head count."""
    dims = dict(num_k_heads=2, num_v_heads=2, head_k_dim=128, head_v_dim=128)
    _check(_inputs(66, dims, torch.float32, seed=11), dims, torch.float32)


def test_gdn_group_of_four_tiny_dims():
    dims = dict(num_k_heads=1, num_v_heads=4, head_k_dim=8, head_v_dim=12)
    _check(_inputs(40, dims, torch.float32, seed=12), dims, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [(64, 1), (63, 2), pytest.param((1, 64), marks=pytest.mark.slow),
                                   pytest.param((3, 130), marks=pytest.mark.slow)])
def test_gdn_continuation_equals_one_prefill(split, dtype):
    """prefill(x1) then prefill(x2) from its final state == prefill([x1 | x2]); the padded rows
    of x1's last chunk must not leak into the state handed over."""
    t1, t2 = split
    inputs = _inputs(t1 + t2, SMALL, dtype, seed=t1 + 100 * t2)
    whole, st_whole = _run(gdn_prefill, inputs, SMALL)
    qkv, z, b, a, A_log, dt_bias, state, norm_w = inputs
    first = (qkv[:t1], z[:t1], b[:t1], a[:t1], A_log, dt_bias, state, norm_w)
    out1, st1 = _run(gdn_prefill, first, SMALL)
    second = (qkv[t1:], z[t1:], b[t1:], a[t1:], A_log, dt_bias, st1, norm_w)
    out2, st2 = _run(gdn_prefill, second, SMALL)
    _assert_close(torch.cat([out1, out2]), whole, dtype)
    _assert_close(st2, st_whole, dtype)


def test_gdn_strided_views_of_merged_projections():
    """qkv/z and b/a as column views of the merged qkvz and ba projection outputs."""
    T = 70
    inputs = _inputs(T, SMALL, torch.float32, seed=21)
    qkv, z, b, a, A_log, dt_bias, state, norm_w = inputs
    qkvz = torch.cat([qkv, z], dim=1)
    ba = torch.cat([b, a], dim=1)
    hv = SMALL["num_v_heads"]
    views = (qkvz[:, :qkv.shape[1]], qkvz[:, qkv.shape[1]:], ba[:, :hv], ba[:, hv:], A_log, dt_bias,
             state, norm_w)
    out_buf = torch.zeros(T, z.shape[1] + 6, device=DEVICE)
    st = state.clone()
    gdn_prefill(*views[:6], st, norm_w, out_buf[:, 3:3 + z.shape[1]], eps=1e-6, **SMALL)
    ref, st_ref = _run(gdn_prefill_ref, inputs, SMALL)
    _assert_close(out_buf[:, 3:3 + z.shape[1]], ref, torch.float32)
    _assert_close(st, st_ref, torch.float32)
    assert torch.all(out_buf[:, :3] == 0) and torch.all(out_buf[:, 3 + z.shape[1]:] == 0)


def test_reference_matches_transformers():
    """The recurrent reference against HF's own fp32 recurrence + RMSNormGated (the oracle)."""
    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    T = 9
    dims = SMALL
    hk, hv, dk, dv = 2, 4, 24, 40
    inputs = _inputs(T, dims, torch.float32, seed=5)
    qkv, z, b, a, A_log, dt_bias, state, norm_w = inputs
    ref, st_ref = _run(gdn_prefill_ref, inputs, dims)
    q = qkv[:, :hk * dk].view(1, T, hk, dk)
    k = qkv[:, hk * dk:2 * hk * dk].view(1, T, hk, dk)
    v = qkv[:, 2 * hk * dk:].view(1, T, hv, dv)
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
    qkv, z, b, a, A_log, dt_bias, state, norm_w = inputs
    out = torch.empty_like(z)
    with pytest.raises(ValueError):
        gdn_prefill(qkv, z, b, a, A_log, dt_bias, state.half(), norm_w, out, eps=1e-6, **SMALL)
    with pytest.raises(ValueError):
        gdn_prefill(qkv[:, 1:], z, b, a, A_log, dt_bias, state, norm_w, out, eps=1e-6, **SMALL)
    with pytest.raises(ValueError):
        gdn_prefill(qkv, z, b, a, A_log, dt_bias, state, norm_w, out, eps=1e-6, chunk=48, **SMALL)
    with pytest.raises(ValueError):
        gdn_prefill(qkv, z, b, a, A_log, dt_bias, state, norm_w, out, eps=1e-6,
                    **dict(SMALL, num_v_heads=3))


# ------------------------------------------------------------------------------------------
# GPU twins: bf16, the true 0.8B GDN shape (16 heads, dk = dv = 128)
# ------------------------------------------------------------------------------------------
TRUE = dict(num_k_heads=16, num_v_heads=16, head_k_dim=128, head_v_dim=128)


def _rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2048, 32768])
def test_gdn_true_shape_bf16(T):
    inputs = _inputs(T, TRUE, torch.bfloat16, seed=T)
    out, st = _run(gdn_prefill, inputs, TRUE)
    ref, st_ref = _run(gdn_prefill_ref, inputs, TRUE)      # fp32 recurrence, output rounded
    assert torch.isfinite(out).all() and torch.isfinite(st).all()
    # A torch emulation of this kernel's bf16 rounding points gives 5.5e-3 / 2.4e-3 relative L2
    # error (output / state) and a worst element of 1.7e-2 of the largest at T = 2048.
    assert _rel_err(out, ref) < 1e-2, _rel_err(out, ref)
    assert _rel_err(st, st_ref) < 5e-3, _rel_err(st, st_ref)
    assert (out.float() - ref.float()).abs().max().item() < 5e-2 * ref.float().abs().max().item()
