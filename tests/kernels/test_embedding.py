"""kernels/embedding.py against reference.embedding_gather_ref: one id, the last row, odd
widths, the id read on the device."""
import pytest
import torch

from tritonchat.kernels.embedding import embedding_gather
from tritonchat.kernels.reference import embedding_gather_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
def test_gpu_embedding_model_shape():
    table = torch.randn(248320, 1024, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.tensor([248076], device=DEVICE, dtype=torch.int32)
    emb = torch.empty(1, 1024, device=DEVICE, dtype=torch.bfloat16)
    embedding_gather(ids, table, emb)
    assert torch.equal(emb[0], table[248076])
