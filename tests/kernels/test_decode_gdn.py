"""Gated DeltaNet decode kernel vs the reference over consecutive steps: output, conv state and
recurrent state, on grouped value heads, dk != dv, non-power-of-two head sizes."""
import pytest
import torch

from tritonchat.kernels.gdn_decode import gdn_decode
from tritonchat.kernels.reference import gdn_decode_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# bf16 only on the GPU: the interpreter rounds fp32 -> bf16 toward zero at each of the kernel's
# rounding points, where the reference (and the GPU) round to nearest even.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])

# (num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv kernel)
CONFIGS = [
    (2, 4, 24, 40, 4),     # Hv = 2 Hk, dk != dv, neither a power of two
    (1, 4, 16, 8, 4),      # Hv = 4 Hk, dv < dk
    (3, 3, 16, 16, 3),     # no grouping, odd head count, kernel 3
    (2, 2, 32, 32, 4),     # power-of-two heads: the unmasked tiles
    (1, 1, 8, 12, 2),      # kernel 2: a one-column conv state
]


def _q(t, scale=16):
    """Round to multiples of 1/scale: the conv's fp32 sums are then exact in any order."""
    return torch.round(t * scale) / scale


def _layer(hk, hv, dk, dv, kw, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    conv_w = _q(torch.randn(conv_dim, kw, generator=g) * 0.5).to(DEVICE, dtype)
    conv_state = _q(torch.randn(conv_dim, kw - 1, generator=g)).to(DEVICE, dtype)
    A_log = (torch.randn(hv, generator=g) * 0.5).to(DEVICE)
    dt_bias = torch.randn(hv, generator=g).to(DEVICE, dtype)
    state = (torch.randn(hv, dk, dv, generator=g) * 0.1).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(dv, generator=g)).to(DEVICE)
    return conv_w, conv_state, A_log, dt_bias, state, norm_w, g


def _token(hk, hv, dk, dv, dtype, g, step):
    conv_dim = 2 * hk * dk + hv * dv
    qkvz = _q(torch.randn(conv_dim + hv * dv, generator=g) * 2).to(DEVICE, dtype)
    ba = torch.randn(2 * hv, generator=g) * 2
    ba[hv + step % hv] = 25.0 if step % 2 == 0 else -25.0     # softplus: linear / e^x tails
    return qkvz, ba.to(DEVICE, dtype)


def _tol(dtype):
    # (out, state) tolerances. fp32: order noise. half: a rounding of an fp32 value to the
    # dtype may land one ulp apart (transcendentals differ in the last fp32 bit).
    if dtype == torch.float32:
        return dict(rtol=2e-5, atol=2e-5), dict(rtol=2e-5, atol=2e-5)
    if dtype == torch.float16:
        return dict(rtol=4e-3, atol=4e-3), dict(rtol=2e-3, atol=2e-3)
    return dict(rtol=1.6e-2, atol=1.6e-2), dict(rtol=1e-2, atol=1e-2)


def _run_steps(cfg, dtype, steps, seed=0):
    hk, hv, dk, dv, kw = cfg
    conv_w, conv_state, A_log, dt_bias, state, norm_w, g = _layer(hk, hv, dk, dv, kw, dtype, seed)
    ref_conv, ref_state = conv_state.clone(), state.clone()
    out_tol, state_tol = _tol(dtype)
    kwargs = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, eps=EPS)
    for step in range(steps):
        qkvz, ba = _token(hk, hv, dk, dv, dtype, g, step)
        want, ref_conv, ref_state = gdn_decode_ref(qkvz, ba, ref_conv, conv_w, A_log, dt_bias,
                                                   ref_state, norm_w, **kwargs)
        out = torch.full((hv * dv,), float("nan"), device=DEVICE, dtype=dtype)
        gdn_decode(qkvz, ba, conv_state, conv_w, A_log, dt_bias, state, norm_w, out, **kwargs)
        assert torch.equal(conv_state, ref_conv), f"conv state differs at step {step}"
        torch.testing.assert_close(state, ref_state, **state_tol)
        torch.testing.assert_close(out, want, **out_tol)
        # keep the two recurrences on the same trajectory (half-precision rounding flips
        # would otherwise compound over the steps)
        state.copy_(ref_state)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "hk{}hv{}dk{}dv{}k{}".format(*c))
def test_gdn_decode_steps(cfg, dtype):
    _run_steps(cfg, dtype, steps=3)


def test_gdn_decode_from_zero_state_and_conv_nn_layout():
    # a fresh conversation (zero states) and the checkpoint's [C, 1, Kc] conv weight layout
    hk, hv, dk, dv, kw = 2, 4, 24, 40, 4
    conv_w, conv_state, A_log, dt_bias, state, norm_w, g = _layer(hk, hv, dk, dv, kw,
                                                                  torch.float32, 5)
    conv_state.zero_()
    state.zero_()
    qkvz, ba = _token(hk, hv, dk, dv, torch.float32, g, 0)
    kwargs = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, eps=EPS)
    want, want_conv, want_state = gdn_decode_ref(qkvz, ba, conv_state, conv_w, A_log, dt_bias,
                                                 state, norm_w, **kwargs)
    out = torch.empty(hv * dv, device=DEVICE)
    gdn_decode(qkvz, ba, conv_state, conv_w.unsqueeze(1), A_log, dt_bias, state, norm_w, out,
               **kwargs)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(state, want_state, rtol=2e-5, atol=2e-5)
    assert torch.equal(conv_state, want_conv)


def test_gdn_decode_ref_matches_prefill_reference():
    """The decode reference and the prefill reference (T=1) are written independently from the
    same spec; they must agree, so prefill hands over to decode without a seam."""
    pre = pytest.importorskip("tritonchat.kernels.prefill_reference")
    hk, hv, dk, dv, kw = 2, 4, 24, 40, 4
    dtype = torch.float16
    conv_w, conv_state, A_log, dt_bias, state, norm_w, g = _layer(hk, hv, dk, dv, kw, dtype, 3)
    qkvz, ba = _token(hk, hv, dk, dv, dtype, g, 1)
    kwargs = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, eps=EPS)
    want, want_conv, want_state = gdn_decode_ref(qkvz, ba, conv_state, conv_w, A_log, dt_bias,
                                                 state, norm_w, **kwargs)
    conv_dim = 2 * hk * dk + hv * dv
    x = torch.empty(1, conv_dim, device=DEVICE, dtype=dtype)
    cs, st = conv_state.clone(), state.clone()
    pre.causal_conv1d_ref(qkvz[:conv_dim].view(1, -1), conv_w, cs, x)
    out = torch.empty(1, hv * dv, device=DEVICE, dtype=dtype)
    pre.gdn_prefill_ref(x, qkvz[conv_dim:].view(1, -1), ba[:hv].view(1, -1),
                        ba[hv:].view(1, -1), A_log, dt_bias, st, norm_w, out, **kwargs)
    assert torch.equal(cs, want_conv)
    torch.testing.assert_close(st, want_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.view(-1), want, rtol=2e-3, atol=2e-3)


def test_gdn_decode_validates():
    hk, hv, dk, dv, kw = 2, 4, 8, 8, 4
    conv_w, conv_state, A_log, dt_bias, state, norm_w, g = _layer(hk, hv, dk, dv, kw,
                                                                  torch.float32, 0)
    qkvz, ba = _token(hk, hv, dk, dv, torch.float32, g, 0)
    out = torch.empty(hv * dv, device=DEVICE)
    kwargs = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, eps=EPS)
    with pytest.raises(ValueError):
        gdn_decode(qkvz[:-1], ba, conv_state, conv_w, A_log, dt_bias, state, norm_w, out,
                   **kwargs)
    with pytest.raises(ValueError):
        gdn_decode(qkvz, ba, conv_state, conv_w, A_log, dt_bias, state.transpose(1, 2), norm_w,
                   out, **kwargs)
    with pytest.raises(ValueError):
        gdn_decode(qkvz, ba, conv_state, conv_w, A_log, dt_bias, state.half(), norm_w, out,
                   **kwargs)
    with pytest.raises(ValueError):
        gdn_decode(qkvz, ba, conv_state, conv_w, A_log, dt_bias, state, norm_w, out,
                   **{**kwargs, "num_v_heads": 3})


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [(16, 16, 128, 128, 4), (8, 32, 128, 128, 4)],
                         ids=["qwen35-0.8b", "grouped-4x"])
def test_gpu_gdn_decode_model_shape(cfg):
    _run_steps(cfg, torch.bfloat16, steps=4, seed=1)
