"""The window's chat wiring on a recorded fake engine (fast): drafts, suggestions, variants'
arrows, interrupted answers. The real tiny model runs in test_main_window.py."""
from __future__ import annotations

import json

from PySide6.QtCore import Qt


def send(qtbot, w, text):
    w.input.set_text(text)
    with qtbot.waitSignal(w.generationFinished, timeout=20000) as blocker:
        qtbot.keyClick(w.input.box, Qt.Key.Key_Return)
    return blocker.args[0]


def test_a_suggestion_card_never_overwrites_a_draft(qtbot, make_fake_window):
    w = make_fake_window()
    card = w.chat.welcome.buttons[0]
    prompt = card.toolTip()
    qtbot.mouseClick(card, Qt.MouseButton.LeftButton)          # an empty box: filled
    assert w.input.text() == prompt
    w.input.set_text("my own careful draft")
    qtbot.mouseClick(w.chat.welcome.buttons[1], Qt.MouseButton.LeftButton)
    text = w.input.text()
    assert text.startswith("my own careful draft") and text.endswith(w.chat.welcome.buttons[1].toolTip())
    w.input.box.undo()                                          # one Ctrl+Z takes it back out
    assert w.input.text() == "my own careful draft"


def test_drafts_follow_their_conversation_and_survive_a_restart(qtbot, make_fake_window, store):
    w = make_fake_window()
    send(qtbot, w, "chat a")
    a = w.conv_id
    w.input.set_text("unfinished thought in a")
    w.new_chat()
    assert w.input.text() == ""                                 # the new chat has its own
    w.input.set_text("draft of the new chat")
    w.open_conversation(a)
    assert w.input.text() == "unfinished thought in a"
    w.close()
    w2 = make_fake_window()
    assert w2.conv_id == a and w2.input.text() == "unfinished thought in a"
    w2.new_chat()
    assert w2.input.text() == "draft of the new chat"


def test_the_meter_counts_a_long_draft_without_blocking(qtbot, make_fake_window, fake_loader):
    w = make_fake_window()
    draft = "word " * 15000                                     # 75,000 characters
    w.input.set_text(draft)
    assert w.input.context_used > 10000 and not w.input.context_exact   # estimated at once
    assert w.input.meter_label.text().startswith("~")
    qtbot.waitUntil(lambda: w.input.context_exact, timeout=10000)        # counted off the GUI thread
    assert w.input.context_used == 15000 + 5 + 3
    assert w.input.over_context and "too long" in w.input.meter.toolTip()


def test_regenerate_arrows_switch_variants(qtbot, make_fake_window, fake_loader):
    w = make_fake_window()
    fake_loader.sessions[-1].answers = ["first answer", "second answer"]
    send(qtbot, w, "hi")
    with qtbot.waitSignal(w.generationFinished, timeout=20000):
        qtbot.mouseClick(w.chat.messages[-1].regenerate_button, Qt.MouseButton.LeftButton)
    answer = w.chat.messages[-1]
    assert answer.content == "second answer" and answer.variant_label.text() == "2/2"
    qtbot.mouseClick(answer.prev_button, Qt.MouseButton.LeftButton)
    assert w.chat.messages[-1].content == "first answer"
    assert w.chat.messages[-1].variant_label.text() == "1/2"
    qtbot.mouseClick(w.chat.messages[-1].next_button, Qt.MouseButton.LeftButton)
    assert w.chat.messages[-1].content == "second answer"


def test_edit_keeps_the_text_in_view_and_retitles(qtbot, make_fake_window):
    w = make_fake_window()
    send(qtbot, w, "original question")
    user = w.chat.messages[0]
    user.begin_edit()
    user.edit_box.setPlainText("better question")
    with qtbot.waitSignal(w.generationFinished, timeout=20000):
        user.submit_edit()
    assert [m.content for m in w.chat.messages] == ["better question", "A fake answer."]
    assert w.chat.messages[0].variant_label.text() == "2/2"
    assert w.header_title.full_text == "better question"
    assert w.store.get_conversation(w.conv_id).title == "better question"


def test_an_answer_cut_off_by_a_crash_shows_as_interrupted(qtbot, make_fake_window, store):
    conv = store.create_conversation("crashed")
    store.add_message(conv, "user", "tell me")
    store.add_message(conv, "assistant", "half of it", streaming=True)
    empty = store.create_conversation("empty")
    store.add_message(empty, "user", "x")
    store.add_message(empty, "assistant", "", streaming=True)     # killed before the first save
    w = make_fake_window()
    assert [m.role for m in store.messages(empty)] == ["user"]
    w.open_conversation(conv)
    answer = w.chat.messages[-1]
    assert "interrupted" in answer.stats_label.text()
    assert "interrupted" in answer.body.toPlainText()
    data = store.export_json(conv)
    assert json.dumps(data).count('"interrupted": true') == 1
