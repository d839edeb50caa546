"""kernels/gemv.py against reference.gemv_ref: the norm prologues (zero-centred RMSNorm, gated
RMSNorm per head), the conv / SiLU*mul / residual epilogues, the in-kernel split-K reduce, the
persistent form, ragged shapes (K and N not multiples of the tiles, one row, one block), the
launch plans from the decode table and the GPU twin at the 0.8B MLP shapes."""
import pytest
import torch

from tests.kernels.util import DEVICE, DTYPES, EPS, Q08, epilogue_case, scratch, tol, vec

from tritonchat.kernels import gemv as gemv_mod
from tritonchat.kernels.gemv import gemv
from tritonchat.kernels.reference import gemv_ref, matvec_ref


# ------------------------------------------------------------------------------------------
# GEMV with the zero-centred RMSNorm prologue
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("epilogue", ["plain", "residual_inplace", "silu_mul", "conv"])
def test_gemv_rms_norm_prologue_epilogues(epilogue, split_k, dtype):
    # 74 rows (37 after SiLU*mul) x K = 200: neither is a multiple of the 8 x 32 tile; the
    # conv epilogue covers 45 channels, so one row block holds conv and plain rows
    g = torch.Generator().manual_seed(split_k * 10 + len(epilogue))
    n_rows, K, block_n = 74, 200, 8
    h = vec(K, g, 3.0, dtype)
    norm_w = vec(K, g, 0.2, dtype)
    W = vec(n_rows * K, g, K ** -0.5, dtype).view(n_rows, K)
    silu = epilogue == "silu_mul"
    n_out = n_rows // 2 if silu else n_rows
    out, kw, ref_kw = epilogue_case(epilogue, n_out, g, dtype, conv_channels=45)
    if epilogue == "conv":
        kw["conv_w"] = kw["conv_w"].unsqueeze(1)                    # nn.Conv1d layout too
    conv_state = kw.get("conv_state")
    want, want_state = gemv_ref(h, W, norm_w=norm_w, eps=EPS, out_dtype=dtype, **ref_kw)
    part, cnt = scratch(n_out, split_k, block_n, silu)
    gemv(h, W, out, norm_w=norm_w, eps=EPS, split_k=split_k, partials=part, counters=cnt,
                 block_n=block_n, block_k=32, num_warps=4, **kw)
    torch.testing.assert_close(out, want, **tol(dtype))
    if epilogue == "conv":
        # the state holds the projection outputs (rounded) of the conv rows
        torch.testing.assert_close(conv_state, want_state, **tol(dtype))
        assert torch.equal(conv_state[:, :-1], ref_kw["conv_state"][:, 1:])
    assert not cnt.any(), "split-K counters must be left at zero for the next launch"


@pytest.mark.parametrize("n_rows,K,block_n,block_k,split_k", [
    (1, 16, 1, 16, 1),         # a single row
    (5, 17, 4, 16, 2),         # K one past the tile, two splits of uneven length
    (64, 128, 16, 64, 2),      # exact tiling: the unmasked path
    (33, 48, 32, 128, 1),      # tile wider than K
    (130, 80, 64, 16, 4),      # many K steps, four splits
    (24, 96, 8, 16, 8),        # split_k > K blocks / 2: splits of one tile
    (6, 1100, 4, 256, 2),      # K past the one-block norm (1024): the looped norm, split
])
def test_gemv_shapes(n_rows, K, block_n, block_k, split_k):
    g = torch.Generator().manual_seed(n_rows + K)
    h = vec(K, g)
    norm_w = vec(K, g, 0.2)
    W = vec(n_rows * K, g, K ** -0.5).view(n_rows, K)
    for nw in (None, norm_w):
        out = torch.full((n_rows,), float("nan"), device=DEVICE)
        part, cnt = scratch(n_rows, split_k, block_n)
        gemv(h, W, out, norm_w=nw, eps=EPS, split_k=split_k, partials=part, counters=cnt,
                   block_n=block_n, block_k=block_k)
        want, _ = gemv_ref(h, W, norm_w=nw, eps=EPS)
        torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
        assert not cnt.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_rows,K,block_n", [
    (74, 200, 8),      # 10 row blocks over 4 programs (the interpreter's "SMs"), K masked
    (1, 16, 1),        # one row, one program
    (64, 256, 4),      # 16 blocks: each program takes 4, no masks
    (33, 48, 32),      # one partial block
])
@pytest.mark.parametrize("epilogue", ["plain", "residual_inplace", "silu_mul", "conv"])
def test_gemv_persistent_form(epilogue, n_rows, K, block_n, dtype):
    """The persistent direct form (programs striding over row blocks, one tile of look-ahead)
    equals the reference for every epilogue, with and without the RMSNorm prologue."""
    if epilogue == "silu_mul" and n_rows % 2:
        n_rows += 1
    g = torch.Generator().manual_seed(n_rows * 7 + K + len(epilogue))
    h = vec(K, g, 3.0, dtype)
    norm_w = vec(K, g, 0.2, dtype)
    W = vec(n_rows * K, g, K ** -0.5, dtype).view(n_rows, K)
    silu = epilogue == "silu_mul"
    n_out = n_rows // 2 if silu else n_rows
    for nw in (norm_w, None):
        out, kw, ref_kw = epilogue_case(epilogue, n_out, g, dtype, conv_channels=min(45, n_out))
        conv_state = kw.get("conv_state")
        want, want_state = gemv_ref(h, W, norm_w=nw, eps=EPS, out_dtype=dtype, **ref_kw)
        gemv(h, W, out, norm_w=nw, eps=EPS, split_k=1, block_n=block_n, num_warps=4,
                   persistent=1, **kw)
        torch.testing.assert_close(out, want, **tol(dtype))
        if epilogue == "conv":
            torch.testing.assert_close(conv_state, want_state, **tol(dtype))


def test_gemv_persistent_form_refuses_what_it_cannot_do():
    g = torch.Generator().manual_seed(3)
    x, W = vec(64, g), vec(16 * 64, g).view(16, 64)
    out = torch.empty(16, device=DEVICE)
    with pytest.raises(ValueError, match="persistent"):
        gemv(x, W, out, split_k=2, persistent=1,
                   partials=torch.zeros(64, device=DEVICE), counters=torch.zeros(16, device=DEVICE, dtype=torch.int32))
    x3, W3 = vec(96, g), vec(16 * 96, g).view(16, 96)      # three heads: not a power of two
    with pytest.raises(ValueError, match="persistent"):
        gemv(x3, W3, out, norm_w=vec(32, g), gate=vec(96, g), head_dim=32, split_k=1,
                   block_k=32, persistent=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dv,n_out,block_n", [
    (4, 32, 37, 8),        # 5 row blocks over 4 programs, the last one partial
    (1, 16, 8, 8),         # one head, one block
    (2, 128, 64, 4),       # the 0.8B head size, 16 blocks
])
def test_gemv_gated_norm_residual_persistent_form(heads, dv, n_out, block_n, dtype):
    """The persistent form with the gated-norm prologue (the whole [heads, dv] input one tile)
    and the residual epilogue."""
    g = torch.Generator().manual_seed(heads * dv + n_out)
    K = heads * dv
    o = vec(K, g, 2.0, dtype)
    z = vec(K, g, 2.0, dtype)
    norm_w = (1 + 0.1 * torch.randn(dv, generator=g)).to(DEVICE)
    W = vec(n_out * K, g, K ** -0.5, dtype).view(n_out, K)
    res = vec(n_out, g, 1.0, dtype)
    h = res.clone()
    gemv(o, W, h, norm_w=norm_w, gate=z, head_dim=dv, eps=EPS, residual=h, split_k=1,
               block_n=block_n, num_warps=4, persistent=1)
    want, _ = gemv_ref(o, W, norm_w=norm_w, gate=z, head_dim=dv, eps=EPS, residual=res)
    torch.testing.assert_close(h, want, **tol(dtype))


def test_gemv_split_k_reproducible_and_replayable():
    # the same launch twice (as a graph replay would) gives bit-identical results, and a split
    # count that differs only in summation order stays within fp32 noise
    g = torch.Generator().manual_seed(3)
    h, norm_w = vec(300, g), vec(300, g, 0.2)
    W = vec(70 * 300, g, 300 ** -0.5).view(70, 300)
    part, cnt = scratch(70, 4, 8)
    outs = []
    for _ in range(2):
        out = torch.empty(70, device=DEVICE)
        gemv(h, W, out, norm_w=norm_w, split_k=4, partials=part, counters=cnt,
                   block_n=8, block_k=32)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    one = torch.empty(70, device=DEVICE)
    gemv(h, W, one, norm_w=norm_w, split_k=1, block_n=8, block_k=32)
    torch.testing.assert_close(outs[0], one, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# GEMV with the gated-RMSNorm prologue (GDN out_proj), residual epilogue
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dv,block_k,split_k", [
    (4, 40, 32, 1),        # non-power-of-two head: a masked second tile per head
    (4, 40, 16, 3),        # three tiles per head; 3 splits over 4 heads -> 2 splits of 2
    (3, 24, 32, 2),        # block_k wider than the head
    (4, 32, 32, 4),        # exact tiles, one head per split
    (2, 128, 64, 1),       # the 0.8B head size
])
def test_gemv_gated_norm_residual(heads, dv, block_k, split_k, dtype):
    g = torch.Generator().manual_seed(heads * dv + split_k)
    K, n_out, block_n = heads * dv, 37, 8
    o = vec(K, g, 2.0, dtype)
    z = vec(K, g, 2.0, dtype)
    norm_w = (1 + 0.1 * torch.randn(dv, generator=g)).to(DEVICE)          # fp32, as stored
    W = vec(n_out * K, g, K ** -0.5, dtype).view(n_out, K)
    res = vec(n_out, g, 1.0, dtype)
    h = res.clone()
    part, cnt = scratch(n_out, split_k, block_n)
    gemv(o, W, h, norm_w=norm_w, gate=z, head_dim=dv, eps=EPS, residual=h,
               split_k=split_k, partials=part, counters=cnt, block_n=block_n, block_k=block_k)
    want, _ = gemv_ref(o, W, norm_w=norm_w, gate=z, head_dim=dv, eps=EPS, residual=res)
    torch.testing.assert_close(h, want, **tol(dtype))
    assert not cnt.any()


# ------------------------------------------------------------------------------------------


def test_gemv_validates():
    x = torch.zeros(32, device=DEVICE)
    W = torch.zeros(16, 32, device=DEVICE)
    out = torch.zeros(16, device=DEVICE)
    with pytest.raises(ValueError):                     # two epilogues
        gemv(x, W, out, residual=out, silu_mul=True)
    with pytest.raises(ValueError):                     # split-K without scratch
        gemv(x, W, out, split_k=2, block_n=4, block_k=16)
    with pytest.raises(ValueError):                     # gated norm: head_dim must divide K
        gemv(x, W, out, norm_w=torch.zeros(5, device=DEVICE), gate=x, head_dim=5)
    with pytest.raises(ValueError):                     # gated norm: block_k beyond the head
        gemv(x, W, out, norm_w=torch.zeros(16, device=DEVICE), gate=x, head_dim=16,
                   block_k=32)
    with pytest.raises(ValueError):                     # conv state shape
        gemv(x, W, out, conv_state=torch.zeros(8, 2, device=DEVICE),
                   conv_w=torch.zeros(8, 4, device=DEVICE))


# ------------------------------------------------------------------------------------------
# GPU twin: bf16 at the true 0.8B MLP shapes
# ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [None, 1, 2])
def test_gpu_mlp_model_shape(split_k):
    dt = torch.bfloat16
    D, I = Q08["D"], Q08["I"]
    g = torch.Generator().manual_seed(4)
    h = vec(D, g, 2.0, dt)
    post_norm = vec(D, g, 0.2, dt)
    gate_up = vec(2 * I * D, g, D ** -0.5, dt).view(2 * I, D)
    down = vec(D * I, g, I ** -0.5, dt).view(D, I)
    part = torch.zeros(8 * 2 * I, device=DEVICE)
    cnt = torch.zeros(2 * I, device=DEVICE, dtype=torch.int32)
    act = torch.empty(I, device=DEVICE, dtype=dt)
    want_act, _ = gemv_ref(h, gate_up, norm_w=post_norm, eps=EPS, silu_mul=True)
    gemv(h, gate_up, act, norm_w=post_norm, eps=EPS, silu_mul=True, split_k=split_k,
                 partials=part, counters=cnt)
    torch.testing.assert_close(act.float(), want_act.float(), rtol=2e-2, atol=2e-2)
    want_h = matvec_ref(act, down, residual=h, out_dtype=dt)
    gemv(act, down, h, residual=h, split_k=split_k, partials=part, counters=cnt)
    torch.testing.assert_close(h.float(), want_h.float(), rtol=2e-2, atol=2e-2)
    assert not cnt.any()


# ------------------------------------------------------------------------------------------
# the tuning table: launchers read it by key, fall back to heuristics without it
# ------------------------------------------------------------------------------------------

def test_decode_tuning_table_is_read_and_optional(own_table):
    from tritonchat.kernels import gdn_decode as gdn_mod
    from tritonchat.kernels import sampling as samp_mod
    own_table('{"entries": ['
              '{"key": "gemv:1024x2048:gated:residual", "split_k": 4, "block_n": 4,'
              ' "block_k": 64, "num_warps": 8},'
              '{"key": "gdn_core:16x128x128", "block_v": 32, "num_warps": 2,'
              ' "z_block_n": 16, "z_first": false},'
              '{"key": "gdn_core:8x64x64", "block_v": 16, "num_warps": 4,'
              ' "z_block_n": 12},'
              '{"key": "lm_head:248320x1024:rms", "block_n": 16, "block_k": 256,'
              ' "num_warps": 8},'
              '{"key": "lm_head:1000x64:rms", "block_n": 8, "block_k": 64,'
              ' "num_warps": 4, "persistent": 2, "num_stages": 3, "evict": false},'
              '{"key": "gemv:1024x3584:none:residual", "split_k": 1, "block_n": 4,'
              ' "block_k": 1024, "num_warps": 4, "persistent": 2},'
              '{"key": "attention:8x2x256", "block_n": 64, "num_warps": 8,'
              ' "num_stages": 1},'
              '{"key": "attention:4x1x64", "block_n": 48, "num_stages": "x"}]}')
    assert gemv_mod.plan(1024, 2048, "gated", "residual", 128) == dict(
        split_k=4, block_n=4, block_k=64, num_warps=8, persistent=0)
    # the in-step tuner's persistent form is read, and kept when split-K is switched off
    want = dict(split_k=1, block_n=4, block_k=1024, num_warps=4, persistent=2)
    assert gemv_mod.plan(1024, 3584, "none", "residual") == want
    assert gemv_mod.plan(1024, 3584, "none", "residual", split_k_enabled=False) == want
    # an entry whose block_k exceeds the head would be invalid: the heuristic wins
    assert gemv_mod.plan(1024, 2048, "gated", "residual", 32)["block_k"] <= 32
    assert gdn_mod._plan(16, 128, 128) == (32, 2, 16, False)
    assert gdn_mod._plan(8, 64, 64) == (16, 4, 2, True)   # 12: the default block
    # an LM head entry without the persistent keys is the grid form
    assert samp_mod.lm_head_plan(248320, 1024, True) == dict(
        block_n=16, block_k=256, num_warps=8, persistent=0, num_stages=1, evict=True)
    assert samp_mod.lm_head_plan(1000, 64, True) == dict(
        block_n=8, block_k=64, num_warps=4, persistent=2, num_stages=3, evict=False)
    from tritonchat.kernels.attention_decode import attention_plan
    assert attention_plan(8, 2, 256) == dict(block_n=64, num_warps=8, num_stages=1)
    assert attention_plan(4, 1, 64) == {}         # not a power of two, not a number
    assert attention_plan(4, 2, 64) == {}         # no entry
    own_table("{not json")
    assert gemv_mod.plan(1024, 2048, "gated", "residual", 128) == \
        gemv_mod.heuristic_plan(1024, 2048, "gated", 128)


def test_context_range_plans_from_the_table(own_table):
    """An entry's context_ranges (plans for contexts shorter than `below` positions) are read in
    ascending order; malformed ones, a repeated bound, a persistent plan with split-K, a split-K
    plan with split-K off and a gated plan wider than its head are left out."""
    from tritonchat.engine.decode_step import context_ranges
    ok = '"split_k": 1, "block_n": 8, "block_k": 1024, "num_warps": 8, "persistent": 2'
    own_table(
        '{"entries": [{"key": "gemv:5120x1024:rms:plain", "split_k": 1, "block_n": 8,'
        ' "block_k": 512, "num_warps": 4, "context_ranges": ['
        '{"below": 1792, "split_k": 1, "block_n": 8, "block_k": 1024, "num_warps": 4, "persistent": 2},'
        '{"below": 768, ' + ok + '},'
        '{"below": 768, "split_k": 1, "block_n": 4, "block_k": 256, "num_warps": 4},'
        '{"below": 4096, "split_k": 2, "block_n": 8, "block_k": 256, "num_warps": 4},'
        '{"below": 5000, "split_k": 2, "block_n": 8, "block_k": 256, "num_warps": 4, "persistent": 1},'
        '{"below": 6000, "split_k": 1, "block_n": 6, "block_k": 256, "num_warps": 4},'
        '{"below": 0, ' + ok + '}, {"below": "x", ' + ok + '}, {"split_k": 1}, 7]},'
        '{"key": "gemv:1024x2048:gated:residual", "split_k": 1, "block_n": 4, "block_k": 64,'
        ' "num_warps": 4, "context_ranges": [{"below": 512, "split_k": 1, "block_n": 4,'
        ' "block_k": 256, "num_warps": 4}]},'
        '{"key": "gemv:3584x1024:rms:silu_mul", "split_k": 1, "block_n": 4, "block_k": 512,'
        ' "num_warps": 4, "context_ranges": "all"}]}')
    p8 = dict(split_k=1, block_n=8, block_k=1024, num_warps=8, persistent=2)
    p4 = dict(p8, num_warps=4)
    s2 = dict(split_k=2, block_n=8, block_k=256, num_warps=4, persistent=0)
    assert gemv_mod.range_plans(5120, 1024, "rms", "plain") == [
        (768, p8), (1792, p4), (4096, s2)]
    assert gemv_mod.range_plans(5120, 1024, "rms", "plain", split_k_enabled=False) == [
        (768, p8), (1792, p4)]
    assert gemv_mod.range_plans(1024, 2048, "gated", "residual", 128) == []
    assert gemv_mod.range_plans(3584, 1024, "rms", "silu_mul") == []
    assert gemv_mod.range_plans(1024, 3584, "none", "residual") == []    # no entry
    # the engine's ranges: each range's plans are the base with the plan covering its start
    base = {"qkv": "b0", "mlp": "m0", "other": "o0"}
    r = context_ranges(base, {"qkv": [(0, 768, "q1"), (768, 1792, "q2")],
                              "mlp": [(0, 1024, "m1")]})
    assert [(b, p["qkv"], p["mlp"], p["other"]) for b, p in r] == [
        (768, "q1", "m1", "o0"), (1024, "q2", "m1", "o0"), (1792, "q2", "m0", "o0"),
        (None, "b0", "m0", "o0")]
    assert r[-1][1] is base
    assert context_ranges(base, {}) == [(None, base)]
    # a plan from a position to the end (the attention's long contexts) and one for a
    # middle range: the last range is no longer the base itself; a key absent from the base
    # is None where no range of it applies
    r = context_ranges(base, {"qkv": [(0, 768, "q1")], "attn": [(4096, None, "a2")],
                              "mlp": [(1024, 2048, "m1")]})
    assert [(b, p["qkv"], p["mlp"], p["attn"]) for b, p in r] == [
        (768, "q1", "m0", None), (1024, "b0", "m0", None), (2048, "b0", "m1", None),
        (4096, "b0", "m0", None), (None, "b0", "m0", "a2")]
    assert r[-1][1] is not base and r[-1][1]["other"] == "o0" and "attn" not in base


def test_a_persistent_gated_plan_gives_way_to_an_explicit_split(own_table):
    """The table's plan for a gated GEMV is the persistent form (whole K one tile); a caller
    asking for split-K gets the grid form's head-sized tiles, not the persistent block_k."""
    own_table('{"entries": [{"key": "gemv:24x64:gated:residual", "split_k": 1,'
              ' "block_n": 8, "block_k": 64, "num_warps": 4, "persistent": 1}]}')
    g = torch.Generator().manual_seed(9)
    o, z, W = vec(64, g, 2.0), vec(64, g, 2.0), vec(24 * 64, g, 0.125).view(24, 64)
    norm_w = (1 + 0.1 * torch.randn(16, generator=g)).to(DEVICE)
    res = vec(24, g)
    want, _ = gemv_ref(o, W, norm_w=norm_w, gate=z, head_dim=16, eps=EPS, residual=res)
    for split_k in (None, 1, 2):
        h = res.clone()
        part, cnt = scratch(24, 2, 8)
        gemv(o, W, h, norm_w=norm_w, gate=z, head_dim=16, eps=EPS, residual=h,
                   split_k=split_k, partials=part, counters=cnt)
        torch.testing.assert_close(h, want, **tol(torch.float32))


@pytest.mark.parametrize("n_out,k,pro,epi", [(8224, 1024, "rms", "conv"),
                                             (3584, 1024, "rms", "silu_mul"),
                                             (1024, 2048, "gated", "residual"),
                                             (1024, 3584, "none", "residual"),
                                             (37, 200, "rms", "plain")])
def test_heuristic_plans_are_valid(n_out, k, pro, epi):
    p = gemv_mod.heuristic_plan(n_out, k, pro, 128 if pro == "gated" else 0,
                                      epi == "silu_mul")
    assert p["block_k"] & (p["block_k"] - 1) == 0 and p["block_k"] >= 16
    assert p["block_n"] & (p["block_n"] - 1) == 0
    assert 1 <= p["split_k"] <= gemv_mod.MAX_SPLIT_K
    if pro == "gated":
        assert p["block_k"] <= 128
    # enough programs to cover an H200 (132 SMs) for the model's shapes
    programs = -(-n_out // p["block_n"]) * p["split_k"]
    assert n_out < 1000 or programs >= 132
