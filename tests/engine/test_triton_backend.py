"""The Triton backend against the reference engine: under the interpreter on the CPU (fp32, in CI)
and on the GPU (bf16, marked gpu)."""
import os

import pytest
import torch

from tests.fixtures.checkpoints import make_tiny_checkpoint
from tritonchat.engine.options import EngineOptions, SamplingParams
from tritonchat.engine.config import load_config
from tritonchat.engine.generation import Generator
from tritonchat.engine.reference import ReferenceBackend, torch_dtype
from tritonchat.engine.weights import load_weights

CUDA = torch.cuda.is_available()
GREEDY = SamplingParams(greedy=True)

CONFIGS = {
    "grouped": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=24),
    "odd_dims": dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                     hidden_size=80, head_dim=48, num_attention_heads=2, num_key_value_heads=1,
                     linear_key_head_dim=24, linear_value_head_dim=40, intermediate_size=72),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), with_tokenizer=False,
                                **CONFIGS[request.param])


def _pair(path, device="cpu", dtype="float32", max_context=128, **opts):
    from tritonchat.engine.triton_backend import TritonBackend
    cfg = load_config(path)
    td = torch_dtype(dtype)
    ref = ReferenceBackend(cfg, load_weights(path, cfg, device=device, dtype=td),
                           EngineOptions(device=device, dtype=dtype, max_context=max_context))
    tri = TritonBackend(cfg, load_weights(path, cfg, device=device, dtype=td),
                        EngineOptions(backend="triton", device=device, dtype=dtype, max_context=max_context, **opts))
    return cfg, ref, tri


@pytest.mark.skipif(CUDA, reason="interpreter twin of the GPU test")
@pytest.mark.parametrize("split_k", [True, False])
def test_interpreter_greedy_equals_reference(ckpt, split_k):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    cfg, ref, tri = _pair(ckpt, split_k=split_k, graph=False)
    prompt = list(range(3, 3 + 21))
    a = Generator(ref, []).generate(prompt, GREEDY, max_new_tokens=6)
    b = Generator(tri, []).generate(prompt, GREEDY, max_new_tokens=6)
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(tri.logits(), ref.logits(), rtol=1e-4, atol=2e-4)


@pytest.mark.skipif(CUDA, reason="interpreter twin of the GPU test")
def test_interpreter_persistent_gemv_plans_equal_reference(ckpt):
    """Every GEMV that can take the persistent direct form (what the in-step tuner may pick)
    switched to it, and the LM head to its persistent form (the table's plan on the H200): the
    engine still decodes the reference's tokens and logits."""
    from tritonchat.kernels.sampling import lm_head_partials_numel
    if "odd" in str(ckpt):
        pytest.skip("one checkpoint is enough here (the interpreter is slow)")
    cfg, ref, tri = _pair(ckpt, split_k=True, graph=False)
    persistent = {key: dict(plan, split_k=1, persistent=1) for key, plan in tri.decode_step.base_plans.items()
                  if key[1] != "gated"}
    assert len(persistent) >= 4
    persistent["lm_head"] = dict(block_n=8, block_k=cfg.hidden_size, num_warps=4, persistent=2,
                                 num_stages=2, evict=False)
    tri.set_plans(persistent)
    assert tri.decode_step.lm_head_partials.numel() == lm_head_partials_numel(cfg.vocab_size, 8)
    prompt = list(range(3, 3 + 21))
    a = Generator(ref, []).generate(prompt, GREEDY, max_new_tokens=4)
    b = Generator(tri, []).generate(prompt, GREEDY, max_new_tokens=4)
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(tri.logits(), ref.logits(), rtol=1e-4, atol=2e-4)


@pytest.mark.skipif(CUDA, reason="interpreter twin of the GPU test")
@pytest.mark.parametrize("defer,groups", [(1, False), (2, False), (1, True)])
def test_interpreter_attention_merge_in_the_o_proj_equals_reference(ckpt, defer, groups):
    """The attention leaving its merge to the o_proj's persistent prologue (what the engine does
    at short contexts on the GPU, from the table's defer_splits and defer_groups): the
    reference's tokens and logits. 2 splits of 64 positions are active past position 64: defer 2
    merges them in the o_proj, defer 1 in the attention (the o_proj then reads its output),
    defer 1 with groups in the attention's group merger and the o_proj (one group record)."""
    if "grouped" not in str(ckpt):
        pytest.skip("the merge needs head counts and sizes that are powers of two")
    cfg, ref, tri = _pair(ckpt, split_k=True, graph=False)
    assert tri.decode_step.attention_base["num_splits"] == 2
    key = _o_proj_key(tri)
    tri.set_plans({key: dict(tri.decode_step.base_plans[key], split_k=1, persistent=1),
                   "attention": dict(defer_splits=defer, defer_groups=int(groups))})
    assert tri.decode_step.defer_splits == defer and tri.decode_step.defer_groups == groups
    prompt = list(range(3, 3 + 66))
    a = Generator(ref, []).generate(prompt, GREEDY, max_new_tokens=4)
    b = Generator(tri, []).generate(prompt, GREEDY, max_new_tokens=4)
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(tri.logits(), ref.logits(), rtol=1e-4, atol=2e-4)


@pytest.mark.skipif(CUDA, reason="interpreter twin of the GPU test")
def test_interpreter_sampling_reproducible_and_in_vocab(ckpt):
    if "odd" in str(ckpt):
        pytest.skip("sampling is shape-independent; covered on one checkpoint (the interpreter is slow)")
    cfg, ref, tri = _pair(ckpt, graph=False)
    tri.valid_vocab = cfg.vocab_size - 7
    p = SamplingParams(seed=5, temperature=0.9, top_k=8, top_p=0.9, min_p=0.01, presence_penalty=0.3,
                       repetition_penalty=1.1)
    a = Generator(tri, []).generate([4, 5, 6], p, max_new_tokens=5).token_ids
    b = Generator(tri, []).generate([4, 5, 6], p, max_new_tokens=5).token_ids
    assert a == b and all(t < cfg.vocab_size - 7 for t in a)


@pytest.mark.skipif(CUDA, reason="interpreter twin of the GPU test")
def test_interpreter_sampler_candidates_follow_the_settings(ckpt):
    """A small top-k searches fewer candidates (a new captured geometry on a settings change):
    the same draws as with the whole cap, which the top-p-only settings take."""
    if "odd" in str(ckpt):
        pytest.skip("one checkpoint is enough here (the interpreter is slow)")
    p = SamplingParams(seed=7, temperature=0.9, top_k=3, top_p=0.9, presence_penalty=0.2)
    cfg, ref, tri = _pair(ckpt, graph=False)
    a = Generator(tri, []).generate([4, 5, 6], p, max_new_tokens=5).token_ids
    assert tri.decode_step.candidates == 32 < tri.decode_step.top_k_max
    tri._ensure_sampler_mode = lambda: None          # hold the whole cap for the same settings
    tri.decode_step.set_sampler(True, tri.decode_step.top_k_max)
    b = Generator(tri, []).generate([4, 5, 6], p, max_new_tokens=5).token_ids
    assert a == b
    del tri._ensure_sampler_mode
    q = SamplingParams(seed=7, top_k=0, top_p=0.5)
    Generator(tri, []).generate([4, 5, 6], q, max_new_tokens=1)
    assert tri.decode_step.candidates == tri.decode_step.top_k_max
    q.top_k = 3                                       # the same settings object, changed
    Generator(tri, []).generate([4, 5, 6], q, max_new_tokens=1)
    assert tri.decode_step.candidates == 32


# ------------------------------------------------------------------------------------ GPU ----

@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [True, False])
def test_gpu_bf16_greedy_until_near_tie(ckpt, split_k):
    cfg, ref, tri = _pair(ckpt, device="cuda", dtype="bfloat16", split_k=split_k, graph=True)
    prompt = list(range(3, 3 + 40))
    ref.prefill(prompt)
    tri.prefill(prompt)
    ref.begin_sampling(GREEDY, prompt)
    tri.begin_sampling(GREEDY, prompt)
    a, b = ref.sample(), tri.sample()
    for _ in range(24):
        top2 = torch.topk(ref.logits(), 2).values
        if (top2[0] - top2[1]).item() < 0.05:      # near-tie in bf16: the rest may legitimately differ
            break
        assert a == b
        a, b = ref.step(a), tri.step(b)


@pytest.mark.gpu
def test_gpu_graph_equals_eager_and_no_recapture(ckpt):
    cfg, _, tri = _pair(ckpt, device="cuda", dtype="bfloat16", graph=True, max_context=256)
    prompt = list(range(5, 30))
    gen = Generator(tri, [])
    with_graph = gen.generate(prompt, GREEDY, max_new_tokens=40)
    graph_obj = tri.graph
    assert graph_obj is not None
    more = gen.generate(prompt + with_graph.token_ids + [9], GREEDY, max_new_tokens=10)
    assert tri.graph is graph_obj                     # position advanced without re-capture
    tri.configure(graph=False)
    gen.forget()
    eager = gen.generate(prompt, GREEDY, max_new_tokens=40)
    assert eager.token_ids == with_graph.token_ids
    assert more.token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [True, False])
def test_gpu_launch_ahead_equals_step_by_step(ckpt, graph):
    """The generation loop queues each step before the host has read the previous token (the
    token ring): greedy and seeded sampling give the tokens of one-step-at-a-time decoding."""
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=3)
    for params in (GREEDY, sampled):
        cfg, _, tri = _pair(ckpt, device="cuda", dtype="bfloat16", graph=graph, max_context=256)
        prompt = list(range(5, 30))
        res = Generator(tri, []).generate(prompt, params, max_new_tokens=30)
        tri.reset()
        tri.prefill(prompt)
        tri.begin_sampling(params, prompt)
        toks = [tri.sample()]
        while len(toks) < 30:
            toks.append(tri.step(toks[-1]))               # one step in flight at a time
        assert toks == res.token_ids


@pytest.mark.gpu
def test_gpu_graph_capture_failure_falls_back(ckpt, monkeypatch, capsys):
    from tritonchat.engine import graph as graph_mod
    cfg, _, tri = _pair(ckpt, device="cuda", dtype="bfloat16", graph=True)

    def boom(*args, **kwargs):
        raise RuntimeError("simulated capture failure")

    monkeypatch.setattr(graph_mod, "capture", boom)
    res = Generator(tri, []).generate([1, 2, 3], GREEDY, max_new_tokens=5)
    assert len(res.token_ids) == 5 and tri.options.graph is False
    assert "capture failed" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_decode_step_allocates_nothing_and_never_syncs(ckpt):
    cfg, _, tri = _pair(ckpt, device="cuda", dtype="bfloat16", graph=False)
    tri.prefill([1, 2, 3])
    tri.begin_sampling(GREEDY, [1, 2, 3])
    tri.sample()
    tri.decode_step()                                           # compile first
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    tri.decode_step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, "the decode step allocated"
    # stream capture fails on any host synchronisation inside the step (captured as the engine
    # captures: no garbage collection meanwhile, see graph.no_collection)
    from tritonchat.engine.graph import no_collection
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with no_collection(), torch.cuda.graph(g, stream=s):
            tri.decode_step()


def _freed_without_collector(ckpt, device, dtype, graph):
    """A backend that prefilled, decoded (with its graphs) and sampled is freed as soon as the
    last reference goes: no reference cycle leaves it (and its CUDA graphs and their memory
    pool) to the garbage collector, which could run in the middle of another graph capture."""
    import gc
    import weakref
    cfg, _, tri = _pair(ckpt, device=device, dtype=dtype, graph=graph)
    tri.prefill_graph = True          # the padded prefill path (captured on CUDA) on the CPU too
    Generator(tri, []).generate(list(range(5, 20)), GREEDY, max_new_tokens=4)
    assert tri.prefill_graphs is not None
    tri.prefill([3, 4, 5])
    tri.begin_sampling(GREEDY, [])
    tri.step(tri.sample())
    ref = weakref.ref(tri)
    gc.disable()
    try:
        del tri
        assert ref() is None, "the backend is kept alive by a reference cycle"
    finally:
        gc.enable()


@pytest.mark.skipif(CUDA, reason="interpreter twin of the GPU test")
def test_interpreter_backend_freed_without_collector(ckpt):
    if "odd" in str(ckpt):
        pytest.skip("one checkpoint is enough here (the interpreter is slow)")
    _freed_without_collector(ckpt, "cpu", "float32", graph=False)


@pytest.mark.gpu
def test_gpu_backend_freed_without_collector(ckpt):
    _freed_without_collector(ckpt, "cuda", "bfloat16", graph=True)


@pytest.mark.skipif(CUDA, reason="interpreter twin")
def test_interpreter_prefill_across_chunk_boundaries_and_multiturn(ckpt):
    """Triton prefill (chunked gated delta rule, flash attention) equals the reference around the
    chunk size, prefill(T)+decode(1) equals prefill(T+1), and a second turn that reuses the
    cache (and a snapshot restore) equals a fresh full prefill."""
    if "odd" in str(ckpt):
        pytest.skip("one checkpoint is enough here (the interpreter is slow)")
    cfg, ref, tri = _pair(ckpt, graph=False, max_context=256)
    for T in (63, 64, 65):
        prompt = [(7 * i + 3) % 200 + 1 for i in range(T)]
        ref.reset()
        tri.reset()
        ref.prefill(prompt)
        tri.prefill(prompt)
        torch.testing.assert_close(tri.logits(), ref.logits(), rtol=1e-4, atol=5e-4)
    prompt = [(5 * i + 1) % 200 + 1 for i in range(65)]
    tri.reset()
    tri.prefill(prompt[:-1])
    tri.decode(prompt[-1])
    a = tri.logits().clone()
    tri.reset()
    tri.prefill(prompt)
    torch.testing.assert_close(a, tri.logits(), rtol=1e-4, atol=5e-4)
    # multi-turn: the second prompt extends the first turn; then an edit restores the snapshot
    gen, fresh = Generator(tri, []), Generator(ref, [])
    p1 = prompt[:40]
    r1 = gen.generate(p1, GREEDY, max_new_tokens=3, split_at=30)
    p2 = p1 + r1.token_ids + [9, 8, 7]
    r2 = gen.generate(p2, GREEDY, max_new_tokens=3)
    assert r2.stats.cached_tokens > len(p1)
    fresh.forget()
    assert r2.token_ids == fresh.generate(p2, GREEDY, max_new_tokens=3).token_ids
    p3 = p1[:30] + [4, 4, 4]
    r3 = gen.generate(p3, GREEDY, max_new_tokens=3)
    assert r3.stats.cached_tokens == 30
    fresh.forget()
    assert r3.token_ids == fresh.generate(p3, GREEDY, max_new_tokens=3).token_ids


@pytest.mark.skipif(CUDA, reason="interpreter twin")
def test_interpreter_prefill_in_several_chunks_equals_reference(ckpt, monkeypatch):
    """A prompt longer than PREFILL_CHUNK runs in pieces, each continuing from the conv and
    recurrent states the previous one left (inside the GDN kernels): pieces of 24 tokens, the
    last one short, against the reference."""
    if "odd" in str(ckpt):
        pytest.skip("one checkpoint is enough here (the interpreter is slow)")
    from tritonchat.engine import triton_prefill
    monkeypatch.setattr(triton_prefill, "PREFILL_CHUNK", 24)
    cfg, ref, tri = _pair(ckpt, graph=False)
    prompt = [(11 * i + 5) % 200 + 1 for i in range(58)]
    ref.prefill(prompt)
    tri.prefill(prompt)
    torch.testing.assert_close(tri.logits(), ref.logits(), rtol=1e-4, atol=5e-4)
    for i in ref.state.conv:
        torch.testing.assert_close(tri.state.conv[i], ref.state.conv[i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(tri.state.rec[i], ref.state.rec[i], rtol=1e-4, atol=1e-4)


def _warm_up_leaves_no_trace(ckpt, device, dtype, graph, prompt_lengths):
    """warm_up compiles and (with the graph) captures, reports kernels/graph progress, and
    leaves the engine as if freshly loaded: the same tokens as without a warm-up, greedy and
    sampled."""
    cfg, ref, tri = _pair(ckpt, device=device, dtype=dtype, graph=graph)
    stages = []
    tri.warm_up(lambda s, f: stages.append((s, f)), prompt_lengths=prompt_lengths)
    assert tri.length == 0
    assert stages[0] == ("kernels", 0.0) and ("kernels", 1.0) in stages
    assert (("graph", 1.0) in stages) == (graph and device == "cuda")
    _, _, fresh = _pair(ckpt, device=device, dtype=dtype, graph=graph)
    prompt = list(range(5, 5 + 13))
    sampled = SamplingParams(temperature=0.9, top_k=10, seed=3)
    for params in (GREEDY, sampled):
        a = Generator(fresh, []).generate(prompt, params, max_new_tokens=5)
        b = Generator(tri, []).generate(prompt, params, max_new_tokens=5)
        assert a.token_ids == b.token_ids


@pytest.mark.slow                      # ~90 s here; its GPU twin runs on the device
@pytest.mark.skipif(CUDA, reason="interpreter twin of the GPU test")
def test_interpreter_warm_up_leaves_no_trace(ckpt):
    _warm_up_leaves_no_trace(ckpt, "cpu", "float32", graph=False, prompt_lengths=(3, 20))


@pytest.mark.gpu
def test_warm_up_leaves_no_trace(ckpt):
    _warm_up_leaves_no_trace(ckpt, "cuda", "bfloat16", graph=True, prompt_lengths=(5, 64))


@pytest.mark.gpu
def test_opening_the_timing_panel_captures_the_timed_step_at_once(ckpt):
    """configure(timing=True) between answers captures the timed decode graph then, so the
    next answer does not pay for it; timing leaves the tokens unchanged."""
    cfg, ref, tri = _pair(ckpt, device="cuda", dtype="bfloat16", graph=True)
    gen = Generator(tri, [])
    prompt = list(range(3, 24))
    a = gen.generate(prompt, GREEDY, max_new_tokens=5).token_ids
    assert tri.timed_graphs is None
    tri.configure(timing=True)
    assert tri.timed_graphs is not None
    b = Generator(tri, []).generate(prompt, GREEDY, max_new_tokens=5).token_ids
    assert a == b and tri.kernel_timings()


# ------------------------------------------------------------------------- context ranges ----

@pytest.fixture
def range_table(tmp_path, monkeypatch):
    """Put per-context-range plans for the q|k|v and gate|up GEMVs of a backend into a decode
    table of its own (the packaged table has none for the tiny shapes): below 24 positions the
    persistent form with 2-row blocks, below 30 the grid form with 4-row blocks and 32-wide
    tiles, past 30 the base plans (bounds=(): none). With `attention` (a launch plan with its
    "from"), the attention's entry gets that range too, and up to 2 active splits (or merge
    groups) its merge is the o_proj's. Returns a function of the backend (and bounds)."""
    import json

    from tritonchat.kernels import _common
    from tritonchat.kernels import gemv as G

    def install(tri, bounds=(24, 30), attention=None, defer_groups=1):
        entries = []
        for (shape, pro, epi), plan in tri.decode_step.base_plans.items():
            n_out = shape[0] // 2 if epi == "silu_mul" else shape[0]
            e = dict(plan, key=G.plan_key(n_out, shape[1], pro, epi))
            if bounds and pro == "rms" and epi in ("plain", "silu_mul") and shape[0] != tri.cfg.vocab_size:
                e["context_ranges"] = [
                    dict(below=bounds[0], split_k=1, block_n=2, block_k=16, num_warps=4, persistent=1),
                    dict(below=bounds[1], split_k=1, block_n=4, block_k=32, num_warps=4, persistent=0)]
            entries.append(e)
        if attention is not None:
            c = tri.cfg
            entries.append(dict(key=f"attention:{c.num_attention_heads}x{c.num_key_value_heads}x{c.head_dim}",
                                defer_splits=2, defer_groups=defer_groups, context_ranges=[attention]))
        table = tmp_path / "decode_tuning.json"
        table.write_text(json.dumps({"entries": entries}))
        monkeypatch.setattr(_common, "DECODE_TABLE_PATH", str(table))
        _common.clear_table_cache()
        tri.set_context_ranges(False)
        tri.set_context_ranges(True)                 # the plans again, from this table
        want = sorted(set(bounds) | ({attention["from"]} if attention else set()))
        assert tri.context_range_bounds == want

    yield install
    _common.clear_table_cache()


def _plans_by_position(ref, tri, launch: str, plan_of, new_tokens: int) -> dict[int, set]:
    """Generate greedily from one prompt with the reference and the Triton backend (eager),
    check the tokens and the last logits agree, and return {position: {plan_of(launch keywords)}}
    of the Triton backend's `launch` calls."""
    used: dict[int, set] = {}

    def spy(name, kw):
        if name == launch:
            used.setdefault(tri.state.length, set()).add(plan_of(kw))

    tri.launcher.trace = spy
    try:
        prompt = list(range(3, 3 + 21))
        a = Generator(ref, []).generate(prompt, GREEDY, max_new_tokens=new_tokens)
        b = Generator(tri, []).generate(prompt, GREEDY, max_new_tokens=new_tokens)
    finally:
        tri.launcher.trace = None
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(tri.logits(), ref.logits(), rtol=1e-4, atol=2e-4)
    return used


def _qkv_key(tri):
    return next(k for k in tri.decode_step.base_plans if k[1:] == ("rms", "plain") and k[0][0] != tri.cfg.vocab_size)


def _o_proj_key(tri):
    from tritonchat.engine.decode_step import gemv_key
    return next(gemv_key(L.mixer.o_proj, "none", "residual") for L in tri.layers if hasattr(L.mixer, "o_proj"))


@pytest.mark.slow                      # ~130 s here; the attention's range test stays fast
@pytest.mark.skipif(CUDA, reason="interpreter twin of the GPU test")
def test_interpreter_context_ranges_pick_plans_by_position(ckpt, range_table):
    """With plans for short contexts in the table, each decode step runs the plans of its
    position's range (the q|k|v GEMV's launches, recorded), and the tokens and logits are still
    the reference's across both bounds."""
    if "odd" in str(ckpt):
        pytest.skip("one checkpoint is enough here (the interpreter is slow)")
    cfg, ref, tri = _pair(ckpt, split_k=True, graph=False)
    range_table(tri)
    base = tri.decode_step.base_plans[_qkv_key(tri)]
    used = _plans_by_position(ref, tri, "gemv_attn_qkv_norm", lambda k: (k["persistent"], k["block_n"]), 14)
    assert min(used) < 24 and max(used) >= 30
    for pos, plans in used.items():
        want = (1, 2) if pos < 24 else (0, 4) if pos < 30 else (base["persistent"], base["block_n"])
        assert plans == {want}, pos


# a long-context attention plan for the tiny shapes: 1 split an SM (the interpreter's 8 "SMs":
# 4 a KV head), 16-position tiles, merge groups of 2
LONG_ATTENTION = {"from": 30, "splits_per_sm": 1, "block_n": 16, "num_warps": 4, "num_stages": 1,
                  "merge_splits": 2}


def test_context_ranges_switch(ckpt, range_table):
    """configure(context_ranges=...) (the app's setting, --context-ranges) drops the table's
    ranges (one plan set: the base plans, the base attention launch and its scratch) and brings
    them back; the option at construction does the same."""
    if "grouped" not in str(ckpt):
        pytest.skip("one checkpoint is enough here")
    from tritonchat.engine.triton_backend import TritonBackend
    device = "cuda" if CUDA else "cpu"
    cfg, _, tri = _pair(ckpt, device=device, dtype="bfloat16" if CUDA else "float32", graph=False)
    range_table(tri, attention=LONG_ATTENTION)
    assert tri.context_range_bounds == [24, 30] and tri.options.context_ranges
    long = tri.decode_step.ranges[-1][1]["attention"]
    assert long["partials"] is not tri.decode_step.attention_base["partials"] and tri.decode_step.ranges[0][1].get("attention") is None
    tri.configure(context_ranges=False)
    assert tri.context_range_bounds == [] and not tri.options.context_ranges
    assert tri.decode_step.ranges == [(None, tri.decode_step.base_plans)] and tri.decode_step.plans.get("attention") is None
    tri.configure(context_ranges=True)
    assert tri.context_range_bounds == [24, 30] and tri.options.context_ranges
    opts = tri.options.__class__(**dict(tri.options.to_dict(), context_ranges=False))
    off = TritonBackend(cfg, load_weights(ckpt, cfg, device=device, dtype=tri.dtype), opts)
    assert off.context_range_bounds == [] and off.options.context_ranges is False


def test_plan_range_names_the_running_range(ckpt, range_table):
    """plan_range() (the app's timing panel shows it) gives the range of the position the next
    step decodes at, its bounds and the kernels whose plans there are not the base ones; None
    with the ranges off."""
    if "grouped" not in str(ckpt):
        pytest.skip("one checkpoint is enough here")
    device = "cuda" if CUDA else "cpu"
    _, _, tri = _pair(ckpt, device=device, dtype="bfloat16" if CUDA else "float32", graph=False)
    range_table(tri, attention=LONG_ATTENTION)
    gemvs = ["gemv_attn_qkv_norm", "gemv_mlp_gate_up_norm_silu"]     # the table's ranged GEMVs
    want = {0: (0, 0, 24, gemvs), 23: (0, 0, 24, gemvs), 24: (1, 24, 30, gemvs),
            30: (2, 30, None, ["attention_decode"]), 45: (2, 30, None, ["attention_decode"])}
    for pos, (index, start, below, tuned) in want.items():
        tri.state.length = pos
        assert tri.plan_range() == {"index": index, "count": 3, "start": start, "below": below,
                                    "tuned": tuned}, pos
    tri.configure(context_ranges=False)
    assert tri.plan_range() is None
    range_table(tri)                               # GEMV ranges only: the last range is the base
    tri.state.length = 31
    assert tri.plan_range() == {"index": 2, "count": 3, "start": 30, "below": None, "tuned": []}
    tri.state.length = 0


@pytest.mark.skipif(CUDA, reason="interpreter twin of the GPU test")
def test_interpreter_attention_context_range_equals_reference(ckpt, range_table):
    """With a launch plan for the attention from position 30 on in the table, the steps from 30
    launch it (4 splits of 16-position tiles, merge groups of 2, the groups' partials merged in
    the o_proj past 2 active splits) and the earlier ones the base plan (2 splits), and the
    tokens and logits are still the reference's across the bound."""
    if "grouped" not in str(ckpt):
        pytest.skip("the merge needs head counts and sizes that are powers of two")
    cfg, ref, tri = _pair(ckpt, split_k=True, graph=False)
    key = _o_proj_key(tri)               # the o_proj's persistent form (the H200 table's): it
    tri.set_plans({key: dict(tri.decode_step.base_plans[key], split_k=1, persistent=1)})   # takes the merge
    range_table(tri, bounds=(), attention=LONG_ATTENTION)
    assert tri.decode_step.defer_splits == 2 and tri.decode_step.attention_base["num_splits"] == 2
    used = _plans_by_position(
        ref, tri, "attention_decode",
        lambda k: (k["num_splits"], k.get("block_n"), k.get("merge_splits"), k["defer_groups"]), 16)
    assert min(used) < 30 and max(used) >= 34          # up to 3 active splits of 16 positions
    for pos, plans in used.items():
        assert plans == ({(2, None, None, True)} if pos < 30 else {(4, 16, 2, True)}), pos
    # a table without defer_groups: no range defers its groups either (the attention merges
    # them in two levels of tickets), and the tokens are still the reference's
    range_table(tri, bounds=(), attention=LONG_ATTENTION, defer_groups=0)
    assert not tri.decode_step.defer_groups
    used = _plans_by_position(ref, tri, "attention_decode", lambda k: (k["num_splits"], k["defer_groups"]), 16)
    assert {p for plans in used.values() for p in plans} == {(2, False), (4, False)}


@pytest.mark.gpu
def test_gpu_attention_context_range_graphs_equal_eager(ckpt, range_table):
    """The attention's long-context range as a graph of its own next to the GEMVs' ranges:
    four graphs captured once, and the eager path's tokens across the three bounds."""
    cfg, _, tri = _pair(ckpt, device="cuda", dtype="bfloat16", graph=True, max_context=256)
    range_table(tri, bounds=(32, 48), attention=dict(LONG_ATTENTION, **{"from": 40, "merge_splits": 8}))
    prompt = list(range(5, 30))
    gen = Generator(tri, [])
    with_graph = gen.generate(prompt, GREEDY, max_new_tokens=40)   # positions 25..64
    graphs = list(tri.graphs)
    assert len(graphs) == 4 and tri.graph is graphs[3]
    # ranges [0, 32) [32, 40) [40, 48) [48, ...): the attention's plan from 40 on
    ranges = tri.decode_step.ranges
    assert [r[1].get("attention") is None for r in ranges] == [True, True, False, False]
    assert ranges[2][1]["attention"] is ranges[3][1]["attention"]
    assert ranges[3][1]["attention"]["launch"]["block_n"] == 16
    tri.configure(graph=False)
    gen.forget()
    eager = gen.generate(prompt, GREEDY, max_new_tokens=40)
    assert eager.token_ids == with_graph.token_ids


@pytest.mark.gpu
def test_gpu_launch_cache_equals_dispatch_and_graph(ckpt, range_table):
    """Graph off, each range's recorded launches replayed (the default) give the graph's tokens
    and those of every launch through Triton's dispatch (launch cache off), greedy and seeded
    sampling, across two context-range bounds: each range records at its second step, a replay
    allocates nothing, and a new sampler mode or a split-K switch drops the recordings."""
    cfg, _, tri = _pair(ckpt, device="cuda", dtype="bfloat16", graph=True, max_context=256)
    range_table(tri, bounds=(32, 48))
    prompt = list(range(5, 30))
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=3)
    gen = Generator(tri, [])
    want = {}
    for name, p in (("greedy", GREEDY), ("sampled", sampled)):
        gen.forget()
        want[name] = gen.generate(prompt, p, max_new_tokens=40).token_ids   # positions 25..64
    tri.configure(graph=False)
    for cache in (True, False):
        tri.configure(launch_cache=cache)
        for name, p in (("greedy", GREEDY), ("sampled", sampled)):
            gen.forget()
            assert gen.generate(prompt, p, max_new_tokens=40).token_ids == want[name], (cache, name)
            if cache:
                assert sorted(tri.launch_recordings) == [0, 1, 2] and tri.launch_replay_active
                assert all(len(r) >= 4 * cfg.num_hidden_layers for r in tri.launch_recordings.values())
            else:
                assert tri.launch_recordings == {} and not tri.launch_replay_active
    assert tri.launch_cache_error is None
    tri.configure(launch_cache=True)
    gen.forget()
    gen.generate(prompt, GREEDY, max_new_tokens=40)
    rec = tri.launch_recordings[2]
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    rec.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, "the replay allocated"
    tri.begin_sampling(sampled, [])
    assert tri.launch_recordings == {}                           # a new sampler mode: a new step
    gen.forget()
    gen.generate(prompt, GREEDY, max_new_tokens=40)
    assert tri.launch_recordings
    tri.configure(split_k=not tri.options.split_k)
    assert tri.launch_recordings == {}


@pytest.mark.gpu
def test_gpu_launch_cache_refused_reads_off_and_decodes(ckpt, monkeypatch, capsys):
    """A recording refused (here by a stand-in for a step that runs a PyTorch operator) is said
    once, the option reads off, and decoding goes on through Triton with the same tokens; turning
    the cache on again tries again."""
    from tritonchat.engine import launch_replay
    cfg, _, tri = _pair(ckpt, device="cuda", dtype="bfloat16", graph=False, max_context=256)
    prompt = list(range(5, 30))
    gen = Generator(tri, [])
    want = gen.generate(prompt, GREEDY, max_new_tokens=20).token_ids
    assert tri.launch_replay_active and tri.options.launch_cache
    real = launch_replay.record

    def refuse(step, device):
        step()
        return None, "the step runs PyTorch operators besides its Triton launches (aten.add_)"

    monkeypatch.setattr(launch_replay, "record", refuse)
    tri.configure(launch_cache=False)
    tri.configure(launch_cache=True)                   # records again, and is refused
    gen.forget()
    assert gen.generate(prompt, GREEDY, max_new_tokens=20).token_ids == want
    assert tri.options.launch_cache is False and "aten.add_" in tri.launch_cache_error
    assert capsys.readouterr().err.count("cannot be replayed") == 1
    monkeypatch.setattr(launch_replay, "record", real)
    tri.configure(launch_cache=True)
    gen.forget()
    assert gen.generate(prompt, GREEDY, max_new_tokens=20).token_ids == want
    assert tri.options.launch_cache and tri.launch_cache_error is None and tri.launch_replay_active


@pytest.mark.gpu
def test_gpu_context_ranges_graphs_equal_eager_and_no_recapture(ckpt, range_table):
    """One captured step per context range, all captured at the first step: decoding across
    both bounds replays them without capturing again, and gives the eager path's tokens (which
    switches plans at the same positions)."""
    cfg, _, tri = _pair(ckpt, device="cuda", dtype="bfloat16", graph=True, max_context=256)
    range_table(tri, bounds=(32, 48))
    prompt = list(range(5, 30))
    gen = Generator(tri, [])
    with_graph = gen.generate(prompt, GREEDY, max_new_tokens=40)   # positions 25..64
    graphs = list(tri.graphs)
    assert len(graphs) == 3 and tri.graph is graphs[2]
    more = gen.generate(prompt + with_graph.token_ids + [9], GREEDY, max_new_tokens=10)
    assert more.token_ids and all(g is h for g, h in zip(tri.graphs, graphs))
    gen.forget()
    tri.reset()
    tri.prefill(prompt)
    assert tri.graph_for(40) is graphs[1] and tri.graph_for(0) is graphs[0]   # no capture either
    tri.configure(graph=False)
    gen.forget()
    eager = gen.generate(prompt, GREEDY, max_new_tokens=40)
    assert eager.token_ids == with_graph.token_ids
