"""The padded prefill behind the prefill CUDA graphs (engine/triton_prefill.py): a prompt run
at its bucket length with inert padding leaves exactly the state the plain prefill leaves (GDN
recurrent and conv states, the KV cache up to the new length, the last hidden state), at the
start of a chat and on a later turn. The capture itself needs a GPU (the GPU test replays
graphs for prompts of different lengths in one bucket); here the padded path runs eagerly
under the interpreter. With programmatic dependent launch every prefill kernel is a PDL launch
and the prefill leaves the same bits."""
import os

import pytest
import torch

from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.kernels.util import launches
from tritonchat.kernels import embedding, flash_attention, gdn_chunk, gemm, rms_norm
from tritonchat.engine.options import EngineOptions, SamplingParams
from tritonchat.engine.config import load_config
from tritonchat.engine.reference import torch_dtype
from tritonchat.engine.triton_prefill import GRAPH_MAX_T, graph_bucket
from tritonchat.engine.weights import load_weights

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pg"), with_tokenizer=False,
                                linear_num_key_heads=2, linear_num_value_heads=4,
                                linear_key_head_dim=16, linear_value_head_dim=24)


def _backend(path, device, dtype, max_context=256, graph=False):
    from tritonchat.engine.triton_backend import TritonBackend
    cfg = load_config(path)
    return TritonBackend(cfg, load_weights(path, cfg, device=device, dtype=torch_dtype(dtype)),
                         EngineOptions(backend="triton", device=device, dtype=dtype,
                                       max_context=max_context, graph=graph))


def test_buckets():
    assert [graph_bucket(t) for t in (1, 63, 64, 65, 1024, 1025, GRAPH_MAX_T)] == \
        [64, 64, 64, 128, 1024, 1280, GRAPH_MAX_T]
    assert graph_bucket(0) is None and graph_bucket(GRAPH_MAX_T + 1) is None


def _same_state(a, b, tol):
    assert a.length == b.length
    n = a.length
    for i in a.state.rec:
        torch.testing.assert_close(b.state.rec[i], a.state.rec[i], **tol)
        torch.testing.assert_close(b.state.conv[i], a.state.conv[i], **tol)
    for i in a.state.kv:
        for x, y in zip(a.state.kv[i], b.state.kv[i]):
            torch.testing.assert_close(y[:, :n], x[:, :n], **tol)
    torch.testing.assert_close(b.h, a.h, **tol)


def _compare(ckpt, device, dtype, turns, tol):
    plain = _backend(ckpt, device, dtype)
    padded = _backend(ckpt, device, dtype)
    padded.prefill_graph = True
    for n in turns:                                   # a chat: each turn extends the cache
        ids = [(13 * j + 7 * n) % 200 + 3 for j in range(n)]
        plain.prefill(ids)
        padded.prefill(ids)
        _same_state(plain, padded, tol)
    greedy = SamplingParams(greedy=True)
    plain.begin_sampling(greedy, [])
    padded.begin_sampling(greedy, [])
    a, b = plain.sample(), padded.sample()
    assert a == b
    for _ in range(3):
        a, b = plain.step(a), padded.step(b)
        assert a == b
    return padded


SLOW = pytest.mark.slow


@pytest.mark.skipif(CUDA, reason="interpreter twin of the GPU test")
@pytest.mark.parametrize("turns", [(1,), pytest.param((3,), marks=SLOW), (63,), (64,), (65,), (20, 5),
                                   pytest.param((20, 2), marks=SLOW), pytest.param((9, 70), marks=SLOW)],
                         ids=lambda t: "+".join(map(str, t)))
def test_padded_prefill_leaves_the_plain_state(ckpt, turns):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    # the GEMMs tile a bucket-length M differently: fp32 sums in another order
    _compare(ckpt, "cpu", "float32", turns, dict(rtol=2e-4, atol=1e-4))


@pytest.mark.skipif(CUDA, reason="interpreter twin of the GPU test")
def test_too_close_to_the_end_of_the_context_runs_plain(ckpt):
    be = _backend(ckpt, "cpu", "float32", max_context=80)
    be.prefill_graph = True
    be.prefill(list(range(3, 3 + 30)))                # bucket 64 fits: the padded path
    assert be.prefill_graphs is not None and be.length == 30
    with torch.inference_mode():
        be.prefill_graphs.t.fill_(-1)                # would show if the padded path ran again
    be.prefill(list(range(3, 3 + 20)))                # 30 + bucket 64 > 80: the plain path
    assert be.length == 50 and int(be.prefill_graphs.t) == -1


PREFILL_KERNELS = (embedding, rms_norm, gemm, gdn_chunk, flash_attention)


@pytest.mark.skipif(CUDA, reason="interpreter twin of the GPU test")
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_prefill_with_pdl_launches_every_kernel_with_it(ckpt, padded):
    """be._pdl = 1 (off under the interpreter unless set, as here): every launch of the prefill,
    plain and padded, a chat's second turn included, is a PDL launch, and the prefill leaves the
    bits it leaves with PDL off."""
    off, on = _backend(ckpt, "cpu", "float32"), _backend(ckpt, "cpu", "float32")
    assert off._pdl == 0
    on._pdl = 1
    off.prefill_graph = on.prefill_graph = padded
    for n in (20, 5):
        ids = [(11 * j + n) % 200 + 3 for j in range(n)]
        off.prefill(ids)
        with launches(*PREFILL_KERNELS) as seen:
            on.prefill(ids)
        assert len(seen) > 10 and all(mode == 1 and asked for _, mode, asked in seen), seen
        _same_state(off, on, dict(rtol=0, atol=0))


@pytest.mark.gpu
@pytest.mark.parametrize("early", [False, True])
def test_gpu_prefill_with_pdl_gives_the_same_bits(early):
    """On the device, at the true 0.8B shape (random weights): prefills of 128 and 2,048 tokens
    replayed from their graphs, of 3,000 tokens eagerly, and a later turn, with PDL (mode 1,
    or 2 with `early`) leave the bits they leave without PDL; the graphs of both modes are
    kept apart when the switch flips."""
    from tritonchat.engine.config import qwen35_08b_config
    from tritonchat.engine.loader import random_backend
    cfg = qwen35_08b_config()
    opts = dict(backend="triton", device="cuda", dtype="bfloat16", max_context=8192)
    off = random_backend(cfg, EngineOptions(**opts, pdl=False))
    on = random_backend(cfg, EngineOptions(**opts, pdl=True, pdl_early=early))
    assert off._pdl == 0 and on._pdl == (2 if early else 1)
    for turns in ((128,), (2048,), (3000,), (100, 40)):
        for be in (off, on):
            be.reset()
        for n in turns:
            ids = [(7919 * j + n) % 200000 + 5 for j in range(n)]
            off.prefill(ids)
            on.prefill(ids)
            torch.cuda.synchronize()
            _same_state(off, on, dict(rtol=0, atol=0))
    mode = on._pdl
    assert {(128, mode), (2048, mode)} <= set(on.prefill_graphs.graphs)
    on.configure(pdl=False)                          # the switch: graphs of mode 0 from now on
    assert on._pdl == 0
    for be in (off, on):
        be.reset()
        be.prefill(list(range(5, 133)))
    _same_state(off, on, dict(rtol=0, atol=0))
    assert {(128, 0), (128, mode)} <= set(on.prefill_graphs.graphs)


@pytest.mark.gpu
def test_prefill_graphs_replay_every_length_of_a_bucket(ckpt):
    """bf16 on the GPU: the first prompt of a bucket captures its graph; later prompts of other
    lengths in the same bucket (and later turns) replay it and leave the plain state."""
    padded = _compare(ckpt, "cuda", "bfloat16", (20, 5), dict(rtol=2e-2, atol=2e-2))
    assert set(padded._prefill_graphs.graphs) == {(64, padded._pdl)}
    _compare(ckpt, "cuda", "bfloat16", (33, 64, 7), dict(rtol=2e-2, atol=2e-2))
