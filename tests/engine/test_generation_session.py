"""Generation loop, multi-turn cache reuse and snapshots, the chat session (reference backend)."""
import threading

import pytest
import torch

from tests.fixtures.checkpoints import make_tiny_checkpoint
from tritonchat.engine.options import EngineOptions, SamplingParams
from tritonchat.engine.errors import ContextFullError
from tritonchat.engine.generation import Generator
from tritonchat.engine.session import ChatSession

GREEDY = SamplingParams(greedy=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gen"))


@pytest.fixture()
def session(model_dir):
    return ChatSession.load(model_dir, EngineOptions(max_context=512))


def test_stop_ids_and_budget(session):
    gen = Generator(session.backend, stop_ids=[])
    res = gen.generate([5, 6, 7], GREEDY, max_new_tokens=9)
    assert len(res.token_ids) == 9 and res.stats.stop_reason == "max_tokens"
    # make the 4th greedy token a stop id: generation ends before it, stop token excluded
    gen2 = Generator(session.backend, stop_ids=[res.token_ids[3]])
    res2 = gen2.generate([5, 6, 7], GREEDY, max_new_tokens=9)
    first = res.token_ids.index(res.token_ids[3])
    assert res2.token_ids == res.token_ids[:first] and res2.stats.stop_reason == "eos"
    res3 = gen2.generate([5, 6, 7], GREEDY, max_new_tokens=9, ignore_eos=True)
    assert res3.token_ids == res.token_ids


def test_stats_reported(session):
    gen = Generator(session.backend, stop_ids=[])
    s = gen.generate(list(range(3, 40)), GREEDY, max_new_tokens=6).stats
    assert s.prompt_tokens == 37 and s.new_tokens == 6
    assert s.ttft_ms > 0 and s.prefill_tok_s > 0 and s.decode_tok_s > 0 and s.decode_ms_per_token > 0


def test_stop_event(session):
    gen = Generator(session.backend, stop_ids=[])
    ev = threading.Event()
    seen = []

    def on_token(t):
        seen.append(t)
        if len(seen) == 3:
            ev.set()

    res = gen.generate([1, 2, 3], GREEDY, max_new_tokens=50, stop_event=ev, on_token=on_token)
    assert res.stats.stop_reason == "stopped" and len(res.token_ids) == 3


def test_context_limit(model_dir):
    s = ChatSession.load(model_dir, EngineOptions(max_context=16))
    gen = Generator(s.backend, stop_ids=[])
    with pytest.raises(ContextFullError):
        gen.generate(list(range(1, 20)), GREEDY, max_new_tokens=5)
    res = gen.generate(list(range(1, 12)), GREEDY, max_new_tokens=50)
    assert res.stats.stop_reason == "context_full" and s.backend.length == 16


def test_prefix_reuse_and_snapshot_equal_fresh_prefill(model_dir):
    a = ChatSession.load(model_dir, EngineOptions(max_context=512))
    fresh = ChatSession.load(model_dir, EngineOptions(max_context=512))
    gen = Generator(a.backend, stop_ids=[])
    p1 = list(range(10, 40))
    r1 = gen.generate(p1, GREEDY, max_new_tokens=5, split_at=25)
    # the next turn extends what the state holds: only the new tokens are prefilled
    p2 = p1 + r1.token_ids + [7, 8, 9]
    r2 = gen.generate(p2, GREEDY, max_new_tokens=5)
    assert r2.stats.cached_tokens == len(p1) + len(r1.token_ids) - 1
    ref = Generator(fresh.backend, stop_ids=[]).generate(p2, GREEDY, max_new_tokens=5)
    assert r2.token_ids == ref.token_ids
    torch.testing.assert_close(a.backend.logits(), fresh.backend.logits())
    # an edit of the last turn: restores the snapshot at split_at, equal to a fresh prefill
    p3 = p1[:25] + [3, 3, 3, 3]
    r3 = gen.generate(p3, GREEDY, max_new_tokens=5)
    assert r3.stats.cached_tokens == 25
    fresh.reset()
    ref3 = Generator(fresh.backend, stop_ids=[]).generate(p3, GREEDY, max_new_tokens=5)
    assert r3.token_ids == ref3.token_ids
    # regenerate: the very same prompt again reuses everything but its last token
    r4 = gen.generate(p3, GREEDY, max_new_tokens=5)
    assert r4.token_ids == r3.token_ids and r4.stats.cached_tokens >= 25


def test_chat_session_multiturn_thinking_and_streaming(session):
    texts = []
    stats = []
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello 你好 👋"}]
    reply = session.generate(msgs, SamplingParams(seed=3, top_k=0), max_new_tokens=20, enable_thinking=False,
                             on_text=lambda th, an: texts.append((th, an)), on_stats=stats.append,
                             text_interval_s=0.0, stats_interval_s=0.0)
    assert "".join(an for _, an in texts) == reply.answer
    assert reply.result.stats.new_tokens == len(reply.result.token_ids)
    assert stats and stats[-1]["new_tokens"] == reply.result.stats.new_tokens
    assert stats[-1]["max_context"] == 512
    msgs += [{"role": "assistant", "content": reply.answer}, {"role": "user", "content": "And again?"}]
    r2 = session.generate(msgs, SamplingParams(seed=3, top_k=0), max_new_tokens=10, enable_thinking=True)
    assert r2.result.stats.cached_tokens > 0          # the history before the last answer was reused
    assert r2.answer == "" or r2.thinking != "" or "</think>" not in r2.result.text
    assert session.count_tokens(msgs, False) > 0
    assert session.capabilities()["triton"] is False


def test_session_context_full_is_one_sentence(model_dir):
    s = ChatSession.load(model_dir, EngineOptions(max_context=20))
    with pytest.raises(ContextFullError) as e:
        s.generate([{"role": "user", "content": "word " * 50}], GREEDY, max_new_tokens=5, enable_thinking=False)
    assert "\n" not in str(e.value) and "context" in str(e.value)


def test_set_max_context_reference(model_dir):
    s = ChatSession.load(model_dir, EngineOptions(max_context=64))
    s.set_max_context(128)
    assert s.backend.max_context == 128 and s.backend.state.kv[3][0].shape[1] == 128
    r = s.generate([{"role": "user", "content": "hi"}], GREEDY, max_new_tokens=3, enable_thinking=False)
    assert r.result.stats.prompt_tokens > 0


class _LookaheadBackend:
    """The reference backend behind the launch_next protocol, as a GPU backend runs it: every
    launched step advances the state at once (in stream order) and its token is queued."""

    def __init__(self, inner):
        self._inner = inner
        self._queue = []
        self.launched_ahead = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def length(self):
        return self._inner.length

    @property
    def max_context(self):
        return self._inner.max_context

    def launch_step(self, tok):
        assert not self._queue, "launch_step while a step is queued: the token was already consumed"
        self._queue.append(self._inner.step(tok))

    def launch_next(self):
        if not self._queue or self._inner.length >= self._inner.max_context:
            return False
        self._queue.append(self._inner.step(self._queue[-1]))
        self.launched_ahead += 1
        return True

    def finish_step(self):
        return self._queue.pop(0)


@pytest.mark.parametrize("case", ["budget", "eos", "stop", "context"])
def test_launch_ahead_loop_matches_the_plain_loop(model_dir, case):
    """Queuing the next step before the host reads the token changes nothing the user sees,
    and the generator still knows exactly which tokens the state holds (cached_ids), so the
    next turn reuses the cache as before."""
    prompt = [5, 6, 7, 8]
    base = Generator(ChatSession.load(model_dir, EngineOptions(max_context=512)).backend,
                     stop_ids=[]).generate(prompt, GREEDY, max_new_tokens=12).token_ids
    results = []
    for wrap in (False, True):
        ctx = 12 if case == "context" else 512
        s = ChatSession.load(model_dir, EngineOptions(max_context=ctx))
        be = _LookaheadBackend(s.backend) if wrap else s.backend
        gen = Generator(be, stop_ids=[base[5]] if case == "eos" else [])
        ev, seen = threading.Event(), []

        def on_token(t, ev=ev, seen=seen):
            seen.append(t)
            if case == "stop" and len(seen) == 4:
                ev.set()

        res = gen.generate(prompt, GREEDY, max_new_tokens=10, stop_event=ev, on_token=on_token)
        assert seen == res.token_ids
        # the state holds exactly cached_ids: the prompt, the shown tokens it consumed, and
        # (launch-ahead only) the end-of-turn id or the token after a stop request
        held = list(gen.cached_ids)
        assert len(held) == s.backend.length and held[:len(prompt)] == prompt
        if case == "context":
            s.backend.set_max_context(512)   # room for the next turn (keeps no state)
            gen.forget()
        nxt = gen.generate(held + [9, 10], GREEDY, max_new_tokens=3)
        assert nxt.stats.cached_tokens == (0 if case == "context" else len(held))
        # and the reused state is the one a fresh prefill of those tokens builds
        fresh = Generator(ChatSession.load(model_dir, EngineOptions(max_context=512)).backend,
                          stop_ids=[]).generate(held + [9, 10], GREEDY, max_new_tokens=3)
        assert nxt.token_ids == fresh.token_ids
        results.append((res.token_ids, res.stats.stop_reason, nxt.token_ids,
                        be.launched_ahead if wrap else None))
    (plain_ids, plain_reason, plain_next, _), (ids, reason, nxt_ids, ahead) = results
    assert ids == plain_ids and reason == plain_reason
    assert reason == {"budget": "max_tokens", "eos": "eos", "stop": "stopped",
                      "context": "context_full"}[case]
    assert ahead > 0                       # the launch-ahead path was taken
    if case in ("budget", "context"):
        assert nxt_ids == plain_next       # the same state: the same continuation
