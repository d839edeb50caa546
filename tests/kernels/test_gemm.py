"""kernels/gemm.py against reference.gemm_ref: prefill GEMM (tl.dot) with the plain, residual
and SiLU*mul epilogues, and its tile table."""
import pytest
import torch

from tritonchat.kernels.gemm import gemm
from tritonchat.kernels.reference import gemm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# length 1 and the chunk boundaries 63/64/65 in the fast run; the rest of the sweep is slow
T_LIST = [1, 63, 64, 65] + [pytest.param(t, marks=pytest.mark.slow) for t in (2, 3, 4, 127, 200)]


def _tol(dtype):
    # fp32 dots are IEEE (exact under the interpreter, FMA order on a GPU)
    if dtype == torch.float32:
        return (1e-5, 1e-5) if DEVICE == "cpu" else (1e-4, 1e-4)
    return (4e-3, 2e-3)      # half: one rounding of a K-sum taken in another order


def _data(T, N, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(DEVICE, dtype)
    W = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEVICE, dtype)
    r = torch.randn(T, N, generator=g).to(DEVICE, dtype)
    return x, W, r


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", T_LIST)
def test_gemm_epilogues(T, dtype):
    N, K = 96, 72                  # K is not a multiple of the K tile: ragged K loop
    x, W, r = _data(T, N, K, dtype, seed=T)
    rtol, atol = _tol(dtype)

    out = torch.full((T, N), float("nan"), device=DEVICE, dtype=dtype)
    gemm(x, W, out)
    torch.testing.assert_close(out, gemm_ref(x, W, torch.empty_like(out)), rtol=rtol, atol=atol)
    # the reference itself is the plain product
    torch.testing.assert_close(gemm_ref(x, W, torch.empty_like(out)).float(),
                               (x.double() @ W.double().t()).float(), rtol=1e-2, atol=1e-2)

    out = r.clone()
    gemm(x, W, out, residual=out)  # in place: out aliases residual
    torch.testing.assert_close(out, gemm_ref(x, W, torch.empty_like(out), residual=r),
                               rtol=rtol, atol=atol)

    out = torch.full((T, N // 2), float("nan"), device=DEVICE, dtype=dtype)
    gemm(x, W, out, silu_mul=True)
    ref = gemm_ref(x, W, torch.empty_like(out), silu_mul=True)
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    y = x.double() @ W.double().t()
    torch.testing.assert_close(ref.double(), torch.nn.functional.silu(y[:, :N // 2]) * y[:, N // 2:],
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("T,N,K", [(5, 40, 24), (130, 17, 64), (33, 200, 256)])
def test_gemm_odd_shapes_and_strided_rows(T, N, K):
    """Non-power-of-two N, K a multiple of the K tile, x/out/residual as views into wider buffers."""
    dtype = torch.float32
    x_buf, W, r_buf = _data(T, N, K + 8, dtype, seed=N)
    W = W[:, :K].contiguous()
    x = x_buf[:, 3:3 + K]
    out_buf = torch.zeros(T, N + 5, device=DEVICE, dtype=dtype)
    res = r_buf[:, :N]
    gemm(x, W, out_buf[:, 2:2 + N], residual=res)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out_buf[:, 2:2 + N], gemm_ref(x, W, torch.empty(T, N, device=DEVICE), residual=res),
                               rtol=rtol, atol=atol)
    assert torch.all(out_buf[:, :2] == 0) and torch.all(out_buf[:, 2 + N:] == 0)


def test_gemm_rejects_bad_arguments():
    x, W, _ = _data(4, 32, 16, torch.float32, 0)
    with pytest.raises(ValueError):
        gemm(x, W, torch.empty(4, 31, device=DEVICE))
    with pytest.raises(TypeError):
        gemm(x, W.half(), torch.empty(4, 32, device=DEVICE))
    with pytest.raises(ValueError):
        gemm(x, W, torch.empty(4, 32, device=DEVICE), silu_mul=True)      # out must be [T, N/2]
    with pytest.raises(ValueError):
        gemm(x.t(), W, torch.empty(16, 32, device=DEVICE))                # column-strided x


# ------------------------------------------------------------------------------------------
# GPU twins: bf16 at the true Qwen3.5-0.8B projection shapes, a 2048-token prompt
# ------------------------------------------------------------------------------------------
TRUE_SHAPES = {            # name: (N rows of W, K, epilogue)
    "gdn_qkvz": (8192, 1024, None),
    "gdn_ba": (32, 1024, None),
    "gdn_out": (1024, 2048, "residual"),
    "attn_q": (4096, 1024, None),
    "attn_kv": (1024, 1024, None),
    "attn_o": (1024, 2048, "residual"),
    "mlp_gate_up": (7168, 1024, "silu_mul"),
    "mlp_down": (1024, 3584, "residual"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TRUE_SHAPES))
def test_gemm_true_shapes_bf16(name):
    N, K, epi = TRUE_SHAPES[name]
    T = 2048
    x, W, r = _data(T, N, K, torch.bfloat16, seed=N + K)
    n_out = N // 2 if epi == "silu_mul" else N
    r = r[:, :n_out].contiguous()
    out = r.clone() if epi == "residual" else torch.empty(T, n_out, device=DEVICE, dtype=torch.bfloat16)
    kw = dict(residual=out if epi == "residual" else None, silu_mul=epi == "silu_mul")
    gemm(x, W, out, **kw)
    ref = gemm_ref(x, W, torch.empty_like(out), residual=r if epi == "residual" else None,
                   silu_mul=epi == "silu_mul")
    # The epilogue rounds the fp32 K-sum (taken in another order than the reference's) to bf16,
    # and the residual add rounds once more: a sum that lands near a rounding boundary may
    # come out one bf16 ulp of the output's magnitude away. Anything beyond that is an error.
    err = (out.float() - ref.float()).abs()
    mag = torch.maximum(ref.float().abs(), out.float().abs())     # a sum may round across a power of 2
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(mag.clamp_min(1e-30))))
    # two rounding points (the product, then the residual add / SiLU*up) can each land one ulp
    # apart when the fp32 sums differ in their last bits: allow two ulps per element
    # The intermediate (the product before the residual add, the gate before SiLU*up) can be far
    # larger than the output, so one flip of its rounding moves the output by several of the
    # output's ulps: allow such flips only as rare isolated elements, never systematically.
    bad = err > torch.maximum(2 * ulp, torch.full_like(ulp, 1e-2))
    assert int(bad.sum()) <= max(2, int(1e-5 * err.numel())), \
        f"{int(bad.sum())} elements beyond two bf16 ulps, worst {err.max().item():.4g}"
    assert err.max().item() <= 0.125
    # and the bulk agrees far better than an ulp (no systematic error hiding under the bound)
    assert err.mean().item() < 2e-3


# ------------------------------------------------------------------------------------------
# The tile table written by tune_prefill (read back by every prefill launcher)
# ------------------------------------------------------------------------------------------
def _write_table(tmp_path, configs):
    import json
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"version": 1, "configs": configs}))
    return str(path)


def test_tuned_config_buckets_and_validation(tmp_path):
    from tritonchat.kernels import gemm as m
    good = dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=2, num_stages=1)
    t = _write_table(tmp_path, {
        "gemm_plain_N48_K40": {"128": good, "2048": dict(good, BLOCK_M=64)},
        "gemm_residual_N48_K40": {"128": dict(good, BLOCK_N=0)},          # invalid: ignored
        "gemm_silu_mul_N24_K40": {"128": {"BLOCK_M": 32}},                 # missing keys: ignored
    })
    assert [m.t_bucket(t) for t in (64, 400, 600, 2048, 4000, 4200, 10 ** 6)] == \
        [128, 128, 2048, 2048, 2048, 8192, 8192]
    assert m.tuned_config("gemm_plain_N48_K40", 100, m.GEMM_KEYS, t) == good
    assert m.tuned_config("gemm_plain_N48_K40", 3000, m.GEMM_KEYS, t)["BLOCK_M"] == 64
    assert m.tuned_config("gemm_plain_N48_K40", 8192, m.GEMM_KEYS, t) is None   # bucket absent
    assert m.tuned_config("gemm_plain_N48_K40", 20, m.GEMM_KEYS, t) is None     # short prompt
    assert m.tuned_config("gemm_residual_N48_K40", 128, m.GEMM_KEYS, t) is None
    assert m.tuned_config("gemm_silu_mul_N24_K40", 128, m.GEMM_KEYS, t) is None
    assert m.tuned_config("gemm_plain_N48_K40", 100, m.GEMM_KEYS, None) is None  # no table
    assert m.gemm_config(100, 48, 40, False, table=t)["BLOCK_M"] == 32
    assert m.gemm_config(100, 48, 40, False, residual=True, table=t) == \
        m.gemm_config(100, 48, 40, False, table=None)
    # the launcher runs with the table's tiles and still computes the product
    x, W, r = _data(100, 48, 40, torch.float32, seed=1)
    out = torch.empty(100, 48, device=DEVICE)
    gemm(x, W, out, table=t)
    torch.testing.assert_close(out, gemm_ref(x, W, torch.empty_like(out)), rtol=1e-5, atol=1e-5)
    assert m.tuned_config("gemm_plain_N48_K40", 100, m.GEMM_KEYS,
                          str(tmp_path / "absent.json")) is None


@pytest.mark.parametrize("cfg", [
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=2, num_stages=1),
    dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=16, GROUP_M=4, num_warps=4, num_stages=2),
])
def test_gemm_explicit_config(cfg):
    """The tuner's override path: other tiles, ragged K, every epilogue."""
    T, N, K = 70, 48, 40
    x, W, r = _data(T, N, K, torch.float32, seed=4)
    out = r.clone()
    gemm(x, W, out, residual=out, config=cfg)
    torch.testing.assert_close(out, gemm_ref(x, W, torch.empty_like(out), residual=r), rtol=1e-5, atol=1e-5)
    out = torch.empty(T, N // 2, device=DEVICE)
    gemm(x, W, out, silu_mul=True, config=cfg)
    torch.testing.assert_close(out, gemm_ref(x, W, torch.empty_like(out), silu_mul=True), rtol=1e-5, atol=1e-5)
