"""The main window end to end, on a tiny random-weight checkpoint and the reference backend."""
from __future__ import annotations

import copy
import json
import time

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication

from tritonchat.app.conversation import title_from
from tritonchat.app.main_window import CPU_BANNER
from tritonchat.app.settings import load_settings


def send(qtbot, w, text, timeout=60000):
    """Type text, press Enter, wait for the answer; returns the stored stats."""
    w.input.set_text(text)
    with qtbot.waitSignal(w.generationFinished, timeout=timeout) as blocker:
        qtbot.keyClick(w.input.box, Qt.Key.Key_Return)
    return blocker.args[0]


def stored(w, conv_id=None):
    return w.store.messages(conv_id if conv_id is not None else w.conv_id)


def test_title_from():
    assert title_from("\n  hello   world \nsecond") == "hello world"
    long = "x" * 100
    assert len(title_from(long)) == 48 and title_from(long).endswith("\u2026")
    assert title_from("   ") == ""


def test_send_streams_saves_and_shows_stats(qtbot, make_window, recording_loader, on_gui):
    w = make_window(max_new_tokens=64)
    assert w.loaded and w.input.ready
    assert w.chat.welcome.isVisible()               # empty chat: welcome state
    deltas = []
    seen_streaming = []
    on_gui(w.engine.worker.textDelta, lambda rid, th, an: (deltas.append(an),
                                                           seen_streaming.append(w.chat.streaming is not None)))
    stats = send(qtbot, w, "Hello there")

    msgs = stored(w)
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[0].content == "Hello there"
    # the answer arrived in pieces while the message was streaming, and the pieces add up
    assert deltas and any(seen_streaming)
    assert "".join(deltas) == msgs[1].content
    assert msgs[1].stats["stop_reason"] in ("eos", "max_tokens")
    assert msgs[1].stats["backend"] == "reference" and msgs[1].stats["dtype"] == "float32"
    assert 0 < msgs[1].stats["new_tokens"] <= 64
    assert stats == msgs[1].stats
    # the conversation got its title from the message and is selected in the list
    assert w.store.get_conversation(w.conv_id).title == "Hello there"
    assert w.sidebar.current_id() == w.conv_id
    # the widget shows the same text and a stats line with the engine flags
    answer = w.chat.messages[-1]
    assert answer.role == "assistant" and answer.content == msgs[1].content
    line = answer.stats_label.text()
    assert "tok/s" in line and "reference fp32" in line and "TTFT" in line
    assert not w.input.generating and w.input.text() == ""
    # the context meter counts the conversation
    assert w.input.meter.maximum() == w.max_context
    qtbot.waitUntil(lambda: w.input.meter.value() > 0)


def test_stop_mid_answer(qtbot, make_window, on_gui):
    w = make_window(max_new_tokens=4000, ignore_eos=True)
    on_gui(w.engine.worker.textDelta, lambda *a: w.stop())      # stop at the first text
    stats = send(qtbot, w, "Tell me a long story")
    assert stats["stop_reason"] == "stopped"
    assert stats["new_tokens"] < 4000
    msgs = stored(w)
    assert msgs[-1].role == "assistant" and msgs[-1].stats["stop_reason"] == "stopped"
    assert "stopped" in w.chat.messages[-1].stats_label.text()
    assert not w.input.generating


def test_stop_mid_thought(qtbot, make_window, on_gui):
    w = make_window(max_new_tokens=4000, thinking=True, ignore_eos=True)
    thinking_seen = []

    def on_text(rid, th, an):
        if th:
            thinking_seen.append(th)
            w.stop()

    on_gui(w.engine.worker.textDelta, on_text)
    stats = send(qtbot, w, "Think hard")
    assert thinking_seen and stats["stop_reason"] == "stopped"
    msg = stored(w)[-1]
    assert msg.thinking and msg.thinking.startswith(thinking_seen[0])
    block = w.chat.messages[-1].thinking_block
    assert block.isVisibleTo(w) and block.text() == msg.thinking
    if not msg.content:
        assert block.label().startswith(("Stopped after", "Thinking stopped"))
    # the next turn still works after a stop in mid-thought
    stats2 = send(qtbot, w, "Go on")
    assert stats2["stop_reason"] == "stopped"
    assert [m.role for m in stored(w)] == ["user", "assistant", "user", "assistant"]


def test_thinking_block_collapses_and_says_how_long(qtbot, make_window):
    w = make_window(max_new_tokens=200, thinking=True)
    send(qtbot, w, "Why?")
    msg = stored(w)[-1]
    block = w.chat.messages[-1].thinking_block
    assert msg.thinking
    assert block.label().startswith(("Thought for", "Stopped after"))
    assert msg.stats["thinking_seconds"] >= 0.0
    # reopened later, the stored message shows the same block, folded
    w.open_conversation(w.conv_id)
    block = w.chat.messages[-1].thinking_block
    assert not block.expanded and block.label().startswith("Thought for")
    qtbot.mouseClick(block.toggle, Qt.MouseButton.LeftButton)
    assert block.expanded and block.body.isVisibleTo(w)


def test_regenerate_keeps_the_previous_answer_as_a_variant(qtbot, make_window, recording_loader,
                                                           tmp_path, monkeypatch):
    w = make_window(seed="")                              # random seed: a fresh answer
    send(qtbot, w, "Pick a word")
    first = stored(w)
    last = w.chat.messages[-1]
    assert last.regenerate_button.isVisibleTo(w)
    assert not last.prev_button.isVisibleTo(w)            # one answer: no arrows
    with qtbot.waitSignal(w.generationFinished, timeout=60000):
        qtbot.mouseClick(last.regenerate_button, Qt.MouseButton.LeftButton)
    second = stored(w)
    assert [m.role for m in second] == ["user", "assistant"]
    assert second[0].id == first[0].id and second[1].id != first[1].id
    assert (second[1].variant, second[1].variants) == (2, 2)
    session = recording_loader.sessions[-1]
    gens = session.of("generate")
    assert len(gens) == 2 and gens[0][1] == gens[1][1]    # the same conversation was answered again
    assert len(w.chat.messages) == 2
    answer = w.chat.messages[-1]
    assert answer.prev_button.isVisibleTo(w) and answer.variant_label.text() == "2/2"
    assert answer.prev_button.isEnabled() and not answer.next_button.isEnabled()
    # ‹ shows the first answer again, persisted; the next turn's context is that one
    qtbot.mouseClick(answer.prev_button, Qt.MouseButton.LeftButton)
    answer = w.chat.messages[-1]
    assert answer.msg_id == first[1].id and answer.variant_label.text() == "1/2"
    assert answer.content == first[1].content
    assert stored(w)[-1].id == first[1].id
    send(qtbot, w, "again")
    context = session.of("generate")[-1][1]
    assert context[1] == {"role": "assistant", "content": first[1].content}
    # both variants are in the exports, the selected one marked
    monkeypatch.setattr(w, "_ask_save_path", lambda title, fmt: str(tmp_path / f"out.{fmt}"))
    w.export_json_action.trigger()
    data = json.loads((tmp_path / "out.json").read_text(encoding="utf-8"))
    variants = data["messages"][1]["variants"]
    assert [v["selected"] for v in variants] == [True, False]
    assert variants[1]["content"] == second[1].content
    w.export_md_action.trigger()
    md = (tmp_path / "out.markdown").read_text(encoding="utf-8")
    assert "variant 1 of 2, selected" in md and "Variant 2 of 2" in md


def test_regenerate_only_on_the_last_answer(qtbot, make_window):
    w = make_window()
    send(qtbot, w, "one")
    send(qtbot, w, "two")
    answers = [m for m in w.chat.messages if m.role == "assistant"]
    assert not answers[0].regenerate_button.isVisibleTo(w)
    assert answers[1].regenerate_button.isVisibleTo(w)
    w.regenerate(answers[0].msg_id)                        # ignored: not the last answer
    assert not w.input.generating and len(stored(w)) == 4


def test_edit_and_resend(qtbot, make_window, recording_loader):
    w = make_window()
    send(qtbot, w, "first question")
    send(qtbot, w, "second question")
    first_user = w.chat.messages[0]
    qtbot.mouseClick(first_user.edit_button, Qt.MouseButton.LeftButton)
    assert first_user.editing and first_user.edit_box.toPlainText() == "first question"
    first_user.edit_box.setPlainText("edited question")
    with qtbot.waitSignal(w.generationFinished, timeout=60000):
        first_user.submit_edit()
    msgs = stored(w)
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[0].content == "edited question"
    last_call = recording_loader.sessions[-1].of("generate")[-1]
    assert last_call[1] == [{"role": "user", "content": "edited question"}]
    assert [m.content for m in w.chat.messages if m.role == "user"] == ["edited question"]


def test_edit_cancel_keeps_everything(qtbot, make_window):
    w = make_window()
    send(qtbot, w, "keep me")
    user = w.chat.messages[0]
    user.begin_edit()
    user.edit_box.setPlainText("changed")
    user.cancel_edit()
    assert not user.editing and user.content == "keep me"
    assert [m.content for m in stored(w)][0] == "keep me"


def test_history_survives_a_restart(qtbot, make_window, store, qsettings):
    w = make_window()
    send(qtbot, w, "remember this")
    conv, answer = w.conv_id, stored(w)[-1].content
    w.close()
    w2 = make_window()
    assert w2.conv_id == conv                              # the last chat reopens
    assert [m.msg_id for m in w2.chat.messages] == [m.id for m in store.messages(conv)]
    assert w2.chat.messages[0].content == "remember this"
    assert w2.chat.messages[1].content == answer
    assert w2.chat.messages[1].stats_label.text() != ""
    # and it continues the same conversation
    send(qtbot, w2, "and this")
    assert len(stored(w2, conv)) == 4


def test_new_chat_rename_search_and_delete(qtbot, make_window, monkeypatch):
    w = make_window()
    send(qtbot, w, "alpha topic")
    a = w.conv_id
    qtbot.keyClick(w, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert w.conv_id is None and w.chat.welcome.isVisible()
    send(qtbot, w, "beta topic")
    b = w.conv_id
    assert a != b and w.sidebar.ids() == [b, a]            # newest first
    # switching shows the other conversation
    w.sidebar.list.setCurrentRow(1)
    assert w.conv_id == a and w.chat.messages[0].content == "alpha topic"
    # rename through the list's inline editor
    item = w.sidebar.list.item(1)
    item.setText("Renamed alpha")
    assert w.store.get_conversation(a).title == "Renamed alpha"
    assert w.header_title.full_text == "Renamed alpha"
    # search narrows the list (debounced)
    w.sidebar.search.setText("beta")
    qtbot.waitUntil(lambda: w.sidebar.ids() == [b])
    w.sidebar.search.setText("")
    qtbot.waitUntil(lambda: len(w.sidebar.ids()) == 2)
    # delete asks first; "no" keeps it
    asked = []
    monkeypatch.setattr(w, "_confirm", lambda title, text: asked.append(text) or False)
    w.delete_conversation(a)
    assert asked and "Renamed alpha" in asked[0] and len(w.store.list_conversations()) == 2
    monkeypatch.setattr(w, "_confirm", lambda title, text: True)
    w.open_conversation(a)
    w.delete_conversation(a)
    assert [c.id for c in w.store.list_conversations()] == [b]
    assert w.conv_id is None and w.chat.welcome.isVisible()
    with pytest.raises(Exception):
        w.store.get_conversation(a)


def test_export_markdown_and_json(qtbot, make_window, tmp_path, monkeypatch):
    w = make_window()
    send(qtbot, w, "export me")
    target = {}
    monkeypatch.setattr(w, "_ask_save_path", lambda title, fmt: str(tmp_path / f"out.{fmt}"))
    w.export_md_action.trigger()
    w.export_json_action.trigger()
    md = (tmp_path / "out.markdown").read_text(encoding="utf-8")
    data = json.loads((tmp_path / "out.json").read_text(encoding="utf-8"))
    answer = stored(w)[-1].content
    assert "export me" in md
    assert data == json.loads(json.dumps(w.store.export_json(w.conv_id)))
    # the answer as JSON writes it (a random model's text holds backslashes and tabs)
    assert "export me" in json.dumps(data)
    assert json.dumps(answer[:20], ensure_ascii=False)[1:-1] in json.dumps(data, ensure_ascii=False)
    assert target == {}


def test_settings_reach_the_next_generate(qtbot, make_window, recording_loader):
    w = make_window()
    s = copy.deepcopy(w.settings)
    s.system_prompt = "You are terse."
    s.sampling.temperature = 0.35
    s.sampling.top_k = 7
    s.max_new_tokens = 5
    s.thinking = True
    s.seed = 1234
    w.apply_settings(s)
    stats = send(qtbot, w, "hi")
    _, messages, params, kw = recording_loader.sessions[-1].of("generate")[-1]
    assert messages[0] == {"role": "system", "content": "You are terse."}
    assert params.temperature == 0.35 and params.top_k == 7 and params.seed == 1234
    assert kw["max_new_tokens"] == 5 and kw["enable_thinking"] is True
    assert stats["new_tokens"] <= 5
    # persisted: a later load reads the same values
    again = load_settings(w.qs, w.model_defaults)
    assert again.system_prompt == "You are terse." and again.sampling.temperature == 0.35
    assert again.max_new_tokens == 5 and again.thinking is True and again.seed == 1234


def test_engine_switches_reach_configure(qtbot, make_window, recording_loader):
    w = make_window()
    session = recording_loader.sessions[-1]
    s = copy.deepcopy(w.settings)
    s.engine.update(split_k=False, graph=False)
    w.apply_settings(s)
    qtbot.waitUntil(lambda: len(session.of("configure")) == 1, timeout=10000)
    assert session.of("configure")[-1] == ("configure", {"split_k": False, "graph": False})
    s = copy.deepcopy(s)
    s.engine["graph"] = True
    w.apply_settings(s)
    qtbot.waitUntil(lambda: len(session.of("configure")) == 2, timeout=10000)
    assert session.of("configure")[-1] == ("configure", {"graph": True})
    s = copy.deepcopy(s)
    s.engine["l2_state"] = False
    w.apply_settings(s)
    qtbot.waitUntil(lambda: len(session.of("configure")) == 3, timeout=10000)
    assert session.of("configure")[-1] == ("configure", {"l2_state": False})
    s = copy.deepcopy(s)
    s.engine["context_ranges"] = False
    w.apply_settings(s)
    qtbot.waitUntil(lambda: len(session.of("configure")) == 4, timeout=10000)
    assert session.of("configure")[-1] == ("configure", {"context_ranges": False})
    s = copy.deepcopy(s)
    s.engine["launch_cache"] = False
    w.apply_settings(s)
    qtbot.waitUntil(lambda: len(session.of("configure")) == 5, timeout=10000)
    assert session.of("configure")[-1] == ("configure", {"launch_cache": False})
    w.apply_settings(copy.deepcopy(s))                    # nothing changed: nothing is sent
    send(qtbot, w, "after the switches")
    assert len(session.of("configure")) == 5


def test_decode_mode_is_kept_but_not_sent_to_the_reference_engine(qtbot, make_window, recording_loader,
                                                                   errors_shown):
    """issue #59: the decode mode is saved like the switches; the reference engine (which has no
    decode modes) is not asked to change it, and nothing fails."""
    w = make_window()
    session = recording_loader.sessions[-1]
    sent = []
    w.engine.configure = lambda _c=w.engine.configure, **kw: (sent.append(kw), _c(**kw))
    s = copy.deepcopy(w.settings)
    s.engine_choices["decode_mode"] = "persistent"
    w.apply_settings(s)
    del w.engine.configure
    assert sent == [{"decode_mode": "persistent"}]
    send(qtbot, w, "after the mode")
    assert session.of("configure") == [] and errors_shown == []
    assert load_settings(w.qs, w.model_defaults).choice("decode_mode") == "persistent"


def test_decode_mode_switches_the_triton_engine_and_says_when_it_falls_back(qtbot, make_window,
                                                                            recording_loader, monkeypatch):
    """On the Triton engine (the interpreter here) choosing persistent reaches the backend's
    configure(decode_mode=...); where the step cannot run, the banner says the engine's sentence
    and the settings show the mode that runs, with the reason."""
    from tritonchat.app.settings_dialog import SettingsDialog
    from tritonchat.engine import persistent_step as PS

    w = make_window(engine_overrides={"backend": "triton", "device": "cpu", "graph": False}, context=256)
    session = recording_loader.sessions[-1]
    assert w.engine_options["backend"] == "triton" and w.engine_options["decode_mode"] == "per_op"
    s = copy.deepcopy(w.settings)
    s.engine_choices["decode_mode"] = "persistent"
    w.apply_settings(s)
    qtbot.waitUntil(lambda: w.engine_options.get("decode_mode") == "persistent", timeout=20000)
    assert session.of("configure")[-1] == ("configure", {"decode_mode": "persistent"})
    assert type(session.backend.decode_step).__name__ == "PersistentStep"
    assert "decode persistent" in w.engine_label.text()

    def refuse(self, *a, **kw):
        raise PS.PersistentUnavailable("its grid of 264 programs (2 an SM) cannot be resident at once")
    s = copy.deepcopy(s)
    s.engine_choices["decode_mode"] = "per_op"
    w.apply_settings(s)
    qtbot.waitUntil(lambda: w.engine_options.get("decode_mode") == "per_op", timeout=20000)
    monkeypatch.setattr(PS.PersistentStep, "__init__", refuse)
    s = copy.deepcopy(s)
    s.engine_choices["decode_mode"] = "persistent"
    w.apply_settings(s)
    qtbot.waitUntil(lambda: "cannot be resident" in w.banner.text(), timeout=20000)
    qtbot.waitUntil(lambda: len(session.of("configure")) == 3, timeout=20000)
    assert w.banner.isVisible() and w.banner.text().endswith("decoding per operator.")
    assert w.engine_options["decode_mode"] == "per_op" and "decode per_op" in w.engine_label.text()
    d = SettingsDialog(w.settings, w.model_defaults, w.capabilities, parent=w, running=w.engine_options)
    assert d.choices["decode_mode"].currentData() == "per_op"
    assert "cannot be resident" in d.decode_mode_note.text() and not d.decode_mode_note.isHidden()
    d.deleteLater()
    # back to per_op: it runs as asked, the settings no longer carry the reason
    s = copy.deepcopy(s)
    s.engine_choices["decode_mode"] = "per_op"
    w.apply_settings(s)
    qtbot.waitUntil(lambda: "decode_mode_error" not in w.capabilities, timeout=20000)


def test_context_length_change_applies_without_restart(qtbot, make_window, recording_loader):
    w = make_window()
    send(qtbot, w, "before")
    s = copy.deepcopy(w.settings)
    s.context_length = 1024
    w.apply_settings(s)
    # (the reference backend cannot resize in place: the worker builds the engine again)
    qtbot.waitUntil(lambda: w.engine_options.get("max_context") == 1024, timeout=60000)
    assert w.max_context == 1024
    qtbot.waitUntil(lambda: w.input.meter.maximum() == 1024)
    stats = send(qtbot, w, "after")
    assert stats["max_context"] == 1024


def test_a_prompt_that_cannot_fit_is_refused_before_sending(qtbot, make_window, errors_shown,
                                                            recording_loader):
    w = make_window()
    s = copy.deepcopy(w.settings)
    s.context_length = 256
    w.apply_settings(s)
    qtbot.waitUntil(lambda: w.engine_options.get("max_context") == 256, timeout=60000)
    long_text = "word " * 400
    w.input.set_text(long_text)
    # the meter counts the draft at once (an estimate), then the tokenizer's figure comes
    assert w.input.context_used > 256 and w.input.over_context
    qtbot.waitUntil(lambda: w.input.context_exact, timeout=20000)
    assert w.input.context_used > 256 and w.input.over_context
    qtbot.keyClick(w.input.box, Qt.Key.Key_Return)
    assert len(errors_shown) == 1
    sentence, _ = errors_shown[0]
    assert "context" in sentence.lower() and sentence.count(". ") == 0
    assert w.input.text() == long_text                    # the typed text is not lost
    assert w.store.list_conversations() == []             # the refused send left nothing behind
    assert w.conv_id is None and not w.input.generating
    assert recording_loader.sessions[-1].of("generate") == []


def test_oom_during_generation(qtbot, make_window, recording_loader, errors_shown):
    from tritonchat.app.errors import OOM_SENTENCE

    w = make_window()
    send(qtbot, w, "first")
    recording_loader.sessions[-1].fail_generate = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    w.input.set_text("second")
    with qtbot.waitSignal(w.generationFailed, timeout=60000):
        qtbot.keyClick(w.input.box, Qt.Key.Key_Return)
    assert errors_shown[-1][0] == OOM_SENTENCE
    assert "out of memory" in errors_shown[-1][1]
    assert w.input.text() == "second"
    assert [m.content for m in stored(w) if m.role == "user"] == ["first"]
    assert w.conv_id is not None                          # the earlier conversation stays


def test_failure_after_some_text_keeps_the_partial_answer(qtbot, make_window, recording_loader, errors_shown):
    w = make_window()
    session = recording_loader.sessions[-1]
    session.fail_generate = RuntimeError("boom")
    session.fail_after_text = 2
    w.input.set_text("go")
    with qtbot.waitSignal(w.generationFailed, timeout=60000):
        qtbot.keyClick(w.input.box, Qt.Key.Key_Return)
    msgs = stored(w)
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[1].content == "partial0 partial1 " and msgs[1].stats["stop_reason"] == "error"
    assert w.input.text() == "" and len(errors_shown) == 1
    assert "boom" in errors_shown[0][0] + errors_shown[0][1]


def test_cpu_banner_and_reference_timing_note(qtbot, make_window, recording_loader):
    w = make_window()
    assert w.banner.isVisible() and w.banner.text() == CPU_BANNER
    assert "tiny" not in w.banner.text()
    assert "reference" in w.engine_label.text()
    # the timing panel is closed by default; opening it turns engine timing on
    assert not w.timing.isVisible()
    session = recording_loader.sessions[-1]
    w.timing.toggleViewAction().trigger()
    qtbot.waitUntil(lambda: len(session.of("configure")) == 1, timeout=10000)
    assert w.timing.isVisible() and w.timing_button.isChecked()
    assert session.of("configure")[-1] == ("configure", {"timing": True})
    # it opens as the splitter's right pane, leaving the chat at least 60% of the width
    assert w.splitter.indexOf(w.timing) == 2
    qtbot.waitUntil(lambda: w.timing.width() > 0)
    assert w.splitter.widget(1).width() >= 0.6 * w.splitter.width()
    assert w.timing.note.isVisibleTo(w) and "Triton" in w.timing.note.text()
    assert not w.timing.table.isVisibleTo(w)
    send(qtbot, w, "measure me", timeout=60000)
    assert w.timing.xs and all(y > 0 for y in w.timing.ys)   # tok/s still plots
    assert "tok/s" in w.timing.summary.text()
    assert not w.timing.plan_range.isVisibleTo(w)          # no plans per context range here
    # an engine switch changed while the panel is open: the panel reads the timings again, after
    # the switch (the worker runs the two in order)
    reads = []
    read = w.engine.read_timings
    w.engine.configure = lambda _c=w.engine.configure, **kw: (reads.append("configure"), _c(**kw))
    w.engine.read_timings = lambda: (reads.append("read"), read())
    try:
        s = copy.deepcopy(w.settings)
        s.engine["context_ranges"] = not s.engine["context_ranges"]
        w.apply_settings(s)
    finally:
        del w.engine.read_timings, w.engine.configure
    assert reads == ["configure", "read"]
    qtbot.waitUntil(lambda: session.of("configure")[-1] == ("configure",
                                                             {"context_ranges": s.engine["context_ranges"]}),
                    timeout=10000)
    w.timing.toggleViewAction().trigger()
    qtbot.waitUntil(lambda: session.of("configure")[-1] == ("configure", {"timing": False}))
    assert not w.timing_button.isChecked()


def test_load_failure_dialog_and_app_stays_up(qtbot, make_window, tmp_path, errors_shown):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    w = make_window(empty, load=False)
    with qtbot.waitSignal(w.modelLoadFailed, timeout=60000):
        w.start()
    assert len(errors_shown) == 1 and errors_shown[0][0]
    assert w.banner.isVisible() and w.banner.text() == errors_shown[0][0]
    assert w.isVisible() and not w.loaded
    assert not w.input.ready
    w.input.set_text("typed while broken")
    qtbot.keyClick(w.input.box, Qt.Key.Key_Return)       # nothing happens, nothing is lost
    assert w.input.text() == "typed while broken" and w.store.list_conversations() == []


def test_first_launch_downloads_then_loads(qtbot, make_window, tiny_model_dir, monkeypatch):
    import tritonchat.engine.hub as hub

    monkeypatch.setattr(hub, "local_model_dir", lambda *a, **k: None)
    asked = []

    def download(repo_id, parent):
        asked.append(repo_id)
        return tiny_model_dir

    w = make_window("Example/Tiny-Model", load=False, download=download)
    with qtbot.waitSignal(w.modelLoaded, timeout=60000):
        w.start()
    assert asked == ["Example/Tiny-Model"] and w.model_dir == str(tiny_model_dir)


def test_cancelled_download_leaves_a_way_back(qtbot, make_window, monkeypatch):
    import tritonchat.engine.hub as hub

    monkeypatch.setattr(hub, "local_model_dir", lambda *a, **k: None)
    w = make_window("Example/Tiny-Model", load=False, download=lambda repo, parent: None)
    w.start()
    assert not w.loaded and w.download_action.isVisible()
    assert "not downloaded" in w.banner.text()


def test_local_snapshot_skips_the_download(qtbot, make_window, tiny_model_dir, monkeypatch):
    import tritonchat.engine.hub as hub

    monkeypatch.setattr(hub, "local_model_dir", lambda *a, **k: tiny_model_dir)
    w = make_window("Example/Tiny-Model", load=False,
                    download=lambda repo, parent: pytest.fail("must not download"))
    with qtbot.waitSignal(w.modelLoaded, timeout=60000):
        w.start()


def test_shortcuts_copy_last_answer_and_settings(qtbot, make_window, monkeypatch):
    w = make_window()
    send(qtbot, w, "copy me")
    QGuiApplication.clipboard().clear()
    qtbot.keyClick(w, Qt.Key.Key_C, Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier)
    assert QGuiApplication.clipboard().text() == stored(w)[-1].content
    opened = []
    monkeypatch.setattr(w, "open_settings", lambda: opened.append(True))
    w.settings_action.triggered.disconnect()
    w.settings_action.triggered.connect(lambda: w.open_settings())
    qtbot.keyClick(w, Qt.Key.Key_Comma, Qt.KeyboardModifier.ControlModifier)
    assert opened


def test_settings_dialog_round_trip_through_the_window(qtbot, make_window, monkeypatch, recording_loader):
    from tritonchat.app import main_window as mw

    w = make_window()

    def fake_exec(dialog):
        box = dialog.switches["split_k"]
        assert not box.isEnabled() and not box.isChecked() and "Triton" in box.toolTip()
        dialog.temperature.setValue(0.0)
        dialog.max_new_tokens.setValue(3)
        dialog.system_prompt.setPlainText("sys")
        return mw.SettingsDialog.DialogCode.Accepted

    monkeypatch.setattr(mw.SettingsDialog, "exec", fake_exec)
    w.open_settings()
    assert w.settings.max_new_tokens == 3 and w.settings.sampling.is_greedy
    send(qtbot, w, "greedy please")
    _, messages, params, kw = recording_loader.sessions[-1].of("generate")[-1]
    assert params.is_greedy and kw["max_new_tokens"] == 3 and messages[0]["content"] == "sys"


def test_theme_switch_rerenders(qtbot, make_window):
    w = make_window()
    send(qtbot, w, "```python\nprint(1)\n```")
    answer = w.chat.messages[-1]
    w.set_theme("dark")
    assert w.colors.name == "dark" and w.settings.theme == "dark"
    assert w.qs.value("ui/theme") == "dark"
    assert w.theme_actions["dark"].isChecked()
    assert answer.body._html is not None and w.colors.code_bg not in ("",)
    w.set_theme("light")
    assert w.colors.name == "light"


def test_switching_chats_while_generating_keeps_streaming(qtbot, make_window, on_gui):
    w = make_window(max_new_tokens=16, ignore_eos=True)
    send(qtbot, w, "older chat")
    older = w.conv_id
    w.settings.max_new_tokens = 4000
    w.new_chat()
    checks = {}

    def on_text(*_):
        if checks or w.gen is None:
            return
        streaming_conv = w.gen.conv_id
        w.open_conversation(older)                         # look elsewhere meanwhile
        checks["away"] = (w.chat.streaming is None, w.chat.messages[0].content, w.input.generating)
        w.open_conversation(streaming_conv)                # come back: still streaming, text kept
        checks["back"] = (w.chat.streaming is not None,
                          w.chat.streaming is not None and w.chat.streaming.content == w.gen.answer)
        w.stop()

    on_gui(w.engine.worker.textDelta, on_text)
    stats = send(qtbot, w, "streaming chat")
    assert checks["away"] == (True, "older chat", True)
    assert checks["back"] == (True, True)
    assert stats["stop_reason"] == "stopped"
    msgs = stored(w)
    assert w.conv_id != older and msgs[-1].stats["stop_reason"] == "stopped"
    assert w.chat.messages[-1].content == msgs[-1].content


def test_answer_reaches_the_store_while_it_streams(qtbot, make_window, on_gui):
    from tritonchat.app.conversation import SAVE_INTERVAL_S

    w = make_window(max_new_tokens=100000, ignore_eos=True)
    seen = []

    def on_text(*_):
        g = w.gen
        if g is None:
            return
        stored_text = w.store.messages(g.conv_id)[-1].content
        seen.append((time.monotonic(), stored_text, g.answer))
        if stored_text:
            w.stop()                       # the store caught up while streaming: enough

    on_gui(w.engine.worker.textDelta, on_text)
    t0 = time.monotonic()
    stats = send(qtbot, w, "stream into the store", timeout=120000)
    final = stored(w)[-1].content
    first_saved = next(s for s in seen if s[1])
    assert first_saved[2].startswith(first_saved[1]) and final.startswith(first_saved[1])
    # saved within the interval (plus a scheduling margin), long before the answer ended
    assert first_saved[0] - t0 < SAVE_INTERVAL_S + 5.0
    assert stats["stop_reason"] == "stopped"


def test_closing_mid_answer_keeps_what_was_written(qtbot, make_window, store):
    w = make_window(max_new_tokens=100000, ignore_eos=True)
    w.input.set_text("a long one")
    qtbot.keyClick(w.input.box, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: w.gen is not None and len(w.gen.answer) > 20, timeout=60000)
    conv = w.conv_id
    w.close()
    assert not w.engine.thread.isRunning()
    msg = store.messages(conv)[-1]
    assert msg.role == "assistant" and len(msg.content) > 20
    assert msg.stats["stop_reason"] == "stopped"


def test_a_long_title_ends_in_an_ellipsis_before_the_header_buttons(qtbot, make_window):
    """In a narrow window the chat's title was cut mid-word where the Timing button began."""
    w = make_window()
    w.show()
    text = "Write a python function that adds two numbers, with a code block please"
    send(qtbot, w, text)
    w.resize(900, 700)
    qtbot.waitUntil(lambda: w.header_title.text().endswith("\u2026"))
    title = w.header_title
    assert title.full_text == title.toolTip() and title.full_text.startswith("Write a python")
    assert title.fontMetrics().horizontalAdvance(title.text()) <= title.width()
    assert title.geometry().right() < w.timing_button.geometry().left()
    w.resize(1600, 800)                         # room again: the whole (list-length) title
    qtbot.waitUntil(lambda: title.text() == title.full_text)
