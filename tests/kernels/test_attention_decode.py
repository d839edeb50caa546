"""kernels/attention_decode.py against reference.attention_decode_ref: gated attention decode
(QK norm, partial RoPE, KV write, split-KV GQA softmax, output gate) at awkward positions and
split counts, the merge deferred to the o_proj; cache slots >= p hold NaN so any read of them
shows up."""
import pytest
import torch

from tritonchat.kernels import _common

from tritonchat.kernels.attention_decode import (attention_decode, attention_plan,
                                                 counters_numel, deferred_merge,
                                                 groups_deferrable, partials_numel,
                                                 plan_num_splits, tile_positions)
from tritonchat.kernels.gemv import gemv
from tritonchat.kernels._common import cdiv
from tritonchat.kernels.reference import attention_decode_ref, gemv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
THETA = 1e4
BLOCK_N = 16
# bf16 only on the GPU (the interpreter truncates to bf16, and mis-computes bf16 tl.dot)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _tol(dtype):
    # fp32: order noise and 1-ulp differences of inv_freq. half: one-ulp rounding flips at the
    # norm / RoPE / output roundings and the softmax weights rounded for the P V product.
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=4e-3, atol=4e-3),
            torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}[dtype]


def _setup(H, Hkv, hd, max_ctx, pos, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qn = (torch.randn(hd, generator=g) * 0.2).to(DEVICE, dtype)
    kn = (torch.randn(hd, generator=g) * 0.2).to(DEVICE, dtype)
    k_cache = torch.full((Hkv, max_ctx, hd), float("nan"))
    v_cache = torch.full((Hkv, max_ctx, hd), float("nan"))
    k_cache[:, :pos] = torch.randn(Hkv, pos, hd, generator=g) * 2
    v_cache[:, :pos] = torch.randn(Hkv, pos, hd, generator=g)
    return qn, kn, k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), g


def _token(H, Hkv, hd, dtype, g):
    qg = (torch.randn(H * 2 * hd, generator=g) * 2).to(DEVICE, dtype)
    k = (torch.randn(Hkv * hd, generator=g) * 2).to(DEVICE, dtype)
    v = torch.randn(Hkv * hd, generator=g).to(DEVICE, dtype)
    return qg, k, v


def _step(qg, k, v, qn, kn, kc, vc, pos, H, Hkv, hd, rot, splits, dtype, block_n=BLOCK_N,
          theta=THETA, merge_splits=None, one_level_splits=None):
    kw = dict(num_heads=H, num_kv_heads=Hkv, head_dim=hd, rotary_dim=rot, rope_theta=theta,
              eps=EPS)
    want, want_kc, want_vc = attention_decode_ref(qg, k, v, qn, kn, kc, vc, pos, **kw)
    out = torch.full((H * hd,), float("nan"), device=DEVICE, dtype=dtype)
    merge = merge_splits or 8
    partials = torch.full((partials_numel(H, hd, splits, merge),), float("nan"), device=DEVICE)
    counters = torch.zeros(counters_numel(Hkv, splits, merge), device=DEVICE, dtype=torch.int32)
    attention_decode(qg, k, v, qn, kn, kc, vc, torch.tensor([pos], device=DEVICE,
                                                            dtype=torch.int32),
                     out, partials, counters, num_splits=splits, block_n=block_n,
                     merge_splits=merge_splits, one_level_splits=one_level_splits, **kw)
    assert not counters.any()                  # left at zero for the next launch
    return out, want, want_kc, want_vc


def _check(kc, vc, out, want, want_kc, want_vc, pos, dtype):
    tol = _tol(dtype)
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(kc[:, pos], want_kc[:, pos], **tol)
    assert torch.equal(vc[:, pos], want_vc[:, pos])                 # raw v, stored as is
    # nothing else in the caches moved (NaN == NaN here)
    for c, w in ((kc, want_kc), (vc, want_vc)):
        other = torch.ones(c.shape[1], dtype=torch.bool, device=c.device)
        other[pos] = False
        torch.testing.assert_close(c[:, other], w[:, other], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 2, 3, 8])
@pytest.mark.parametrize("pos", [0, 1, BLOCK_N - 1, BLOCK_N, BLOCK_N + 1, 40, 70])
def test_attention_positions_and_splits(pos, splits, dtype):
    # head_dim 48 (not a power of two), rotary 16, GQA group 2; 40 and 70 span several splits
    H, Hkv, hd, rot = 4, 2, 48, 16
    qn, kn, kc, vc, g = _setup(H, Hkv, hd, 96, pos, dtype, seed=pos)
    qg, k, v = _token(H, Hkv, hd, dtype, g)
    out, want, want_kc, want_vc = _step(qg, k, v, qn, kn, kc, vc, pos, H, Hkv, hd, rot, splits,
                                        dtype)
    _check(kc, vc, out, want, want_kc, want_vc, pos, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hkv,hd,rot", [(8, 2, 32, 32), (2, 2, 16, 8), (4, 1, 64, 64),
                                          (6, 3, 40, 24)],
                         ids=["group4-fullrot", "mha", "group4-mqa-hd64", "group2-hd40"])
def test_attention_shapes(H, Hkv, hd, rot, dtype):
    pos, splits = 37, 3
    qn, kn, kc, vc, g = _setup(H, Hkv, hd, 64, pos, dtype, seed=hd)
    qg, k, v = _token(H, Hkv, hd, dtype, g)
    out, want, want_kc, want_vc = _step(qg, k, v, qn, kn, kc, vc, pos, H, Hkv, hd, rot, splits,
                                        dtype)
    _check(kc, vc, out, want, want_kc, want_vc, pos, dtype)


def _deferred_chain(pos, splits, defer, dtype, seed, merge=None, groups=False):
    """attention_decode(defer_splits=defer, defer_groups=groups) at `pos`, then the o_proj
    (gemv with merge=, residual): (the attention's out, started as NaN; the o_proj's
    result; the reference attention, output gate and o_proj). The counters end at zero."""
    H, Hkv, hd, rot, n_out = 4, 2, 32, 16, 24          # K = 128: heads and head size powers of 2
    qn, kn, kc, vc, g = _setup(H, Hkv, hd, 128, pos, dtype, seed=seed)
    qg, k, v = _token(H, Hkv, hd, dtype, g)
    W = (torch.randn(n_out, H * hd, generator=g) * (H * hd) ** -0.5).to(DEVICE, dtype)
    h = torch.randn(n_out, generator=g).to(DEVICE, dtype)
    kw = dict(num_heads=H, num_kv_heads=Hkv, head_dim=hd, rotary_dim=rot, rope_theta=THETA,
              eps=EPS)
    o_ref, _, _ = attention_decode_ref(qg, k, v, qn, kn, kc, vc, pos, **kw)
    want, _ = gemv_ref(o_ref, W, residual=h)
    ms = merge or 8
    out = torch.full((H * hd,), float("nan"), device=DEVICE, dtype=dtype)
    partials = torch.full((partials_numel(H, hd, splits, ms),), float("nan"), device=DEVICE)
    counters = torch.zeros(counters_numel(Hkv, splits, ms), device=DEVICE, dtype=torch.int32)
    p = torch.tensor([pos], device=DEVICE, dtype=torch.int32)
    attention_decode(qg, k, v, qn, kn, kc, vc, p, out, partials, counters, num_splits=splits,
                     block_n=BLOCK_N, merge_splits=merge, defer_splits=defer,
                     defer_groups=groups, **kw)
    assert not counters.any()
    m = deferred_merge(qg, p, partials, num_heads=H, num_kv_heads=Hkv, head_dim=hd,
                       num_splits=splits, defer_splits=defer, block_n=BLOCK_N,
                       merge_splits=merge, defer_groups=groups)
    y = h.clone()
    gemv(out, W, y, residual=y, merge=m, block_n=8, num_warps=4)
    return out, y, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pos,splits,defer", [(0, 4, 4), (BLOCK_N - 1, 4, 1), (BLOCK_N, 4, 2),
                                              (40, 4, 2), (40, 4, 3), (63, 8, 4), (64, 8, 4),
                                              (70, 8, 16)])
def test_attention_merge_deferred_to_the_o_proj(pos, splits, defer, dtype):
    """attention_decode(defer_splits=D), then the o_proj (gemv with merge=, residual)
    equals the reference attention, output gate and o_proj: with <= D active splits the o_proj
    merges the split partials itself (and `out` is left untouched), with more it reads the
    attention's own merge (active splits here: 1, 1, 2, 3, 3, 4, 5, 5)."""
    out, y, want = _deferred_chain(pos, splits, defer, dtype, seed=pos + 7 * defer)
    per_split = cdiv(cdiv(pos + 1, splits), BLOCK_N) * BLOCK_N
    deferred = min(cdiv(pos + 1, per_split), splits) <= defer
    assert torch.isnan(out).all() == deferred
    torch.testing.assert_close(y, want, **{k2: 2 * v2 for k2, v2 in _tol(dtype).items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pos,splits,defer,merge", [(70, 8, 4, 2), (70, 8, 2, 4), (127, 8, 4, 2),
                                                    (40, 8, 4, 2), (16, 8, 1, 8), (100, 8, 3, 4),
                                                    (0, 8, 2, 4)])
def test_attention_group_merge_deferred_to_the_o_proj(pos, splits, defer, merge, dtype):
    """attention_decode(defer_splits=D, defer_groups=True), then the o_proj: up to D active
    splits the o_proj merges the split partials, past D the attention merges each group of
    merge_splits splits and the o_proj merges the group partials (active splits here: 5, 5, 8,
    3, 2, 7, 1; groups past D: 3, 2, 4, -, 1, 2, -). `out` is never written; the result
    equals the reference attention, output gate and o_proj."""
    assert groups_deferrable(splits, defer, merge)
    out, y, want = _deferred_chain(pos, splits, defer, dtype, seed=pos + 5 * merge + defer,
                                   merge=merge, groups=True)
    assert torch.isnan(out).all()
    torch.testing.assert_close(y, want, **{k2: 2 * v2 for k2, v2 in _tol(dtype).items()})


def test_groups_deferrable():
    assert groups_deferrable(66, 12) and groups_deferrable(66, 9) and not groups_deferrable(66, 8)
    assert not groups_deferrable(8, 0) and groups_deferrable(8, 1) and groups_deferrable(8, 2, 4)
    assert not groups_deferrable(8, 1, 4)


def test_attention_merge_in_the_o_proj_validates():
    H, Hkv, hd, n_out, splits = 4, 2, 32, 8, 4
    x = torch.zeros(H * hd, device=DEVICE)
    W = torch.zeros(n_out, H * hd, device=DEVICE)
    y = torch.zeros(n_out, device=DEVICE)
    qg = torch.zeros(2 * H * hd, device=DEVICE)
    p = torch.zeros(1, device=DEVICE, dtype=torch.int32)
    part = torch.zeros(partials_numel(H, hd, splits), device=DEVICE)
    m = deferred_merge(qg, p, part, num_heads=H, num_kv_heads=Hkv, head_dim=hd,
                       num_splits=splits, defer_splits=4, block_n=BLOCK_N)
    with pytest.raises(ValueError):       # the grid form cannot merge
        gemv(x, W, y, residual=y, merge=m, persistent=0)
    with pytest.raises(ValueError):       # K is not heads x head_dim
        gemv(x[:64], W[:, :64].contiguous(), y, residual=y, merge=m)
    with pytest.raises(ValueError):       # partials sized for fewer splits
        gemv(x, W, y, residual=y, merge=m._replace(num_splits=splits * 4))
    with pytest.raises(ValueError):       # more than a consumer merges at once
        gemv(x, W, y, residual=y, merge=m._replace(defer_splits=64))
    with pytest.raises(ValueError):       # 2 groups of 2 splits, one record merged
        gemv(x, W, y, residual=y, merge=m._replace(defer_splits=1, merge_splits=2,
                                                         defer_groups=True))
    with pytest.raises(ValueError):       # merge groups that are not a power of two
        gemv(x, W, y, residual=y, merge=m._replace(merge_splits=3))
    def attend(**kw):
        attention_decode(qg, x[:Hkv * hd], x[:Hkv * hd], x[:hd], x[:hd],
                         torch.zeros(Hkv, 16, hd, device=DEVICE),
                         torch.zeros(Hkv, 16, hd, device=DEVICE), p, x, part,
                         torch.zeros(counters_numel(Hkv, splits), device=DEVICE,
                                     dtype=torch.int32),
                         num_heads=H, num_kv_heads=Hkv, head_dim=hd, rotary_dim=16,
                         rope_theta=THETA, eps=EPS, num_splits=splits, **kw)
    with pytest.raises(ValueError):       # more splits deferred than a consumer merges
        attend(defer_splits=64)
    with pytest.raises(ValueError):       # defer_groups with more groups than defer_splits
        attend(defer_splits=1, merge_splits=2, defer_groups=True)


@pytest.mark.parametrize("one_level", [0, None], ids=["two-levels", "default"])
@pytest.mark.parametrize("merge_splits", [pytest.param(1, marks=pytest.mark.slow), 2,
                                          pytest.param(4, marks=pytest.mark.slow), 8])
@pytest.mark.parametrize("pos", [16 * 7 - 1, 16 * 7, 16 * 7 + 1])
def test_attention_merge_over_groups_of_splits(pos, merge_splits, one_level):
    # 8 splits of 16 positions: 7 or 8 of them hold positions, merged 1, 2, 4 or 8 at a time
    # by one merger (default: up to 4 chunks; the online rescaling across chunks, a last chunk
    # only partly active), or in two levels (groups of that size: group partials rescaled
    # across groups, a last group of one split; 8: one group, merged straight into the output)
    H, Hkv, hd, rot, dtype = 6, 2, 40, 24, torch.float32
    qn, kn, kc, vc, g = _setup(H, Hkv, hd, 136, pos, dtype, seed=pos + merge_splits)
    qg, k, v = _token(H, Hkv, hd, dtype, g)
    out, want, want_kc, want_vc = _step(qg, k, v, qn, kn, kc, vc, pos, H, Hkv, hd, rot, 8, dtype,
                                        merge_splits=merge_splits, one_level_splits=one_level)
    _check(kc, vc, out, want, want_kc, want_vc, pos, dtype)


@pytest.mark.slow
def test_attention_merge_of_more_groups_than_one_chunk():
    # 40 splits of 16 positions in groups of 2 (past the default one-level 4 x 2): 20 group
    # partials, merged 16 then 4 (the group level's own chunk loop)
    H, Hkv, hd, rot, dtype, pos = 4, 2, 24, 8, torch.float32, 16 * 40 - 3
    qn, kn, kc, vc, g = _setup(H, Hkv, hd, 16 * 40, pos, dtype, seed=40)
    qg, k, v = _token(H, Hkv, hd, dtype, g)
    out, want, want_kc, want_vc = _step(qg, k, v, qn, kn, kc, vc, pos, H, Hkv, hd, rot, 40,
                                        dtype, merge_splits=2)
    _check(kc, vc, out, want, want_kc, want_vc, pos, dtype)


@pytest.mark.slow
def test_attention_consecutive_steps_fill_the_cache():
    # a conversation from an empty cache: each step writes slot p and reads 0..p
    H, Hkv, hd, rot, dtype = 4, 2, 24, 8, torch.float16
    qn, kn, kc, vc, g = _setup(H, Hkv, hd, 40, 0, dtype, seed=1)
    for pos in range(0, 35):
        qg, k, v = _token(H, Hkv, hd, dtype, g)
        out, want, want_kc, want_vc = _step(qg, k, v, qn, kn, kc, vc, pos, H, Hkv, hd, rot, 2,
                                            dtype)
        _check(kc, vc, out, want, want_kc, want_vc, pos, dtype)
        kc[:, pos] = want_kc[:, pos]               # stay on the reference's trajectory


def test_attention_long_rope_position():
    # theta 1e7 and a position in the thousands: angles well past 2 pi
    H, Hkv, hd, rot, dtype = 2, 1, 32, 16, torch.float32
    pos = 3000
    qn, kn, kc, vc, g = _setup(H, Hkv, hd, pos + 4, pos, dtype, seed=3)
    qg, k, v = _token(H, Hkv, hd, dtype, g)
    out, want, want_kc, want_vc = _step(qg, k, v, qn, kn, kc, vc, pos, H, Hkv, hd, rot, 4,
                                        dtype, block_n=64, theta=1e7)
    # fp32 angles p * inv_freq carry ~p * 1e-7 rad of inv_freq rounding
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kc[:, pos], want_kc[:, pos], rtol=1e-3, atol=1e-3)


def test_attention_ref_matches_prefill_reference():
    """Independent references of the same spec: decode at p == prefill of one token at p."""
    from tritonchat.kernels import reference as pre
    H, Hkv, hd, rot, dtype, pos = 4, 2, 48, 16, torch.float16, 21
    qn, kn, kc, vc, g = _setup(H, Hkv, hd, 32, pos, dtype, seed=4)
    qg, k, v = _token(H, Hkv, hd, dtype, g)
    kw = dict(num_heads=H, num_kv_heads=Hkv, head_dim=hd, rotary_dim=rot, rope_theta=THETA,
              eps=EPS)
    want, want_kc, _ = attention_decode_ref(qg, k, v, qn, kn, kc, vc, pos, **kw)
    out = torch.empty(1, H * hd, device=DEVICE, dtype=dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    pre.attention_prefill_ref(qg.view(1, -1), k.view(1, -1), v.view(1, -1), qn, kn, kc2, vc2,
                              pos, out, **kw)
    torch.testing.assert_close(kc2[:, pos], want_kc[:, pos], rtol=0, atol=0)
    torch.testing.assert_close(out.view(-1), want, rtol=2e-3, atol=2e-3)


def test_attention_validates():
    H, Hkv, hd = 4, 2, 16
    qn, kn, kc, vc, g = _setup(H, Hkv, hd, 8, 2, torch.float32, seed=0)
    qg, k, v = _token(H, Hkv, hd, torch.float32, g)
    pos = torch.tensor([2], device=DEVICE, dtype=torch.int32)
    out = torch.empty(H * hd, device=DEVICE)
    kw = dict(num_heads=H, num_kv_heads=Hkv, head_dim=hd, rotary_dim=8, rope_theta=THETA,
              eps=EPS, num_splits=2)
    cnt = torch.zeros(counters_numel(Hkv, 2), device=DEVICE, dtype=torch.int32)
    with pytest.raises(ValueError):       # partials too small
        attention_decode(qg, k, v, qn, kn, kc, vc, pos, out, torch.empty(10, device=DEVICE), cnt,
                         **kw)
    part = torch.empty(partials_numel(H, hd, 2), device=DEVICE)
    with pytest.raises(ValueError):       # odd rotary dim
        attention_decode(qg, k, v, qn, kn, kc, vc, pos, out, part, cnt, **{**kw, "rotary_dim": 7})
    with pytest.raises(ValueError):       # cache of the wrong head count
        attention_decode(qg, k, v, qn, kn, kc[:1], vc[:1], pos, out, part, cnt, **kw)
    with pytest.raises(ValueError):       # counters of the wrong dtype / too few
        attention_decode(qg, k, v, qn, kn, kc, vc, pos, out, part, cnt.float(), **kw)
    with pytest.raises(ValueError):
        attention_decode(qg, k, v, qn, kn, kc, vc, pos, out, part, cnt[:1], **kw)
    assert plan_num_splits(32768, 2) == 66 and plan_num_splits(40, 2) == 2
    # 66 splits in groups of 8: 9 group records per head, 9 + 1 counters per KV head
    assert partials_numel(8, 256, 66) == 8 * (66 + 9) * 258
    assert counters_numel(2, 66) == 20 and counters_numel(2, 5) == 4


@pytest.mark.parametrize("ctx", [40, 100, 1000, 4000])
def test_planned_splits_all_active_at_the_last_position(ctx):
    """With the launch's own tile, every split the engine allocates holds positions when the
    context is full (up to 66 tiles): the kernel's split length and active count at p = ctx-1."""
    bn = tile_positions(8, 2, 256)
    s = plan_num_splits(ctx, 2, sm_count=132, block_n=bn)
    per_split = cdiv(cdiv(ctx, s), bn) * bn
    assert min(cdiv(ctx, per_split), s) == s


# the shipped decode table's tile for the 0.8B attention (whatever a re-tune puts there)
_PLAN_BN = attention_plan(8, 2, 256).get("block_n", 32)


@pytest.mark.parametrize("pos", [0, _PLAN_BN - 1, _PLAN_BN, _PLAN_BN + 1, 200])
def test_attention_model_shape_with_the_table_plan(pos):
    """The 0.8B shape (8 q heads, 2 kv heads, head 256, rotary 64) with block_n, num_warps and
    num_stages left to the decode table's plan: the sizes the GPU runs, against the reference;
    the middle positions straddle the plan's tile."""
    H, Hkv, hd, rot, dtype = 8, 2, 256, 64, torch.float32
    qn, kn, kc, vc, g = _setup(H, Hkv, hd, 256, pos, dtype, seed=pos + 3)
    qg, k, v = _token(H, Hkv, hd, dtype, g)
    out, want, want_kc, want_vc = _step(qg, k, v, qn, kn, kc, vc, pos, H, Hkv, hd, rot, 3,
                                        dtype, block_n=None)
    # fp32, but RoPE angles up to 200 rad at head 256: a 1-ulp angle difference (the kernel's
    # exp2 inverse frequencies vs the reference's pow) moves a rotated value by ~1e-5
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kc[:, pos], want_kc[:, pos], rtol=1e-4, atol=1e-4)
    assert torch.equal(vc[:, pos], want_vc[:, pos])


# ------------------------------------------------------------------------------------------
# GPU twins: Qwen3.5-0.8B attention (8 q heads, 2 kv heads, head 256, rotary 64, theta 1e7)
# ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("pos", [0, 1, 31, 32, 33, 1000, 6000])
def test_gpu_attention_model_shape(pos):
    H, Hkv, hd, rot, dtype = 8, 2, 256, 64, torch.bfloat16
    qn, kn, kc, vc, g = _setup(H, Hkv, hd, 8192, pos, dtype, seed=pos)
    for splits in (plan_num_splits(8192, Hkv), 16):
        qg, k, v = _token(H, Hkv, hd, dtype, g)
        kc2, vc2 = kc.clone(), vc.clone()
        out, want, want_kc, want_vc = _step(qg, k, v, qn, kn, kc2, vc2, pos, H, Hkv, hd, rot,
                                            splits, dtype, block_n=None, theta=1e7)
        torch.testing.assert_close(out, want, **_tol(dtype))
        torch.testing.assert_close(kc2[:, pos], want_kc[:, pos], rtol=1.6e-2, atol=1.6e-2)
        assert torch.equal(vc2[:, pos], want_vc[:, pos])


@pytest.mark.gpu
def test_gpu_attention_cuda_graph_replay():
    # captured once at one position, replayed after the device position advanced
    H, Hkv, hd, rot, dtype = 8, 2, 256, 64, torch.bfloat16
    max_ctx, splits = 512, plan_num_splits(512, Hkv)
    qn, kn, kc, vc, g = _setup(H, Hkv, hd, max_ctx, 300, dtype, seed=9)
    qg, k, v = _token(H, Hkv, hd, dtype, g)
    pos = torch.tensor([5], device=DEVICE, dtype=torch.int32)
    out = torch.empty(H * hd, device=DEVICE, dtype=dtype)
    part = torch.empty(partials_numel(H, hd, splits), device=DEVICE)
    cnt = torch.zeros(counters_numel(Hkv, splits), device=DEVICE, dtype=torch.int32)
    kw = dict(num_heads=H, num_kv_heads=Hkv, head_dim=hd, rotary_dim=rot, rope_theta=1e7,
              eps=EPS, num_splits=splits)
    attention_decode(qg, k, v, qn, kn, kc.clone(), vc.clone(), pos, out, part, cnt, **kw)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention_decode(qg, k, v, qn, kn, kc, vc, pos, out, part, cnt, **kw)
    for p in (300, 150, 7):             # descending: the NaN fill keeps 0..p-1 intact
        kc[:, p:] = float("nan")
        vc[:, p:] = float("nan")
        want, want_kc, _ = attention_decode_ref(qg, k, v, qn, kn, kc, vc, p,
                                                **{a: b for a, b in kw.items()
                                                   if a != "num_splits"})
        pos.fill_(p)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, **_tol(dtype))
        torch.testing.assert_close(kc[:, p], want_kc[:, p], rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [False, True], ids=["splits", "groups"])
def test_gpu_attention_merge_deferred_to_the_o_proj_in_a_pdl_graph(groups):
    """The engine's short-context form at the 0.8B shape: the attention leaving up to 12 active
    splits to the persistent o_proj, both captured in one CUDA graph with PDL (the o_proj reads
    the position and the gates before its wait), replayed at positions on both sides of the
    limit (768 positions = 12 splits of 64), against the reference attention and o_proj; with
    defer_groups, past the limit the o_proj merges the attention's group partials (2 at 768,
    3 at 1400, 4 at 2000)."""
    from tritonchat.kernels._common import pdl_mode
    pdl = pdl_mode(True, False, DEVICE)
    H, Hkv, hd, rot, dtype, n_out, defer = 8, 2, 256, 64, torch.bfloat16, 1024, 12
    bn = tile_positions(H, Hkv, hd)
    splits = plan_num_splits(33280, Hkv, block_n=bn)
    qn, kn, kc, vc, g = _setup(H, Hkv, hd, 2048, 2000, dtype, seed=11)
    qg, k, v = _token(H, Hkv, hd, dtype, g)
    W = (torch.randn(n_out, H * hd, generator=g) * (H * hd) ** -0.5).to(DEVICE, dtype)
    h0 = torch.randn(n_out, generator=g).to(DEVICE, dtype)
    out = torch.empty(H * hd, device=DEVICE, dtype=dtype)
    part = torch.empty(partials_numel(H, hd, splits), device=DEVICE)
    cnt = torch.zeros(counters_numel(Hkv, splits), device=DEVICE, dtype=torch.int32)
    pos = torch.tensor([5], device=DEVICE, dtype=torch.int32)
    y = torch.empty_like(h0)
    kw = dict(num_heads=H, num_kv_heads=Hkv, head_dim=hd, rotary_dim=rot, rope_theta=1e7,
              eps=EPS)
    merge = deferred_merge(qg, pos, part, num_heads=H, num_kv_heads=Hkv, head_dim=hd,
                           num_splits=splits, defer_splits=defer, defer_groups=groups)

    def step():
        attention_decode(qg, k, v, qn, kn, kc, vc, pos, out, part, cnt, num_splits=splits,
                         defer_splits=defer, defer_groups=groups, pdl=pdl, **kw)
        y.copy_(h0)
        gemv(out, W, y, residual=y, merge=merge, block_n=8, num_warps=8, persistent=1,
                   pdl=pdl)

    step()                                  # JIT before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for p in (2000, 1400, 768, 767, 700, 64, 5):  # descending: the NaN fill keeps 0..p-1 intact
        kc[:, p:] = float("nan")
        vc[:, p:] = float("nan")
        o_ref, _, _ = attention_decode_ref(qg, k, v, qn, kn, kc, vc, p, **kw)
        want, _ = gemv_ref(o_ref, W, residual=h0)
        out.fill_(float("nan"))
        pos.fill_(p)
        graph.replay()
        torch.cuda.synchronize()
        assert bool(torch.isnan(out).all()) == (groups or cdiv(p + 1, bn) <= defer), p
        torch.testing.assert_close(y, want, rtol=6e-2, atol=6e-2)
        assert not cnt.any()


def test_attention_range_plans_from_the_table(own_table):
    """The attention entry's context_ranges (launch plans over ranges of positions, to the end
    where `below` is absent) are read in ascending order of their start; malformed ones, a
    repeated start, an empty range and sizes out of range or not powers of two are left out;
    the entry's own plan is read as before."""
    from tritonchat.kernels.attention_decode import attention_plan, attention_range_plans
    ok = '"splits_per_sm": 2, "block_n": 32, "num_warps": 4, "num_stages": 2, "merge_splits": 16'
    bad = [  # each breaks one rule
        '{"from": 100, "splits_per_sm": 2, "block_n": 48, "num_warps": 4, "num_stages": 2, "merge_splits": 16}',
        '{"from": 200, "splits_per_sm": 2, "block_n": 8, "num_warps": 4, "num_stages": 2, "merge_splits": 16}',
        '{"from": 300, "splits_per_sm": 5, "block_n": 32, "num_warps": 4, "num_stages": 2, "merge_splits": 16}',
        '{"from": 400, "splits_per_sm": 2, "block_n": 32, "num_warps": 4, "num_stages": 0, "merge_splits": 16}',
        '{"from": 500, "splits_per_sm": 2, "block_n": 32, "num_warps": 4, "num_stages": 2, "merge_splits": 32}',
        '{"from": 600, "splits_per_sm": 2, "block_n": 32, "num_warps": 3, "num_stages": 2, "merge_splits": 16}',
        '{"from": 700, "below": 700, ' + ok + '}', '{"from": -1, ' + ok + '}',
        '{"from": "x", ' + ok + '}', '{"from": 800, "block_n": 32}', '7']
    own_table(
        '{"entries": [{"key": "attention:8x2x256", "block_n": 64, "num_warps": 8, "num_stages": 1,'
        ' "context_ranges": [{"from": 22528, ' + ok + '}, {"from": 1000, "below": 2000, '
        '"splits_per_sm": 1, "block_n": 16, "num_warps": 2, "num_stages": 1, "merge_splits": 2},'
        ' {"from": 22528, ' + ok.replace('"block_n": 32', '"block_n": 64') + '}, '
        + ", ".join(bad) + ']},'
        '{"key": "attention:4x2x64", "context_ranges": {"from": 1}}]}')
    long = dict(splits_per_sm=2, block_n=32, num_warps=4, num_stages=2, merge_splits=16)
    short = dict(splits_per_sm=1, block_n=16, num_warps=2, num_stages=1, merge_splits=2)
    assert attention_range_plans(8, 2, 256) == [(1000, 2000, short), (22528, None, long)]
    assert attention_plan(8, 2, 256) == dict(block_n=64, num_warps=8, num_stages=1)
    assert attention_range_plans(4, 2, 64) == []          # not a list
    assert attention_range_plans(4, 1, 64) == []          # no entry


def test_the_packaged_table_has_the_long_context_attention_range():
    """The packaged table's attention plan for long contexts (measured on the H200) is read."""
    from tritonchat.kernels.attention_decode import attention_range_plans
    _common.clear_table_cache()
    plans = attention_range_plans(8, 2, 256)
    assert [(lo, hi) for lo, hi, _ in plans] == [(22528, None)]
    assert plans[0][2] == dict(splits_per_sm=2, block_n=32, num_warps=4, num_stages=2, merge_splits=16)
