"""kernels/gemm.py against reference.gemm_ref: prefill GEMM (tl.dot) with the plain, residual
and SiLU*mul epilogues, and its tile table."""
import pytest
import torch

from tests.kernels.util import launches
from tritonchat.kernels import gemm as gemm_mod
from tritonchat.kernels._common import pdl_mode
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
    _assert_bf16_close(out, ref)


def _assert_bf16_close(out, ref):
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
def _write_table(tmp_path, configs, name="tuning.json"):
    import json
    path = tmp_path / name
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
    assert m.tuned_config("gemm_plain_N48_K40", 100, m.GEMM_TILE_KEYS, t) == good
    assert m.tuned_config("gemm_plain_N48_K40", 3000, m.GEMM_TILE_KEYS, t)["BLOCK_M"] == 64
    assert m.tuned_config("gemm_plain_N48_K40", 8192, m.GEMM_TILE_KEYS, t) is None   # bucket absent
    assert m.tuned_config("gemm_plain_N48_K40", 20, m.GEMM_TILE_KEYS, t) is None     # short prompt
    assert m.tuned_config("gemm_residual_N48_K40", 128, m.GEMM_TILE_KEYS, t) is None
    assert m.tuned_config("gemm_silu_mul_N24_K40", 128, m.GEMM_TILE_KEYS, t) is None
    assert m.tuned_config("gemm_plain_N48_K40", 100, m.GEMM_TILE_KEYS, None) is None  # no table
    assert m.gemm_config(100, 48, 40, False, table=t)["BLOCK_M"] == 32
    assert m.gemm_config(100, 48, 40, False, residual=True, table=t) == \
        m.gemm_config(100, 48, 40, False, table=None)
    # the launcher runs with the table's tiles and still computes the product
    x, W, r = _data(100, 48, 40, torch.float32, seed=1)
    out = torch.empty(100, 48, device=DEVICE)
    gemm(x, W, out, table=t)
    torch.testing.assert_close(out, gemm_ref(x, W, torch.empty_like(out)), rtol=1e-5, atol=1e-5)
    assert m.tuned_config("gemm_plain_N48_K40", 100, m.GEMM_TILE_KEYS,
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


# ------------------------------------------------------------------------------------------
# The launch forms (module docstring of kernels/gemm.py): persistent, TMA, split-K
# ------------------------------------------------------------------------------------------
SMALL_TILES = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=2, num_stages=1)
FORMS = {
    "grid": {},
    "persistent": dict(PERSISTENT=1),
    "tma": dict(TMA=1),
    "persistent_tma": dict(PERSISTENT=1, TMA=1),
    "persistent_tma_operands": dict(PERSISTENT=1, TMA=2),
    "splitk3": dict(PERSISTENT=1, SPLIT_K=3),
    "splitk2_tma": dict(TMA=1, SPLIT_K=2),
    "persistent_tma_splitk2": dict(PERSISTENT=1, TMA=1, SPLIT_K=2),
    "flatten_ws": dict(PERSISTENT=1, TMA=1, FLATTEN=1, WARP_SPEC=1),
}
FORM_T = [1, 17, 64, 65, 130]


@pytest.fixture
def descriptors(monkeypatch):
    """The number of TMA descriptors gemm() built (a spy on gemm.TensorDescriptor)."""
    from tritonchat.kernels import gemm as m
    made = []
    if m.TensorDescriptor is None:
        return made
    real = m.TensorDescriptor

    def spy(*a, **kw):
        made.append(a[0].data_ptr())
        return real(*a, **kw)
    monkeypatch.setattr(m, "TensorDescriptor", spy)
    return made


def _check_all_epilogues(x, W, cfg, dtype, views: bool):
    """plain, residual in place (out aliases residual) and silu_mul through `cfg`, against
    gemm_ref; with `views`, out (and the residual) are column views of wider NaN buffers whose
    other columns must stay untouched. N and K are not multiples of the tiles."""
    T, N = x.shape[0], W.shape[0]
    rtol, atol = _tol(dtype)
    g = torch.Generator().manual_seed(T + N)
    r = torch.randn(T, N, generator=g).to(DEVICE, dtype)
    for epi in ("plain", "residual", "silu_mul"):
        n_out = N // 2 if epi == "silu_mul" else N
        # NaN where the kernel must write (and, with views, beside the view: must stay NaN)
        buf = torch.full((T, n_out + (12 if views else 0)), float("nan"), device=DEVICE, dtype=dtype)
        out = buf[:, 4:4 + n_out] if views else buf
        if epi == "residual":
            out.copy_(r)
        kw = dict(residual=out) if epi == "residual" else dict(silu_mul=epi == "silu_mul")
        gemm(x, W, out, config=cfg, **kw)
        ref = gemm_ref(x, W, torch.empty(T, n_out, device=DEVICE, dtype=dtype),
                       residual=r if epi == "residual" else None, silu_mul=epi == "silu_mul")
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol, msg=lambda m: f"{epi}: {m}")
        if views:
            assert torch.isnan(buf[:, :4]).all() and torch.isnan(buf[:, 4 + n_out:]).all()


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", FORM_T)
def test_gemm_forms(form, dtype, T, descriptors):
    """Every form x every epilogue at lengths 1, 17, 64, 65, 130 with N = 40 and K = 72 (no
    multiple of the 32-wide N tile or the 16-deep K tile): a ragged last tile each way, more
    tiles than the interpreter's 4 "SMs" (the persistent programs take several), K slices of
    uneven length (72 = 5 K tiles: 2 + 2 + 1 with SPLIT_K=3)."""
    N, K = 40, 72
    x, W, _ = _data(T, N, K, dtype, seed=T + 1)
    cfg = dict(SMALL_TILES, **FORMS[form])
    _check_all_epilogues(x, W, cfg, dtype, views=False)
    assert bool(descriptors) == bool(cfg.get("TMA"))      # the TMA forms used descriptors


@pytest.mark.parametrize("form", ["grid", "persistent", "persistent_tma", "splitk2_tma"])
@pytest.mark.parametrize("x_offset,tma", [(4, True), (3, False)])
def test_gemm_forms_strided_views(form, x_offset, tma, descriptors):
    """x and out as column views into wider buffers: 16-byte aligned bases and row strides
    (the TMA forms take descriptors of the views), and x at an odd offset (an unaligned base:
    the TMA forms fall back to pointer loads). Columns beside the out view stay untouched."""
    T, N, K = 65, 40, 72
    dtype = torch.float32
    x_buf, W, _ = _data(T, N, K + 12, dtype, seed=7)
    W = W[:, :K].contiguous()
    x = x_buf[:, x_offset:x_offset + K]
    cfg = dict(SMALL_TILES, **FORMS[form])
    _check_all_epilogues(x, W, cfg, dtype, views=True)
    assert bool(descriptors) == (bool(cfg.get("TMA")) and tma)


def _gemm_epilogues_with_pdl(x, W, r, cfg, pdl):
    """{epilogue: out} of gemm with `pdl` (NaN-filled outs, the residual in place), each call's
    launches checked: all of them (the split-K reduce pass too) PDL launches of mode pdl."""
    T, N = x.shape[0], W.shape[0]
    outs = {}
    for epi in ("plain", "residual", "silu_mul"):
        n_out = N // 2 if epi == "silu_mul" else N
        out = r[:, :n_out].clone() if epi == "residual" else \
            torch.full((T, n_out), float("nan"), device=DEVICE, dtype=x.dtype)
        kw = dict(residual=out) if epi == "residual" else dict(silu_mul=epi == "silu_mul")
        with launches(gemm_mod) as seen:
            gemm(x, W, out, config=cfg, pdl=pdl, **kw)
        split = cfg is not None and cfg.get("SPLIT_K", 1) > 1
        assert len(seen) == (2 if split else 1), seen
        assert all(mode == pdl and asked == bool(pdl) for _, mode, asked in seen), seen
        outs[epi] = out
    return outs


@pytest.mark.parametrize("pdl", [1, 2])
@pytest.mark.parametrize("form", ["grid", "persistent_tma", "persistent_tma_operands", "splitk3",
                                  "persistent_tma_splitk2"])
def test_gemm_pdl_modes_give_the_same_bits(form, pdl):
    """Every form and epilogue with pdl 1 / 2 (its first weight tile prefetched before the
    wait) writes what pdl 0 writes; other pdl values are refused."""
    T, N, K = 65, 40, 72
    x, W, r = _data(T, N, K, torch.float32, seed=pdl)
    cfg = dict(SMALL_TILES, **FORMS[form])
    plain = _gemm_epilogues_with_pdl(x, W, r, cfg, 0)
    got = _gemm_epilogues_with_pdl(x, W, r, cfg, pdl)
    for epi in plain:
        assert torch.equal(got[epi], plain[epi]), epi
    for bad in (3, -1):
        with pytest.raises(ValueError):
            gemm(x, W, torch.empty(T, N, device=DEVICE), pdl=bad)


def test_gemm_split_k_is_deterministic_and_clamped():
    """Split-K sums its slices in slice order (bit-identical reruns), and more slices than K
    tiles (K = 24: 2 tiles of 16) run as one slice per tile."""
    T, N = 70, 48
    for K, split in ((72, 3), (24, 8)):
        x, W, r = _data(T, N, K, torch.float32, seed=K)
        cfg = dict(SMALL_TILES, PERSISTENT=1, TMA=1, SPLIT_K=split)
        outs = []
        for _ in range(2):
            out = r.clone()
            gemm(x, W, out, residual=out, config=cfg)
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        torch.testing.assert_close(outs[0], gemm_ref(x, W, torch.empty_like(r), residual=r),
                                   rtol=1e-5, atol=1e-5)


def test_gemm_default_forms_and_tables(tmp_path):
    """The built-in table: the grid form below M = 512 and for fp32, the persistent TMA form
    for long half-precision prompts (128 x 256 wide, 128 x 128 narrow and gate|up); table
    entries with only the tile keys run the grid form; form keys may be 0 but not negative."""
    from tritonchat.kernels import gemm as m
    small = m.gemm_config(128, 1024, 2048, False, table=None)
    assert (small["PERSISTENT"], small["TMA"], small["SPLIT_K"]) == (0, 0, 1)
    assert m.gemm_config(2048, 1024, 2048, False, table=None, dtype=torch.float32)["PERSISTENT"] == 0
    wide = m.gemm_config(2048, 8224, 1024, False, table=None)
    narrow = m.gemm_config(2048, 1024, 3584, False, residual=True, table=None)
    gate_up = m.gemm_config(2048, 3584, 1024, True, table=None)
    assert (wide["PERSISTENT"], wide["TMA"], wide["BLOCK_N"], wide["FLATTEN"]) == (1, 1, 256, 1)
    assert (narrow["PERSISTENT"], narrow["TMA"], narrow["BLOCK_N"]) == (1, 1, 128)
    assert m.gemm_config(8192, 1024, 3584, False, residual=True, table=None)["BLOCK_N"] == 256
    assert (gate_up["PERSISTENT"], gate_up["BLOCK_N"]) == (1, 128)
    for c in (wide, narrow, gate_up):
        assert set(c) == set(m.GEMM_KEYS) and m.gemm_smem_bytes(c, 2, c is gate_up) <= m.SMEM_BUDGET
    # the fp32 model (the accuracy mode) gets a bf16-measured persistent config shrunk to fit
    fp32 = m.gemm_config(2048, 8224, 1024, False, table=_write_table(tmp_path, {
        "gemm_plain_N8224_K1024": {"2048": wide}}, "wide.json"), dtype=torch.float32)
    assert fp32["PERSISTENT"] == 1 and m.gemm_smem_bytes(fp32, 4, False) <= m.SMEM_BUDGET
    tiles = dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=2, num_stages=1)
    t = _write_table(tmp_path, {
        "gemm_plain_N48_K40": {"128": tiles, "2048": dict(tiles, PERSISTENT=1, TMA=0, SPLIT_K=2)},
        "gemm_residual_N48_K40": {"128": dict(tiles, PERSISTENT=-1)},        # invalid: ignored
        "gemm_silu_mul_N24_K40": {"128": dict(tiles, SPLIT_K=0)},            # SPLIT_K 0: ignored
    })
    assert m.gemm_config(100, 48, 40, False, table=t) == dict(tiles, **m.GEMM_FORM_DEFAULTS)
    assert m.gemm_config(2048, 48, 40, False, table=t) == \
        dict(tiles, **dict(m.GEMM_FORM_DEFAULTS, PERSISTENT=1, SPLIT_K=2))
    assert m.gemm_config(100, 48, 40, False, residual=True, table=t) == \
        m.gemm_config(100, 48, 40, False, table=None)
    assert m.gemm_config(100, 24, 40, True, table=t) == m.gemm_config(100, 24, 40, True, table=None)
    # the launcher runs the table's split-K persistent entry and still computes the product
    x, W, _ = _data(2048, 48, 40, torch.float32, seed=2)
    out = torch.empty(2048, 48, device=DEVICE)
    gemm(x[:2048], W, out, table=t)
    torch.testing.assert_close(out, gemm_ref(x, W, torch.empty_like(out)), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["persistent", "tma", "persistent_tma", "tma_operands", "splitk2",
                                  "flatten", "ws"])
@pytest.mark.parametrize("name", ["gdn_qkvz", "gdn_out", "mlp_gate_up", "mlp_down"])
def test_gemm_forms_true_shapes_bf16(name, form):
    """On the device: each form at the true shapes (M = 2048, bf16) against the grid form,
    which the GPU twin above checks against the reference."""
    N, K, epi = TRUE_SHAPES[name]
    big = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    cfg = dict(big, **{"persistent": dict(PERSISTENT=1), "tma": dict(TMA=1),
                       "persistent_tma": dict(PERSISTENT=1, TMA=1),
                       "tma_operands": dict(PERSISTENT=1, TMA=2),
                       "flatten": dict(PERSISTENT=1, TMA=1, FLATTEN=1),
                       "splitk2": dict(PERSISTENT=1, TMA=1, SPLIT_K=2),
                       "ws": dict(PERSISTENT=1, TMA=1, WARP_SPEC=1)}[form])
    T = 2048
    x, W, r = _data(T, N, K, torch.bfloat16, seed=N + K)
    n_out = N // 2 if epi == "silu_mul" else N
    r = r[:, :n_out].contiguous()
    outs = []
    for c in (dict(big), cfg):
        out = r.clone()
        gemm(x, W, out, residual=out if epi == "residual" else None, silu_mul=epi == "silu_mul",
             config=c)
        outs.append(out)
    _assert_bf16_close(outs[1], outs[0])
    out = r.clone()                      # and bit-repeatable (split-K included)
    gemm(x, W, out, residual=out if epi == "residual" else None, silu_mul=epi == "silu_mul",
         config=cfg)
    assert torch.equal(out, outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [128, 2048])
@pytest.mark.parametrize("early", [False, True])
def test_gpu_pdl_mlp_chain_gives_the_same_bits(T, early):
    """On the device: the prefill's MLP chain (gate|up then down into h in place, three times
    over, with the packaged table's forms at T = 128 and 2048, and split-K) launched with PDL,
    eagerly and replayed from a CUDA graph, writes the bits the chain without PDL writes."""
    pdl = pdl_mode(True, early, DEVICE)
    assert pdl
    D, I = 1024, 3584
    g = torch.Generator().manual_seed(T)
    h0 = torch.randn(T, D, generator=g).to(DEVICE, torch.bfloat16)
    Wgu = (torch.randn(2 * I, D, generator=g) * D ** -0.5).to(DEVICE, torch.bfloat16)
    Wd = (torch.randn(D, I, generator=g) * I ** -0.5).to(DEVICE, torch.bfloat16)
    act = torch.empty(T, I, device=DEVICE, dtype=torch.bfloat16)
    split = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3,
                 PERSISTENT=1, TMA=1, SPLIT_K=2)

    def chain(h, mode):
        for i in range(3):
            gemm(h, Wgu, act, silu_mul=True, pdl=mode)
            gemm(act, Wd, h, residual=h, pdl=mode, config=split if i == 1 else None)
        return h

    want = chain(h0.clone(), 0)
    assert torch.equal(chain(h0.clone(), pdl), want)
    h = h0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(h, pdl)
    for _ in range(2):
        h.copy_(h0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h, want)
