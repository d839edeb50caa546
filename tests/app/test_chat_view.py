"""The chat area widgets without an engine: streaming, rendering budget, scrolling, copying."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication

from tritonchat.app.chat_view import ChatView, RichText, ThinkingBlock
from tritonchat.app.markdown import RenderStyle


@pytest.fixture
def view(qtbot):
    v = ChatView(RenderStyle())
    qtbot.addWidget(v)
    v.resize(700, 500)
    v.show()
    return v


def msg(i, role, content, thinking="", stats=None):
    return SimpleNamespace(id=i, role=role, content=content, thinking=thinking, stats=stats)


def count_renders(monkeypatch, widget):
    calls = []
    original = widget.render
    monkeypatch.setattr(widget, "render", lambda: (calls.append(1), original()))
    return calls


def test_welcome_when_empty(view):
    assert view.welcome.isVisible() and not view.scroll.isVisible()
    view.add_message(1, "user", "hi")
    assert not view.welcome.isVisible() and view.scroll.isVisible()
    view.clear()
    assert view.welcome.isVisible() and view.messages == []


def test_welcome_cards_leave_room_for_the_timing_panel(view):
    # two rows of two cards: the empty chat does not force a wide window (four in a row
    # needed ~710 px, which left the timing panel ~260 px of a 1,180 px window)
    assert view.welcome.minimumSizeHint().width() <= 480
    b = view.welcome.buttons
    assert view.welcome.isVisible() and b[0].y() == b[1].y() < b[2].y() == b[3].y()


def test_suggestion_fills_nothing_but_emits(view, qtbot):
    with qtbot.waitSignal(view.suggestionChosen) as blocker:
        view.welcome.buttons[1].click()
    assert blocker.args[0] == view.welcome.SUGGESTIONS[1][2]


def test_set_messages_skips_system_and_renders_each_once(view, monkeypatch):
    import tritonchat.app.chat_view as cv

    rendered = []
    real = cv.MessageWidget.render
    monkeypatch.setattr(cv.MessageWidget, "render", lambda self: (rendered.append(self.msg_id), real(self)))
    view.set_messages([msg(1, "system", "sys"), msg(2, "user", "q"),
                       msg(3, "assistant", "**a**", stats={"new_tokens": 3})])
    assert [w.msg_id for w in view.messages] == [2, 3]
    assert sorted(rendered) == [2, 3]
    assert "<b>a</b>" in view.messages[1].body.toHtml() or "font-weight" in view.messages[1].body.toHtml()


def test_streaming_is_rendered_on_a_timer_not_per_token(view, monkeypatch, qtbot):
    view.add_message(1, "user", "q")
    finished = view.add_message(2, "assistant", "an older answer")
    old_renders = count_renders(monkeypatch, finished)
    w = view.begin_stream(3, thinking_enabled=False)
    renders = count_renders(monkeypatch, w)
    for i in range(300):
        view.append_stream("", f"tok{i} ")
    assert renders == []                                   # nothing rendered synchronously
    qtbot.waitUntil(lambda: len(renders) >= 1, timeout=2000)
    assert len(renders) <= 2
    assert "tok299" in w.body.toPlainText()
    view.finish_stream(w.content, "", None, {"new_tokens": 300, "stop_reason": "eos"})
    assert old_renders == []                               # finished messages are not re-rendered
    assert not w.streaming and view.streaming is None
    assert "\u258d" not in w.body.toPlainText()             # the caret is gone


def test_thinking_block_lifecycle(view, qtbot):
    w = view.begin_stream(1, thinking_enabled=True)
    block = w.thinking_block
    assert block.isVisibleTo(view) and block.label() == "Thinking\u2026" and block.expanded
    view.append_stream("let me see", "")
    w.flush_render()
    assert "let me see" in block.body.toPlainText()
    view.append_stream("", "The answer")                   # answering: thinking folds away
    assert not block.expanded and block.label().startswith("Thought for")
    view.finish_stream("The answer", "let me see", 2.5, {"stop_reason": "eos", "thinking_seconds": 2.5})
    assert block.label() == "Thought for 2.5 s"
    assert "let me see" not in w.body.toPlainText()


def test_thinking_block_respects_the_user(view):
    w = view.begin_stream(1, thinking_enabled=True)
    block = w.thinking_block
    block.toggle.click()                                    # the user folds it while it streams
    assert not block.expanded and block.user_toggled
    view.append_stream("more", "")
    block.toggle.click()                                    # and opens it again
    view.append_stream("", "answer")
    assert block.expanded                                   # no automatic folding any more


def test_stopped_mid_thought_label(view):
    w = view.add_message(1, "assistant", "", "half a thought",
                         {"stop_reason": "stopped", "thinking_seconds": 1.25})
    assert w.thinking_block.label() == "Stopped after 1.2 s" or w.thinking_block.label() == "Stopped after 1.3 s"
    assert "no answer" in w.body.toPlainText()


def test_thought_for_long_durations_rounds():
    block = ThinkingBlock(RenderStyle())
    block.set_done(42.4)
    assert block.label() == "Thought for 42 s"
    block.set_done(0.04, stopped=True)
    assert block.label() == "Thinking stopped"


def test_no_thinking_block_without_thinking(view):
    w = view.add_message(1, "assistant", "plain")
    assert not w.thinking_block.isVisibleTo(view)


def test_copy_message_and_code_block(view, qtbot):
    w = view.add_message(1, "assistant", "text\n\n```python\nprint('x')\n```\n\n```\nsecond\n```")
    assert w.code_blocks == ["print('x')", "second"]
    with qtbot.waitSignal(view.copied):
        w.body.anchorClicked.emit(QUrl("copy-code:1"))
    assert QGuiApplication.clipboard().text() == "second"
    with qtbot.waitSignal(view.copied):
        w.copy_button.click()
    assert QGuiApplication.clipboard().text() == w.content
    before = QGuiApplication.clipboard().text()
    w.body.anchorClicked.emit(QUrl("copy-code:7"))          # no such block: nothing happens
    assert QGuiApplication.clipboard().text() == before


def test_user_messages_are_plain_text(view):
    w = view.add_message(1, "user", "**not bold** <b>x</b>\nline two")
    text = w.body.toPlainText()
    assert "**not bold** <b>x</b>" in text and "line two" in text
    assert w.edit_button.isVisibleTo(view) and not w.regenerate_button.isVisibleTo(view)


def test_actions_follow_busy_and_last_answer(view):
    view.add_message(1, "user", "a")
    first = view.add_message(2, "assistant", "b")
    view.add_message(3, "user", "c")
    last = view.add_message(4, "assistant", "d")
    assert not first.regenerate_button.isVisibleTo(view) and last.regenerate_button.isVisibleTo(view)
    view.set_busy(True)
    assert not last.regenerate_button.isVisibleTo(view)
    assert not view.messages[0].edit_button.isEnabled()
    view.set_busy(False)
    assert view.messages[0].edit_button.isEnabled()
    assert view.last_answer() == "d"


def test_remove_from_drops_the_tail(view):
    for i, role in enumerate(["user", "assistant", "user", "assistant"], start=1):
        view.add_message(i, role, f"m{i}")
    view.remove_from(3)
    assert [w.msg_id for w in view.messages] == [1, 2]
    view.remove_from(99)                                     # unknown id: nothing changes
    assert [w.msg_id for w in view.messages] == [1, 2]
    view.remove_from(1)
    assert view.messages == [] and view.welcome.isVisible()


def test_autoscroll_only_while_at_the_bottom(view, qtbot):
    for i in range(12):
        view.add_message(i * 2, "user", f"question {i}\n" * 3)
        view.add_message(i * 2 + 1, "assistant", "answer line\n\n" * 6)
    bar = view.scroll.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0)
    view.scroll_to_bottom()
    w = view.begin_stream(999, thinking_enabled=False)
    view.append_stream("", "growing\n\n" * 20)
    w.flush_render()
    qtbot.waitUntil(lambda: bar.value() == bar.maximum())
    assert view.at_bottom()
    bar.setValue(0)                                           # the user scrolls up to read
    assert not view.at_bottom()
    old_max = bar.maximum()
    view.append_stream("", "more\n\n" * 20)
    w.flush_render()
    qtbot.waitUntil(lambda: bar.maximum() > old_max)
    assert bar.value() == 0                                    # the view stays where the user is
    bar.setValue(bar.maximum())                                # back at the bottom: follows again
    view.append_stream("", "even more\n\n" * 20)
    w.flush_render()
    qtbot.waitUntil(lambda: bar.value() == bar.maximum() and view.at_bottom())


def test_rich_text_fits_its_content(qtbot):
    r = RichText()
    qtbot.addWidget(r)
    r.resize(400, 10)
    r.show()
    r.set_html("<p>one</p>")
    short = r.height()
    r.set_html("<p>" + "<br/>".join(["line"] * 30) + "</p>")
    assert r.height() > short * 5


def test_interrupted_thinking_without_stats(view):
    w = view.add_message(1, "assistant", "", "cut short", None)
    assert w.thinking_block.label() == "Thoughts (interrupted)"
    assert w.stats_label.text() == ""


def test_narrow_window_wraps_instead_of_overflowing(view, qtbot):
    short = view.add_message(1, "user", "hi")
    view.add_message(2, "user", "a long message " * 30)
    view.add_message(3, "assistant", "an answer " * 60,
                     stats={"ttft_ms": 1234.0, "prefill_tok_s": 45678.0, "decode_tok_s": 1234.5,
                            "new_tokens": 99999, "stop_reason": "max_tokens", "backend": "triton",
                            "dtype": "bfloat16", "split_k": True, "graph": True})
    qtbot.waitUntil(lambda: short.bubble.width() > 0)
    assert short.bubble.width() < view.width() * 0.3          # a short message hugs its text
    for width in (900, 420):
        view.resize(width, 500)
        qtbot.waitUntil(lambda: view.scroll.viewport().width() <= width)
        for w in view.messages:
            qtbot.waitUntil(lambda w=w: w.width() <= view.scroll.viewport().width())
            if w.bubble is not None:
                assert w.bubble.width() <= 0.8 * w.width() + 1


def test_long_code_lines_wrap_inside_the_bubble(view, qtbot):
    """A code line far wider than the window is wrapped, never clipped: the document is no
    wider than the text view, and every character of the line is still in the text."""
    line = "result = compute(" + ", ".join(f"argument_{i}" for i in range(40)) + ")"
    w = view.add_message(1, "assistant", f"Here:\n\n```python\n{line}\n```\n")
    view.resize(520, 500)
    qtbot.waitUntil(lambda: w.body.viewport().width() > 0)
    qtbot.waitUntil(lambda: w.body.document().size().width() <= w.body.viewport().width() + 1)
    doc = w.body.document()
    assert doc.size().width() <= w.body.viewport().width() + 1
    assert line in doc.toPlainText().replace("\u2028", "").replace("\n", "")
    # the wrapped block is taller than one line of code
    assert doc.size().height() > 3 * w.body.fontMetrics().height()


def test_render_interval_follows_the_render_cost(view, monkeypatch, qtbot):
    """A long answer costs more to re-render: the interval grows with the cost (the GUI thread
    leaves the GIL to the engine thread), and the next answer starts at the base interval."""
    import time

    from tritonchat.app import chat_view as cv
    w = view.begin_stream(1, thinking_enabled=False)
    assert view._timer.interval() == cv.RENDER_INTERVAL_MS
    original = w.render
    monkeypatch.setattr(w, "render", lambda: (time.sleep(0.02), original()))   # 20 ms a render
    view.append_stream("", "slow ")
    qtbot.waitUntil(lambda: view._timer.interval() > cv.RENDER_INTERVAL_MS, timeout=3000)
    assert cv.RENDER_COST_FACTOR * 20 <= view._timer.interval() <= cv.RENDER_MAX_INTERVAL_MS
    view.finish_stream(w.content, "", None, {"new_tokens": 1, "stop_reason": "eos"})
    view.begin_stream(2, thinking_enabled=False)
    assert view._timer.interval() == cv.RENDER_INTERVAL_MS
