"""The conversation controller without Qt: a recorded fake engine, a real (temporary) store.

Nothing here imports PySide6: send / edit / regenerate / stop, variants, drafts and the crash
recovery are plain Python driven through the controller's engine-report methods, the way the
worker's signals drive it in the app.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import dataclass, field

import pytest

from tritonchat.app.conversation import (ConversationController, ConversationListener,
                                         estimate_tokens, title_from)
from tritonchat.app.store import ChatStore
from tritonchat.engine.options import SamplingParams


@dataclass
class Request:
    request_id: int
    messages: list
    stop_event: threading.Event = field(default_factory=threading.Event)


class FakeEngine:
    """The engine interface of worker.EngineClient, recording what it is asked."""

    def __init__(self):
        self.requests: list[Request] = []
        self.counts: list[tuple[int, list, bool]] = []

    def generate(self, messages, params, max_new_tokens, enable_thinking):
        r = Request(len(self.requests) + 1, [dict(m) for m in messages])
        self.requests.append(r)
        return r

    def count_tokens(self, tag, messages, enable_thinking):
        self.counts.append((tag, [dict(m) for m in messages], enable_thinking))


@dataclass
class Settings:
    system_prompt: str = ""
    thinking: bool = False
    max_new_tokens: int = 64
    context_length: int = 4096

    def sampling_params(self):
        return SamplingParams(seed=1)


class Recorder(ConversationListener):
    def __init__(self):
        self.events: list[tuple] = []

    def __getattribute__(self, name):
        if name in ConversationListener.__dict__ and not name.startswith("_"):
            return lambda *a: object.__getattribute__(self, "events").append((name, *a))
        return object.__getattribute__(self, name)

    def of(self, name):
        return [e[1:] for e in self.events if e[0] == name]


ENGINE = {"backend": "reference", "device": "cpu", "dtype": "float32", "split_k": True, "graph": True}


def reply(answer, thinking=""):
    return {"answer": answer, "thinking": thinking, "thinking_seconds": 0.0,
            "stats": {"new_tokens": 3, "stop_reason": "eos", "decode_tok_s": 10.0},
            "engine": dict(ENGINE)}


@pytest.fixture
def chat(tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    engine, listener = FakeEngine(), Recorder()
    c = ConversationController(store, engine, Settings(), listener)
    c.loaded = True
    c.recover()
    c.new_chat()
    yield c, engine, listener
    store.close()


def answer(c, engine, text, thinking=""):
    rid = engine.requests[-1].request_id
    c.on_text(rid, thinking, text)
    return c.on_finished(rid, reply(text, thinking))


def test_the_controller_imports_no_qt():
    code = ("import sys, tritonchat.app.conversation; "
            "bad = [m for m in sys.modules if m.startswith(('PySide6', 'torch'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_send_answers_and_stores(chat):
    c, engine, ev = chat
    assert c.send("Hello there\nsecond line")
    assert c.conv_id is not None and c.gen is not None
    assert engine.requests[-1].messages == [{"role": "user", "content": "Hello there\nsecond line"}]
    stats = answer(c, engine, "Hi!")
    assert stats["stop_reason"] == "eos" and stats["backend"] == "reference"
    msgs = c.store.messages(c.conv_id)
    assert [(m.role, m.content) for m in msgs] == [("user", "Hello there\nsecond line"), ("assistant", "Hi!")]
    assert not msgs[1].streaming
    assert c.store.get_conversation(c.conv_id).title == "Hello there"
    assert ev.of("busy_changed") == [(True,), (False,)]
    assert not c.send("  ")                     # blank: nothing
    c.loaded = False
    assert not c.send("not loaded")


def test_stop_sets_the_flag_the_engine_reads(chat):
    c, engine, _ = chat
    c.send("go")
    assert c.stop() and engine.requests[-1].stop_event.is_set()
    assert not c.send("while busy")


def test_regenerate_keeps_the_old_answer_and_the_context_uses_the_selected_one(chat):
    c, engine, ev = chat
    c.send("Pick a word")
    answer(c, engine, "apple")
    first = c.store.messages(c.conv_id)[-1]
    assert c.regenerate(first.id)
    assert engine.requests[-1].messages == [{"role": "user", "content": "Pick a word"}]
    started = ev.of("stream_started")[-1][0]
    assert (started.variant, started.variants) == (2, 2)
    answer(c, engine, "banana")
    msgs = c.store.messages(c.conv_id)
    assert [m.content for m in msgs] == ["Pick a word", "banana"] and msgs[1].variants == 2
    c.select_variant(msgs[1].id, -1)                 # \u2039: back to the first answer
    assert [m.content for m in c.store.messages(c.conv_id)] == ["Pick a word", "apple"]
    assert ev.of("opened")[-1][2][1].content == "apple"
    c.send("and then?")
    assert engine.requests[-1].messages[1] == {"role": "assistant", "content": "apple"}
    # only the last answer regenerates (an earlier one would hide the turns after it)
    assert not c.regenerate(msgs[1].id)
    # survives a restart: the selection is in the store
    answer(c, engine, "cherry")
    again = ConversationController(c.store, FakeEngine(), Settings())
    again.loaded = True
    again.open(c.conv_id)
    assert [m.content for m in c.store.messages(c.conv_id)] == ["Pick a word", "apple", "and then?", "cherry"]


def test_edit_forks_keeps_the_old_branch_and_retitles(chat):
    c, engine, ev = chat
    c.send("first question")
    answer(c, engine, "a1")
    c.send("second question")
    answer(c, engine, "a2")
    user = c.store.messages(c.conv_id)[0]
    assert c.edit(user.id, "edited question")
    assert engine.requests[-1].messages == [{"role": "user", "content": "edited question"}]
    answer(c, engine, "a3")
    msgs = c.store.messages(c.conv_id)
    assert [m.content for m in msgs] == ["edited question", "a3"]
    assert (msgs[0].variant, msgs[0].variants) == (2, 2)
    assert c.store.get_conversation(c.conv_id).title == "edited question"
    assert ev.of("title_changed")[-1] == (c.conv_id, "edited question")
    c.select_variant(msgs[0].id, -1)                 # the old prompt and its whole branch
    assert [m.content for m in c.store.messages(c.conv_id)] == [
        "first question", "a1", "second question", "a2"]


def test_edit_keeps_a_title_the_user_chose(chat):
    c, engine, _ = chat
    c.send("first")
    answer(c, engine, "x")
    c.rename(c.conv_id, "My own title")
    c.edit(c.store.messages(c.conv_id)[0].id, "changed")
    assert c.store.get_conversation(c.conv_id).title == "My own title"


def test_a_failure_before_any_text_undoes_the_send_and_returns_the_text(chat):
    c, engine, ev = chat
    c.send("doomed")
    c.on_failed(engine.requests[-1].request_id, "It failed.", "")
    assert c.store.list_conversations() == [] and c.conv_id is None
    assert ev.of("text_returned") == [("doomed",)]
    # a regenerate that fails before any text leaves the old answer selected
    c.send("ok")
    answer(c, engine, "kept")
    c.regenerate(c.store.messages(c.conv_id)[-1].id)
    c.on_failed(engine.requests[-1].request_id, "It failed.", "")
    msgs = c.store.messages(c.conv_id)
    assert [m.content for m in msgs] == ["ok", "kept"] and msgs[1].variants == 1


def test_crash_before_the_first_save_leaves_no_empty_turn_for_the_model(tmp_path):
    """#61: the app dies while an answer streams. At the next start an answer with no text
    is gone (it would be re-sent as an empty assistant turn); one with text is kept and
    marked interrupted, in the store and the export."""
    path = tmp_path / "chats.sqlite3"
    store = ChatStore(path)
    c = ConversationController(store, FakeEngine(), Settings())
    c.loaded = True
    c.send("first")                      # the crash comes before any text was saved
    conv_a = c.conv_id
    store._db.close()                    # (no save_in_flight, no close: a kill)

    store = ChatStore(path)
    engine = FakeEngine()
    c = ConversationController(store, engine, Settings())
    c.loaded = True
    c.recover()
    assert [m.role for m in store.messages(conv_a)] == ["user"]
    c.open(conv_a)
    c.send("second")
    assert engine.requests[-1].messages == [{"role": "user", "content": "first"},
                                            {"role": "user", "content": "second"}]
    rid = engine.requests[-1].request_id
    c.gen.last_save = 0.0
    c.on_text(rid, "", "half an ans")    # saved mid-stream, then the crash
    store._db.close()

    store = ChatStore(path)
    c = ConversationController(store, FakeEngine(), Settings())
    assert c.recover() != []
    last = store.messages(conv_a)[-1]
    assert last.content == "half an ans" and last.interrupted and not last.streaming
    data = store.export_json(conv_a)
    assert data["messages"][-1]["interrupted"] is True
    assert "interrupted" in store.export_markdown(conv_a)
    store.close()


def test_drafts_are_per_conversation_and_persist(chat, tmp_path):
    c, engine, ev = chat
    c.set_draft("typed in a new chat")
    c.flush_drafts()
    c.send("a chat")
    answer(c, engine, "ok")
    a = c.conv_id
    assert c.draft(None) == "" and c.store.draft(None) == ""     # sent: no draft left
    c.set_draft("half a thought for a")
    c.new_chat()                                                  # leaving saves it
    assert ev.of("opened")[-1][4] == ""
    c.set_draft("new chat draft")
    c.open(a)
    assert ev.of("opened")[-1][4] == "half a thought for a"
    c.new_chat()
    assert ev.of("opened")[-1][4] == "new chat draft"
    fresh = ConversationController(c.store, FakeEngine(), Settings())     # a restart
    assert fresh.draft(a) == "half a thought for a" and fresh.draft(None) == "new chat draft"
    c.delete(a)
    assert c.store.draft(a) == ""


def test_the_meter_counts_a_long_draft_and_a_prompt_that_cannot_fit_is_refused(chat):
    c, engine, ev = chat
    c.max_context = 4096
    draft = "word " * 15000                                       # 75,000 characters
    c.set_draft(draft)
    used, total, exact = ev.of("context_changed")[-1]
    assert used > 4096 and total == 4096 and not exact            # an estimate, at once
    c.count_context(draft)                                        # then the tokenizer's count
    tag, messages, _ = engine.counts[-1]
    assert messages[-1] == {"role": "user", "content": draft}
    c.on_token_count(tag, 15007, 4096)
    assert ev.of("context_changed")[-1] == (15007, 4096, True)
    assert not c.send(draft)
    assert "15,007 tokens" in ev.of("refused")[-1][0] and "4,096" in ev.of("refused")[-1][0]
    assert engine.requests == [] and c.store.list_conversations() == []
    # a short one fits
    assert c.send("short")


def test_estimate_tokens():
    assert estimate_tokens("") == 0 and estimate_tokens("abcd") == 1
    assert estimate_tokens("word " * 100) == 125
    assert estimate_tokens("\u4f60\u597d") == 2


def test_title_from():
    assert title_from("\n  hello   world \nsecond") == "hello world"
    assert len(title_from("x" * 100)) == 48
