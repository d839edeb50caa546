"""The roofline's streaming read (kernels.bandwidth.row_sums) against torch, and the bench's
read-rate measurement: both methods reported, the roofline takes the faster."""
import pytest
import torch

from tritonchat.kernels.bandwidth import row_sums

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(1, 1), (7, 1024), (33, 100), (16, 4096), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_sums_matches_torch(shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    x = torch.randn(*shape, generator=g).to(DEVICE, dtype)
    out = torch.full((shape[0],), float("nan"), device=DEVICE)
    row_sums(x, out)
    torch.testing.assert_close(out, x.float().sum(dim=1), rtol=1e-5, atol=1e-4)


def test_row_sums_validates():
    x = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        row_sums(x, torch.zeros(4, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        row_sums(x.t(), torch.zeros(8, device=DEVICE))
    with pytest.raises(ValueError, match="4096"):
        row_sums(torch.zeros(2, 5000, device=DEVICE), torch.zeros(2, device=DEVICE))


def test_bench_roofline_takes_the_faster_read(monkeypatch):
    from tritonchat.engine import bench
    monkeypatch.setattr(bench, "measure_hbm_read_methods",
                        lambda nbytes, device, reps=20: {"torch_sum": 4010.0, "row_sums": 4430.0})
    assert bench.measure_hbm_read(1 << 20, "cpu") == 4430.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
def test_gpu_measure_hbm_read_methods():
    from tritonchat.engine.bench import measure_hbm_read, measure_hbm_read_methods
    x = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(8192, device="cuda")
    torch.testing.assert_close(row_sums(x, out), x.float().sum(dim=1), rtol=1e-4, atol=1e-3)
    m = measure_hbm_read_methods(256 << 20, "cuda", reps=2)
    assert set(m) == {"torch_sum", "row_sums"} and min(m.values()) > 0
    assert measure_hbm_read(256 << 20, "cuda", reps=2) > 0
