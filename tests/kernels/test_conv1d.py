"""kernels/conv1d.py: causal depthwise conv1d + SiLU over a prompt, continuing from the decode
conv state, against reference.causal_conv1d_ref."""
import pytest
import torch
import torch.nn.functional as F

from tritonchat.kernels.conv1d import causal_conv1d
from tritonchat.kernels.reference import causal_conv1d_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# length 1 and the chunk boundaries 63/64/65 in the fast run; the rest of the sweep is slow
T_LIST = [1, 63, 64, 65] + [pytest.param(t, marks=pytest.mark.slow) for t in (2, 3, 4, 127, 200)]


def _tol(dtype):
    return (1e-5, 1e-5) if dtype == torch.float32 else (2e-3, 2e-3)


def _data(T, C, kc, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C, generator=g).to(DEVICE, dtype)
    w = (torch.randn(C, kc, generator=g) * 0.5).to(DEVICE, dtype)
    state = torch.randn(C, kc - 1, generator=g).to(DEVICE, dtype)
    return x, w, state


def _run(fn, x, w, state):
    st = state.clone()
    out = torch.full_like(x, float("nan"))
    fn(x, w, st, out)
    return out, st


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", T_LIST)
def test_conv_matches_reference(T, dtype):
    C, kc = 200, 4                     # C spans a partial channel block
    x, w, state = _data(T, C, kc, dtype, seed=T)
    out, st = _run(causal_conv1d, x, w, state)
    ref, st_ref = _run(causal_conv1d_ref, x, w, state)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(st, st_ref, rtol=0, atol=0)     # the state is copied, not computed


@pytest.mark.parametrize("kc", [2, 3, 4, 5])
@pytest.mark.parametrize("T", [1, 2, 3, 7, 65])
def test_conv_kernel_sizes(T, kc):
    x, w, state = _data(T, 24, kc, torch.float32, seed=10 * kc + T)
    out, st = _run(causal_conv1d, x, w, state)
    ref, st_ref = _run(causal_conv1d_ref, x, w, state)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st, st_ref, rtol=0, atol=0)


def test_reference_is_pytorch_conv1d():
    """The reference equals F.conv1d (cross-correlation, left padding Kc-1) on a zero state."""
    x, w, _ = _data(37, 16, 4, torch.float32, seed=3)
    ref, st = _run(causal_conv1d_ref, x, w, torch.zeros(16, 3, device=DEVICE))
    y = F.conv1d(x.t()[None], w[:, None, :], padding=3, groups=16)[0, :, :37].t()
    torch.testing.assert_close(ref, F.silu(y), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st, x[-3:].t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [(1, 1), (1, 3), (2, 2), (3, 1), (2, 65), (64, 1), (63, 2), (5, 200)])
def test_conv_continuation_equals_concatenation(split, dtype):
    """conv(x1) then conv(x2) from the carried state == conv([x1 | x2]) from the first state."""
    t1, t2 = split
    C, kc = 72, 4
    x, w, state = _data(t1 + t2, C, kc, dtype, seed=t1 * 1000 + t2)
    whole, st_whole = _run(causal_conv1d, x, w, state)
    first, st1 = _run(causal_conv1d, x[:t1].contiguous(), w, state)
    second, st2 = _run(causal_conv1d, x[t1:].contiguous(), w, st1)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=rtol, atol=atol)
    torch.testing.assert_close(st2, st_whole, rtol=0, atol=0)
    tail = torch.cat([state.t(), x])[-(kc - 1):].t()
    torch.testing.assert_close(st_whole, tail, rtol=0, atol=0)


def test_conv_strided_rows():
    """x and out may be column slices of wider buffers (the merged qkvz projection)."""
    T, C = 33, 40
    xb, w, state = _data(T, C + 11, 4, torch.float32, seed=5)
    w = w[:C].contiguous()
    state = state[:C].contiguous()
    x = xb[:, 4:4 + C]
    ob = torch.zeros(T, C + 3, device=DEVICE)
    st = state.clone()
    causal_conv1d(x, w, st, ob[:, 1:1 + C])
    ref, st_ref = _run(causal_conv1d_ref, x.contiguous(), w, state)
    torch.testing.assert_close(ob[:, 1:1 + C], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st, st_ref)
    assert torch.all(ob[:, 0] == 0) and torch.all(ob[:, 1 + C:] == 0)


def test_conv_rejects_bad_arguments():
    x, w, state = _data(8, 16, 4, torch.float32, 0)
    with pytest.raises(ValueError):
        causal_conv1d(x, w, state[:, :2].contiguous(), torch.empty_like(x))
    with pytest.raises(TypeError):
        causal_conv1d(x, w.half(), state, torch.empty_like(x))
    with pytest.raises(ValueError):
        causal_conv1d(x, w, state, x)                      # in place would race across blocks


@pytest.mark.parametrize("cfg", [
    dict(BLOCK_T=4, BLOCK_C=16, ROW_TILES=3, num_warps=1),      # several row tiles per program
    dict(BLOCK_T=2, BLOCK_C=32, ROW_TILES=2, num_warps=2),      # tile 0 shorter than Kc-1: widened
    dict(BLOCK_T=64, BLOCK_C=64, ROW_TILES=1, num_warps=4),
])
@pytest.mark.parametrize("T", [1, 2, 5, 13, 40])
def test_conv_explicit_configs(cfg, T):
    """The tuner's override path: row tiles, a last program with a partial run of tiles."""
    x, w, state = _data(T, 40, 4, torch.float32, seed=T)
    st = state.clone()
    out = torch.full_like(x, float("nan"))
    causal_conv1d(x, w, st, out, config=cfg)
    ref, st_ref = _run(causal_conv1d_ref, x, w, state)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st, st_ref, rtol=0, atol=0)


@pytest.mark.gpu
def test_conv_true_shape_bf16():
    T, C, kc = 2048, 6144, 4
    x, w, state = _data(T, C, kc, torch.bfloat16, seed=1)
    out, st = _run(causal_conv1d, x, w, state)
    ref, st_ref = _run(causal_conv1d_ref, x, w, state)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(st, st_ref, rtol=0, atol=0)
