"""kernels/flash_attention.py against reference.attention_prefill_ref: gated flash attention for
a prompt chunk (q/k norm, partial RoPE, KV-cache write, causal GQA over the cached history,
sigmoid gate); the PDL modes give the same bits."""
import functools

import pytest
import torch

from tests.kernels.util import launches
from tritonchat.kernels import flash_attention as fa
from tritonchat.kernels._common import pdl_mode
from tritonchat.kernels.flash_attention import (KV_POINTERS, KV_TMA, LOOP_PLAIN, LOOP_WARP_SPEC,
                                                attention_prefill)
from tritonchat.kernels.reference import attention_prefill_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# length 1 and the chunk boundaries 63/64/65 in the fast run; the rest of the sweep is slow
T_LIST = [1, 63, 64, 65] + [pytest.param(t, marks=pytest.mark.slow) for t in (2, 3, 4, 127, 200)]
# GQA group 2, head_dim not a power of two, a quarter of it rotated (as in the model)
SMALL = dict(num_heads=4, num_kv_heads=2, head_dim=48, rotary_dim=12, rope_theta=10000.0, eps=1e-6)


def _tol(dtype):
    if dtype == torch.float32:
        return (1e-5, 1e-5) if DEVICE == "cpu" else (1e-4, 1e-4)     # IEEE fp32 dots
    return (4e-3, 4e-3)


def _inputs(T, dims, dtype, seed, start_pos, max_ctx):
    H, Hkv, hd = dims["num_heads"], dims["num_kv_heads"], dims["head_dim"]
    g = torch.Generator().manual_seed(seed)
    qg = torch.randn(T, H * 2 * hd, generator=g) * 2
    k = torch.randn(T, Hkv * hd, generator=g) * 2
    v = torch.randn(T, Hkv * hd, generator=g)
    qw = torch.randn(hd, generator=g) * 0.3
    kw = torch.randn(hd, generator=g) * 0.3
    # history before start_pos is arbitrary data; slots after the new tokens hold NaN, so any
    # read past the end poisons the output
    k_cache = torch.full((Hkv, max_ctx, hd), float("nan"))
    v_cache = torch.full((Hkv, max_ctx, hd), float("nan"))
    k_cache[:, :start_pos] = torch.randn(Hkv, start_pos, hd, generator=g) * 2
    v_cache[:, :start_pos] = torch.randn(Hkv, start_pos, hd, generator=g)
    cast = lambda t: t.to(DEVICE, dtype)
    return tuple(map(cast, (qg, k, v, qw, kw, k_cache, v_cache)))


def _run(fn, inputs, start_pos, dims):
    qg, k, v, qw, kw, k_cache, v_cache = inputs
    kc, vc = k_cache.clone(), v_cache.clone()
    out = torch.full((qg.shape[0], dims["num_heads"] * dims["head_dim"]), float("nan"),
                     device=DEVICE, dtype=qg.dtype)
    fn(qg, k, v, qw, kw, kc, vc, start_pos, out, **dims)
    return out, kc, vc


def _check(T, start_pos, dims, dtype, seed, max_ctx=None):
    max_ctx = max_ctx or start_pos + T + 5
    inputs = _inputs(T, dims, dtype, seed, start_pos, max_ctx)
    out, kc, vc = _run(attention_prefill, inputs, start_pos, dims)
    ref, kc_ref, vc_ref = _run(attention_prefill_ref, inputs, start_pos, dims)
    rtol, atol = _tol(dtype)
    end = start_pos + T
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(kc[:, :end], kc_ref[:, :end], rtol=rtol, atol=atol)
    torch.testing.assert_close(vc[:, :end], vc_ref[:, :end], rtol=0, atol=0)
    assert torch.isnan(kc[:, end:]).all() and torch.isnan(vc[:, end:]).all()   # untouched
    return out, kc, vc


@pytest.mark.parametrize("start_pos", [0, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", T_LIST)
def test_attention_matches_reference(T, dtype, start_pos):
    _check(T, start_pos, SMALL, dtype, seed=T + start_pos)


@pytest.mark.parametrize("T,start_pos", [(1, 0), (5, 37), (70, 0), (33, 66)])
def test_attention_start_read_from_the_device_equals_the_int(T, start_pos):
    """start_pos as a device int32 (what a captured prefill graph passes) gives exactly what
    the int gives: the same outputs and cache writes, bit for bit."""
    inputs = _inputs(T, SMALL, torch.float32, T, start_pos, start_pos + T + 5)
    a = _run(attention_prefill, inputs, start_pos, SMALL)
    b = _run(attention_prefill, inputs, torch.tensor([start_pos], dtype=torch.int32, device=DEVICE), SMALL)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("pdl", [1, 2])
@pytest.mark.parametrize("T,start_pos,device_start", [(1, 0, False), (70, 0, True), (33, 66, False),
                                                      (5, 37, True)])
def test_attention_pdl_modes_give_the_same_bits(T, start_pos, device_start, pdl):
    """pdl 1 / 2 (the frequencies and norm weights read before the wait, the start after it)
    write the outputs and cache rows pdl 0 writes; both launches (the K/V pass, the attention
    pass) are PDL launches of that mode; other pdl values are refused."""
    inputs = _inputs(T, SMALL, torch.float32, T + pdl, start_pos, start_pos + T + 5)
    start = torch.tensor([start_pos], dtype=torch.int32, device=DEVICE) if device_start else start_pos
    runs = []
    for mode in (0, pdl):
        with launches(fa) as seen:
            runs.append(_run(functools.partial(attention_prefill, pdl=mode), inputs, start, SMALL))
        assert [(k, m, asked) for k, m, asked in seen] == [
            ("_kv_cache_write_kernel", mode, bool(mode)), ("_attention_prefill_kernel", mode, bool(mode))]
    for x, y in zip(*runs):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    for bad in (3, -1):
        with pytest.raises(ValueError):
            _run(functools.partial(attention_prefill, pdl=bad), inputs, start, SMALL)


@pytest.mark.parametrize("dims", [
    dict(num_heads=8, num_kv_heads=2, head_dim=64, rotary_dim=64, rope_theta=1e7, eps=1e-6),
    dict(num_heads=2, num_kv_heads=2, head_dim=32, rotary_dim=8, rope_theta=1e6, eps=1e-5),
    dict(num_heads=3, num_kv_heads=1, head_dim=24, rotary_dim=6, rope_theta=500.0, eps=1e-6),
], ids=["group4_full_rotary", "mha", "group3_tiny"])
@pytest.mark.parametrize("T,start_pos", [(1, 5), (70, 0), (33, 66)])
def test_attention_head_layouts(dims, T, start_pos):
    _check(T, start_pos, dims, torch.float32, seed=T)


@pytest.mark.parametrize("T,start_pos", [(3, 3000), (80, 1000)])
def test_attention_long_history(T, start_pos):
    """Many fully visible key blocks before the diagonal, and large RoPE angles."""
    _check(T, start_pos, SMALL, torch.float32, seed=start_pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [(64, 1), (63, 2), pytest.param((1, 64), marks=pytest.mark.slow),
                                   pytest.param((5, 200), marks=pytest.mark.slow)])
def test_attention_continuation_equals_one_prefill(split, dtype):
    """A second chat turn (start_pos = T1) sees the first turn's cached K/V exactly as if the
    two turns had been prefilled at once."""
    t1, t2 = split
    dims = SMALL
    inputs = _inputs(t1 + t2, dims, dtype, seed=t1 * 7 + t2, start_pos=0, max_ctx=t1 + t2 + 3)
    whole, kc_w, vc_w = _run(attention_prefill, inputs, 0, dims)
    qg, k, v, qw, kw, kc, vc = inputs
    out1, kc, vc = _run(attention_prefill, (qg[:t1], k[:t1], v[:t1], qw, kw, kc, vc), 0, dims)
    out2, kc, vc = _run(attention_prefill, (qg[t1:], k[t1:], v[t1:], qw, kw, kc, vc), t1, dims)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(torch.cat([out1, out2]), whole, rtol=rtol, atol=atol)
    torch.testing.assert_close(kc, kc_w, rtol=rtol, atol=atol, equal_nan=True)
    torch.testing.assert_close(vc, vc_w, rtol=0, atol=0, equal_nan=True)


def test_attention_strided_views_of_projections():
    """qg, k, v as column slices of one merged projection output; out as a slice too."""
    T, start_pos, dims = 50, 10, SMALL
    H, Hkv, hd = 4, 2, 48
    inputs = _inputs(T, dims, torch.float32, seed=9, start_pos=start_pos, max_ctx=T + start_pos)
    qg, k, v, qw, kw, k_cache, v_cache = inputs
    merged = torch.cat([qg, k, v], dim=1)
    views = (merged[:, :H * 2 * hd], merged[:, H * 2 * hd:H * 2 * hd + Hkv * hd],
             merged[:, H * 2 * hd + Hkv * hd:])
    kc, vc = k_cache.clone(), v_cache.clone()
    out_buf = torch.zeros(T, H * hd + 4, device=DEVICE)
    attention_prefill(*views, qw, kw, kc, vc, start_pos, out_buf[:, 2:2 + H * hd], **dims)
    ref, kc_ref, _ = _run(attention_prefill_ref, inputs, start_pos, dims)
    torch.testing.assert_close(out_buf[:, 2:2 + H * hd], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, kc_ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.all(out_buf[:, :2] == 0) and torch.all(out_buf[:, 2 + H * hd:] == 0)


@pytest.mark.parametrize("cfg", [
    dict(BLOCK_M=16, BLOCK_N=32, num_warps=2, num_stages=1),
    dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2),
])
def test_attention_explicit_config(cfg):
    """The tuner's override path: query/key tiles of other sizes, history + causal diagonal."""
    T, start_pos = 45, 20
    inputs = _inputs(T, SMALL, torch.float32, 3, start_pos, start_pos + T + 2)
    qg, k, v, qw, kw, k_cache, v_cache = inputs
    kc, vc = k_cache.clone(), v_cache.clone()
    out = torch.empty(T, 4 * 48, device=DEVICE)
    attention_prefill(qg, k, v, qw, kw, kc, vc, start_pos, out, config=cfg, **SMALL)
    ref, _, _ = _run(attention_prefill_ref, inputs, start_pos, SMALL)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


GROUP4 = dict(num_heads=8, num_kv_heads=2, head_dim=40, rotary_dim=10, rope_theta=1e4, eps=1e-6)
GROUP3 = dict(num_heads=6, num_kv_heads=2, head_dim=24, rotary_dim=24, rope_theta=1e4, eps=1e-6)


@pytest.mark.parametrize("dims,cfg,T,start_pos", [
    # 16 tokens x 4 heads: the prologue runs in four 16-row pieces, keys in 32-wide tiles
    (GROUP4, dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2), 70, 9),
    # 32 tokens x 4 heads, one diagonal spanning several key tiles
    (GROUP4, dict(BLOCK_M=128, BLOCK_N=16, num_warps=8, num_stages=2), 77, 0),
    # group 3 padded to 4 rows per token: the padding rows must not touch the next group's head
    (GROUP3, dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2), 40, 30),
    (GROUP3, dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2), 5, 1),
], ids=["g4_m64", "g4_m128", "g3_m64", "g3_m16"])
def test_attention_stacked_head_tiles(dims, cfg, T, start_pos):
    """Query heads of one KV head stacked as rows of the Q tile, at the tuner's tile sizes."""
    inputs = _inputs(T, dims, torch.float32, T + start_pos, start_pos, start_pos + T + 3)
    qg, k, v, qw, kw, k_cache, v_cache = inputs
    kc, vc = k_cache.clone(), v_cache.clone()
    out = torch.full((T, dims["num_heads"] * dims["head_dim"]), float("nan"), device=DEVICE)
    attention_prefill(qg, k, v, qw, kw, kc, vc, start_pos, out, config=cfg, **dims)
    ref, _, _ = _run(attention_prefill_ref, inputs, start_pos, dims)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# the Hopper knobs: K/V tiles through tensor descriptors (TMA) or pointers, the unmasked key loop
# plain or warp specialised; every combination computes the same function
LOADS = [(KV_TMA, LOOP_PLAIN), (KV_POINTERS, LOOP_PLAIN), (KV_TMA, LOOP_WARP_SPEC)]
LOAD_IDS = ["tma", "pointers", "tma_ws"]


def _dims(group, hd, rot):
    return dict(num_heads=2 * group, num_kv_heads=2, head_dim=hd, rotary_dim=rot,
                rope_theta=1e4, eps=1e-6)


def _check_cfg(T, start_pos, dims, dtype, cfg, seed):
    """attention_prefill with `cfg` against the reference; the cache rows past the chunk hold
    NaN (a descriptor load reads them: they must not reach the output)."""
    inputs = _inputs(T, dims, dtype, seed, start_pos, start_pos + T + 7)
    qg, k, v, qw, kw, k_cache, v_cache = inputs
    kc, vc = k_cache.clone(), v_cache.clone()
    out = torch.full((T, dims["num_heads"] * dims["head_dim"]), float("nan"), device=DEVICE,
                     dtype=dtype)
    attention_prefill(qg, k, v, qw, kw, kc, vc, start_pos, out, config=cfg, **dims)
    ref, kc_ref, _ = _run(attention_prefill_ref, inputs, start_pos, dims)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(kc, kc_ref, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("load,loop", LOADS, ids=LOAD_IDS)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
def test_attention_kv_load_modes(T, group, load, loop):
    """Both K/V load paths and both loop schedules over the chunk boundaries, a cached history,
    GQA groups 1/2/4, a head_dim that is not a power of two (its tile padded to 64 columns)."""
    cfg = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2, KV_LOAD=load, LOOP=loop)
    _check_cfg(T, 21, _dims(group, 40, 10), torch.float32, cfg, seed=T * 3 + group)


@pytest.mark.parametrize("load,loop", LOADS, ids=LOAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,start_pos,group", [(65, 70, 4), (63, 0, 2), (1, 130, 1)])
def test_attention_head_dim_256(T, start_pos, group, dtype, load, loop):
    """The model's head_dim 256 (a quarter rotated) at the built-in tile of long prompts and
    at a tile whose diagonal spans several key blocks."""
    dims = _dims(group, 256, 64)
    _check_cfg(T, start_pos, dims, dtype, dict(KV_LOAD=load, LOOP=loop), seed=T + group)
    cfg = dict(BLOCK_M=64, BLOCK_N=16, num_warps=8, num_stages=3, KV_LOAD=load, LOOP=loop)
    _check_cfg(T, start_pos, dims, dtype, cfg, seed=T + group + 1)


@pytest.mark.parametrize("hd,dtype,usable", [
    (40, torch.float32, True), (40, torch.float16, True), (256, torch.float16, True),
    (36, torch.float16, False),     # 72-byte rows: not 16-byte aligned, pointers instead
    (33, torch.float32, False),
])
def test_attention_descriptor_fallback(hd, dtype, usable):
    """Descriptors serve wherever the cache rows are 16-byte aligned (the interpreter runs
    them as indexed loads); elsewhere KV_TMA falls back to pointer loads, same results."""
    dims = _dims(2, hd, 8 if hd % 2 == 0 else 6)
    cache = torch.zeros(2, 50, hd, dtype=dtype, device=DEVICE)
    assert (fa._kv_descriptors(cache, cache.clone(), 16, max(16, 1 << (hd - 1).bit_length()))
            is not None) == usable
    cfg = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2, KV_LOAD=KV_TMA, LOOP=LOOP_PLAIN)
    _check_cfg(30, 9, dims, dtype, cfg, seed=hd)


def test_attention_rejects_unknown_knobs():
    inputs = _inputs(4, SMALL, torch.float32, seed=0, start_pos=0, max_ctx=6)
    qg, k, v, qw, kw, kc, vc = inputs
    out = torch.empty(4, 4 * 48, device=DEVICE)
    for bad in (dict(KV_LOAD=3), dict(LOOP=0)):
        with pytest.raises(ValueError):
            attention_prefill(qg, k, v, qw, kw, kc, vc, 0, out, **SMALL, config=bad)


def test_built_in_config_keys():
    """The built-in config carries exactly the keys the tile table holds, at every length."""
    for T in (1, 5, 64, 2048, 8192):
        for hdp, gp in ((256, 4), (64, 1)):
            cfg = fa._attention_config(T, hdp, gp)
            assert set(cfg) == set(fa.ATTN_KEYS)
            assert cfg["BLOCK_M"] >= gp and cfg["BLOCK_M"] & (cfg["BLOCK_M"] - 1) == 0


def test_packaged_table_entries_carry_the_launcher_keys():
    """A table entry with other keys is silently skipped (tuned_config): the packaged table's
    attention entries must carry exactly ATTN_KEYS, with knob values the launcher accepts."""
    import json
    from tritonchat.kernels.gemm import TUNING_PATH
    entries = [e for t in json.loads(open(TUNING_PATH).read())["tables"]
               for name, per_t in t["configs"].items() if name.startswith("flash_attention_")
               for e in per_t.values()]
    assert entries
    for e in entries:
        assert set(e) == set(fa.ATTN_KEYS), e
        assert e["KV_LOAD"] in (KV_POINTERS, KV_TMA) and e["LOOP"] in (LOOP_PLAIN, LOOP_WARP_SPEC)


@pytest.mark.slow
def test_reference_matches_transformers():
    """The reference against HF's own Qwen3_5Attention (eager, fp32), positions 0..T-1."""
    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    T, H, Hkv, hd, D = 11, 4, 2, 48, 64
    cfg = Qwen3_5TextConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=Hkv, head_dim=hd,
                            num_hidden_layers=4, intermediate_size=96, vocab_size=128,
                            rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                 partial_rotary_factor=0.25))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = mod.Qwen3_5Attention(cfg, layer_idx=3).to(DEVICE)
    with torch.no_grad():
        attn.q_norm.weight.normal_(0, 0.3)
        attn.k_norm.weight.normal_(0, 0.3)
    rotary = mod.Qwen3_5TextRotaryEmbedding(cfg).to(DEVICE)
    u = torch.randn(1, T, D, device=DEVICE)
    pos = torch.arange(T, device=DEVICE)[None]
    mask = torch.full((T, T), float("-inf"), device=DEVICE).triu(1)[None, None]
    with torch.no_grad():
        hf, _ = attn(u, rotary(u, pos), mask)
        kc = torch.zeros(Hkv, T, hd, device=DEVICE)
        vc = torch.zeros(Hkv, T, hd, device=DEVICE)
        out = torch.empty(T, H * hd, device=DEVICE)
        attention_prefill_ref(attn.q_proj(u[0]), attn.k_proj(u[0]), attn.v_proj(u[0]),
                              attn.q_norm.weight, attn.k_norm.weight, kc, vc, 0, out,
                              num_heads=H, num_kv_heads=Hkv, head_dim=hd, rotary_dim=hd // 4,
                              rope_theta=10000.0, eps=cfg.rms_norm_eps)
        ours = attn.o_proj(out)
    torch.testing.assert_close(ours, hf[0], rtol=1e-5, atol=1e-5)


def test_attention_rejects_bad_arguments():
    inputs = _inputs(4, SMALL, torch.float32, seed=0, start_pos=0, max_ctx=6)
    qg, k, v, qw, kw, kc, vc = inputs
    out = torch.empty(4, 4 * 48, device=DEVICE)
    with pytest.raises(ValueError):
        attention_prefill(qg, k, v, qw, kw, kc, vc, 3, out, **SMALL)        # 3 + 4 > max_ctx
    with pytest.raises(ValueError):
        attention_prefill(qg, k, v, qw, kw, kc, vc, 0, out, **dict(SMALL, rotary_dim=11))
    with pytest.raises(TypeError):
        attention_prefill(qg, k, v, qw, kw, kc.half(), vc, 0, out, **SMALL)
    with pytest.raises(ValueError):          # a tile row count that is not a power of two
        attention_prefill(qg, k, v, qw, kw, kc, vc, 0, out, **SMALL,
                          config=dict(BLOCK_M=48, BLOCK_N=32, num_warps=4, num_stages=2))


# ------------------------------------------------------------------------------------------
# GPU twins: bf16 at the true 0.8B attention shape (8 heads, 2 kv heads, head_dim 256)
# ------------------------------------------------------------------------------------------
TRUE = dict(num_heads=8, num_kv_heads=2, head_dim=256, rotary_dim=64, rope_theta=1e7, eps=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("start_pos", [0, 300])
def test_attention_true_shape_bf16(start_pos):
    T = 2048
    inputs = _inputs(T, TRUE, torch.bfloat16, seed=1, start_pos=start_pos, max_ctx=start_pos + T + 64)
    out, kc, vc = _run(attention_prefill, inputs, start_pos, TRUE)
    ref, kc_ref, vc_ref = _run(attention_prefill_ref, inputs, start_pos, TRUE)
    end = start_pos + T
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kc[:, :end], kc_ref[:, :end], rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(vc[:, :end], vc_ref[:, :end], rtol=0, atol=0)


@pytest.mark.gpu
def test_attention_32k_prompt_bf16():
    """A 32768-token prompt runs within memory; its last rows match the reference computed
    over the cache the kernel wrote."""
    T, tail = 32768, 16
    inputs = _inputs(T, TRUE, torch.bfloat16, seed=2, start_pos=0, max_ctx=T)
    out, kc, vc = _run(attention_prefill, inputs, 0, TRUE)
    assert torch.isfinite(out).all()
    qg, k, v, qw, kw, _, _ = inputs
    ref, _, _ = _run(attention_prefill_ref, (qg[-tail:], k[-tail:], v[-tail:], qw, kw, kc, vc),
                     T - tail, TRUE)
    torch.testing.assert_close(out[-tail:], ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T,start_pos", [(128, 0), (2048, 300)])
def test_attention_pdl_true_shape_bf16_gives_the_same_bits(T, start_pos):
    """On the device: the K/V pass and the attention pass launched with PDL (the attention pass
    reading the cache rows the K/V pass just wrote) give the bits they give without it, the
    start from the device as in the prefill graph."""
    pdl = pdl_mode(True, False, DEVICE)
    assert pdl
    inputs = _inputs(T, TRUE, torch.bfloat16, seed=3, start_pos=start_pos, max_ctx=start_pos + T + 64)
    start = torch.tensor([start_pos], dtype=torch.int32, device=DEVICE)
    want = _run(attention_prefill, inputs, start, TRUE)
    for _ in range(2):
        got = _run(functools.partial(attention_prefill, pdl=pdl), inputs, start, TRUE)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
