"""Zero-centred RMSNorm (plain and residual-fused) and the embedding gather vs the references."""
import pytest
import torch

from tritonchat.kernels.embedding import embedding_gather
from tritonchat.kernels.reference import embedding_gather_ref, rms_norm_ref
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


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("T,V,D", [(1, 10, 80), (3, 7, 1500), (2, 300, 16)])
def test_embedding_gather(T, V, D, id_dtype):
    g = torch.Generator().manual_seed(V)
    table = torch.randn(V, D, generator=g).to(DEVICE, torch.bfloat16)
    ids = torch.randint(0, V, (T,), generator=g)
    ids[0] = V - 1                                  # the last row
    ids = ids.to(DEVICE, id_dtype)
    out = torch.full((T, D), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    embedding_gather(ids, table, out)
    assert torch.equal(out, embedding_gather_ref(ids, table))


def test_embedding_gather_follows_device_id():
    # the id is read on the device: rewriting the buffer changes the row with no new arguments
    table = torch.randn(5, 24, device=DEVICE)
    ids = torch.tensor([1], device=DEVICE, dtype=torch.int32)
    out = torch.empty(1, 24, device=DEVICE)
    embedding_gather(ids, table, out)
    assert torch.equal(out[0], table[1])
    ids.fill_(4)
    embedding_gather(ids, table, out)
    assert torch.equal(out[0], table[4])


@pytest.mark.gpu
def test_gpu_norms_model_shape():
    x, res, w = _data(1, 1024, torch.bfloat16, seed=1)
    out = torch.empty_like(x)
    rms_norm(x, w, EPS, out)
    torch.testing.assert_close(out, rms_norm_ref(x, w, EPS), rtol=8e-3, atol=8e-3)
    table = torch.randn(248320, 1024, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.tensor([248076], device=DEVICE, dtype=torch.int32)
    emb = torch.empty(1, 1024, device=DEVICE, dtype=torch.bfloat16)
    embedding_gather(ids, table, emb)
    assert torch.equal(emb[0], table[248076])
