"""kernels/rms_norm.py against reference.rms_norm_ref: one row, one element, odd widths; the
PDL modes give the same bits."""
import pytest
import torch

from tests.kernels.util import launches
from tritonchat.kernels import rms_norm as rms_norm_mod
from tritonchat.kernels.reference import rms_norm_ref
from tritonchat.kernels.rms_norm import rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def _tol(dtype):
    # one rounding at the end; bf16 gets two ulps (the interpreter truncates to bf16, and the
    # residual-fused form normalises an already truncated residual)
    return {torch.float32: (2e-6, 1e-6), torch.float16: (1e-3, 1e-3),
            torch.bfloat16: (1.6e-2, 1.6e-2)}[dtype]


def _data(T, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=g) * 3).to(DEVICE, dtype)
    res = torch.randn(T, D, generator=g).to(DEVICE, dtype)
    w = (torch.randn(D, generator=g) * 0.2).to(DEVICE, dtype)
    return x, res, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D", [(1, 80), (3, 33), (2, 1024), (1, 1)])
def test_rms_norm(T, D, dtype):
    x, _, w = _data(T, D, dtype, seed=D)
    out = torch.full_like(x, float("nan"))
    rms_norm(x, w, EPS, out)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out, rms_norm_ref(x, w, EPS), rtol=rtol, atol=atol)
    # the reference is the textbook formula: y = x / rms(x) * (1 + w)
    x64 = x.double()
    textbook = x64 / x64.pow(2).mean(-1, keepdim=True).add(EPS).sqrt() * (1 + w.double())
    torch.testing.assert_close(rms_norm_ref(x, w, EPS).double(), textbook, rtol=2e-2, atol=2e-2)


def test_norm_validates():
    x, res, w = _data(2, 16, torch.float32, seed=0)
    with pytest.raises(ValueError):
        rms_norm(x, w[:8], EPS, torch.empty_like(x))
    with pytest.raises(ValueError):
        rms_norm(x, w, EPS, torch.empty(2, 8, device=DEVICE))


@pytest.mark.parametrize("pdl", [1, 2])
@pytest.mark.parametrize("T,D", [(1, 80), (3, 33)])
def test_rms_norm_pdl_modes_give_the_same_bits(T, D, pdl):
    """pdl 1 / 2 (the weights read before the wait) write what pdl 0 writes, and the launch
    asks for PDL with the kernel's PDL mode; other values are refused."""
    x, _, w = _data(T, D, torch.float32, seed=D + pdl)
    plain = rms_norm(x, w, EPS, torch.full_like(x, float("nan")))
    with launches(rms_norm_mod) as seen:
        out = rms_norm(x, w, EPS, torch.full_like(x, float("nan")), pdl=pdl)
    assert torch.equal(out, plain)
    assert seen == [("_rms_norm_kernel", pdl, True)]
    for bad in (3, -1):
        with pytest.raises(ValueError):
            rms_norm(x, w, EPS, torch.empty_like(x), pdl=bad)


@pytest.mark.gpu
def test_gpu_norms_model_shape():
    x, res, w = _data(1, 1024, torch.bfloat16, seed=1)
    out = torch.empty_like(x)
    rms_norm(x, w, EPS, out)
    torch.testing.assert_close(out, rms_norm_ref(x, w, EPS), rtol=8e-3, atol=8e-3)
