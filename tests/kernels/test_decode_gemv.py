"""Decode GEMV against its reference: epilogues, split-K 1-4, ragged shapes, reproducibility."""
import json

import pytest
import torch

from tritonchat.kernels import gemv as gemv_mod
from tritonchat.kernels.gemv import gemv, plan, heuristic_plan
from tritonchat.kernels.reference import gemv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The Triton interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even), so
# bit-exact checks include bf16 only on the GPU.
EXACT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EPILOGUES = ["plain", "residual", "residual_inplace", "silu_mul"]


def _data(n_rows, K, dtype, seed, integer=False):
    g = torch.Generator().manual_seed(seed)
    if integer:
        # small integers: every fp32 partial sum is exact, so any summation order agrees
        x = torch.randint(-3, 4, (K,), generator=g).float()
        W = torch.randint(-3, 4, (n_rows, K), generator=g).float()
    else:
        x = torch.randn(K, generator=g)
        W = torch.randn(n_rows, K, generator=g) * K ** -0.5
    return x.to(DEVICE, dtype), W.to(DEVICE, dtype), g


def _run(x, W, epilogue, split_k, dtype, g, **blocks):
    n_out = W.shape[0] // 2 if epilogue == "silu_mul" else W.shape[0]
    res = torch.randn(n_out, generator=g).to(DEVICE, dtype) if "residual" in epilogue else None
    out = res.clone() if epilogue == "residual_inplace" else \
        torch.full((n_out,), float("nan"), device=DEVICE, dtype=dtype)
    want = gemv_ref(x, W, residual=res, silu_mul=epilogue == "silu_mul", out_dtype=dtype)
    partials = torch.full((split_k * W.shape[0] + 5,), float("nan"), device=DEVICE)
    gemv(x, W, out, split_k=split_k, partials=partials,
         residual=out if epilogue == "residual_inplace" else res,
         silu_mul=epilogue == "silu_mul", **blocks)
    return out, want


def _tol(dtype):
    # one rounding of an fp32 sum taken in another order (fp32 itself: order noise only)
    # (bf16 allows one ulp: the interpreter truncates where the reference rounds)
    return {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
            torch.bfloat16: (1.6e-2, 1e-2)}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 2, 3, 4])
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_gemv_epilogues_split_k(epilogue, split_k, dtype):
    # 74 rows (37 after SiLU*mul) x K=200: neither is a multiple of the 8 x 32 tile
    x, W, g = _data(74, 200, dtype, seed=split_k)
    out, want = _run(x, W, epilogue, split_k, dtype, g, block_n=8, block_k=32, num_warps=4)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", EXACT_DTYPES)
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("epilogue", ["plain", "residual_inplace"])
def test_gemv_exact_on_integer_data(epilogue, split_k, dtype):
    # exact fp32 sums: kernel and reference must agree bit for bit, whatever the order
    x, W, g = _data(40, 96, dtype, seed=7, integer=True)
    out, want = _run(x, W, epilogue, split_k, dtype, g, block_n=16, block_k=32, num_warps=4)
    assert torch.equal(out, want)


@pytest.mark.parametrize("n_rows,K,block_n,block_k", [
    (1, 16, 1, 16),        # a single row
    (5, 17, 4, 16),        # K one past the tile
    (64, 128, 16, 64),     # exact tiling: the unmasked path
    (33, 48, 32, 128),     # tile wider than K
    (130, 80, 64, 16),     # many K steps
])
@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_gemv_shapes(n_rows, K, block_n, block_k, split_k):
    x, W, g = _data(n_rows, K, torch.float32, seed=n_rows + K)
    out, want = _run(x, W, "residual", split_k, torch.float32, g, block_n=block_n,
                     block_k=block_k, num_warps=4)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_gemv_x_as_row_and_plan_defaults():
    # x [1, K] / out [1, N] as the engine's buffers are shaped, block sizes from plan()
    x, W, _ = _data(48, 64, torch.float32, seed=3)
    out = torch.empty(1, 48, device=DEVICE)
    gemv(x.view(1, -1), W, out)
    torch.testing.assert_close(out.view(-1), gemv_ref(x, W, out_dtype=torch.float32),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("epilogue", ["plain", "residual", "silu_mul"])
def test_gemv_split_k_bit_reproducible(epilogue, split_k):
    x, W, g = _data(96, 160, torch.float32, seed=11)
    outs = []
    for _ in range(2):
        g2 = torch.Generator().manual_seed(5)
        outs.append(_run(x, W, epilogue, split_k, torch.float32, g2, block_n=8, block_k=16)[0])
    assert torch.equal(outs[0], outs[1])


def test_gemv_split_with_empty_split():
    # K = 64 in 32-wide blocks over 4 splits: each split gets 32, splits 2 and 3 get nothing
    x, W, g = _data(10, 64, torch.float32, seed=2)
    out, want = _run(x, W, "plain", 4, torch.float32, g, block_n=8, block_k=32)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_gemv_validates():
    x, W, _ = _data(8, 32, torch.float32, seed=1)
    out = torch.empty(8, device=DEVICE)
    with pytest.raises(ValueError):
        gemv(x[:16], W, out)                                   # wrong K
    with pytest.raises(ValueError):
        gemv(x, W, torch.empty(7, device=DEVICE))              # wrong N
    with pytest.raises(ValueError):
        gemv(x, W, out, split_k=2)                             # split without partials
    with pytest.raises(ValueError):
        gemv(x, W, out, split_k=2, partials=torch.empty(15, device=DEVICE))   # too small
    with pytest.raises(ValueError):
        gemv(x, W.t(), out)                                    # not row-major
    with pytest.raises(ValueError):
        gemv(x, W, torch.empty(8, device=DEVICE), silu_mul=True)   # silu out is N/2


def test_plan_table_and_fallback():
    with open(gemv_mod.TABLE_PATH, encoding="utf-8") as f:
        table = json.load(f)
    assert {"gpu", "measured_with", "entries"} <= table.keys()
    shapes = {(e["n"], e["k"]) for e in table["entries"]}
    for shape in [(8192, 1024), (32, 1024), (1024, 2048), (4096, 1024), (512, 1024),
                  (7168, 1024), (1024, 3584), (248320, 1024), (8224, 1024), (5120, 1024)]:
        assert shape in shapes
    for e in table["entries"]:
        p = plan(e["n"], e["k"], True)
        assert p["split_k"] == e["split_k"]
        q = plan(e["n"], e["k"], False)
        assert q["split_k"] == 1
        for d in (p, q):
            assert d["block_k"] & (d["block_k"] - 1) == 0 and d["block_n"] >= 1
    # an unknown shape falls back to the heuristic; split-K only where the grid is short
    assert plan(100, 4000, True) == heuristic_plan(100, 4000, True)
    assert heuristic_plan(100_000, 1024, True)["split_k"] == 1
    assert heuristic_plan(64, 4096, True)["split_k"] > 1
    assert heuristic_plan(64, 4096, False)["split_k"] == 1


# ------------------------------------------------------------------------------------------
# GPU twins: the real 0.8B shapes in bf16 with the shipped plans
# ------------------------------------------------------------------------------------------

GPU_SHAPES = [((8224, 1024), "plain"), ((5120, 1024), "plain"),
              ((8192, 1024), "plain"), ((32, 1024), "plain"), ((1024, 2048), "residual_inplace"),
              ((4096, 1024), "plain"), ((512, 1024), "plain"), ((1024, 1024), "plain"),
              ((7168, 1024), "silu_mul"), ((1024, 3584), "residual_inplace")]


@pytest.mark.gpu
@pytest.mark.parametrize("split_enabled", [True, False])
@pytest.mark.parametrize("shape,epilogue", GPU_SHAPES)
def test_gpu_gemv_model_shapes(shape, epilogue, split_enabled):
    n, k = shape
    p = plan(n, k, split_enabled)
    x, W, g = _data(n, k, torch.bfloat16, seed=n + k)
    outs = []
    for _ in range(2):
        g2 = torch.Generator().manual_seed(1)
        out, want = _run(x, W, epilogue, p["split_k"], torch.bfloat16, g2)
        torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
