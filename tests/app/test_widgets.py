"""Input box, conversation list, timing panel: keys, signals and what they show."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from PySide6.QtCore import Qt

from tritonchat.app.chat_input import MAX_LINES, ChatInput
from tritonchat.app.conversation_list import ConversationList, age_text
from tritonchat.app.theme import DARK, LIGHT
from tritonchat.app.timing_panel import (COLUMNS, TimingPanel, format_bytes, kernel_sum_text,
                                        plan_range_text)


# ---------------------------------------------------------------- input

@pytest.fixture
def chat_input(qtbot):
    w = ChatInput()
    qtbot.addWidget(w)
    w.show()
    return w


def test_enter_sends_shift_enter_breaks_line(chat_input, qtbot):
    box = chat_input.box
    qtbot.keyClicks(box, "hello")
    qtbot.keyClick(box, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(box, "world")
    assert chat_input.text() == "hello\nworld"
    with qtbot.waitSignal(chat_input.sendRequested) as blocker:
        qtbot.keyClick(box, Qt.Key.Key_Return)
    assert blocker.args == ["hello\nworld"]
    assert chat_input.text() == "hello\nworld"           # the window clears it once it is stored


def test_blank_text_and_not_ready_do_not_send(chat_input, qtbot):
    sent = []
    chat_input.sendRequested.connect(sent.append)
    qtbot.keyClicks(chat_input.box, "   ")
    qtbot.keyClick(chat_input.box, Qt.Key.Key_Return)
    assert sent == [] and not chat_input.send_button.isEnabled()
    chat_input.set_text("real text")
    chat_input.set_ready(False, "The model is loading")
    qtbot.keyClick(chat_input.box, Qt.Key.Key_Return)
    assert sent == [] and chat_input.send_button.toolTip() == "The model is loading"
    chat_input.set_ready(True)
    chat_input.send_button.click()
    assert sent == ["real text"]


def test_escape_and_stop_button_stop(chat_input, qtbot):
    chat_input.set_generating(True)
    assert chat_input.stop_button.isVisible() and not chat_input.send_button.isVisible()
    with qtbot.waitSignal(chat_input.stopRequested):
        qtbot.keyClick(chat_input.box, Qt.Key.Key_Escape)
    with qtbot.waitSignal(chat_input.stopRequested):
        chat_input.stop_button.click()
    sent = []
    chat_input.sendRequested.connect(sent.append)
    chat_input.set_text("queued?")
    qtbot.keyClick(chat_input.box, Qt.Key.Key_Return)
    assert sent == []                                        # one answer at a time
    chat_input.set_generating(False)
    assert chat_input.send_button.isVisible()


def test_restore_keeps_new_typing(chat_input):
    chat_input.restore("lost message")
    assert chat_input.text() == "lost message"
    chat_input.set_text("typed meanwhile")
    chat_input.restore("lost message")
    assert chat_input.text() == "lost message\n\ntyped meanwhile"


def test_box_grows_then_scrolls(chat_input):
    one = chat_input.box.height()
    chat_input.set_text("x\n" * 3)
    three = chat_input.box.height()
    chat_input.set_text("x\n" * 40)
    many = chat_input.box.height()
    chat_input.set_text("x\n" * (MAX_LINES + 5))
    assert one < three < many and many == chat_input.box.height()


def test_context_meter(chat_input):
    chat_input.set_context(1234, 32768)
    assert chat_input.meter.maximum() == 32768 and chat_input.meter.value() == 1234
    assert chat_input.meter_label.text() == "1,234 / 32,768 tokens"
    assert "almost full" not in chat_input.meter.toolTip()
    chat_input.set_context(30000, 32768)
    assert "almost full" in chat_input.meter.toolTip() and not chat_input.over_context
    chat_input.set_context(40000, 32768)                    # over: the bar is full, the text says so
    assert chat_input.meter.value() == 32768 and "too long to send" in chat_input.meter.toolTip()
    assert chat_input.over_context
    chat_input.set_context(500, 32768, exact=False)         # an estimate until the tokenizer counted
    assert chat_input.meter_label.text() == "~500 / 32,768 tokens" and "estimated" in chat_input.meter.toolTip()


# ---------------------------------------------------------------- conversation list

def conv(i, title, age=0.0):
    return SimpleNamespace(id=i, title=title, created_at=time.time() - age, updated_at=time.time() - age)


def test_key_hint_ends_in_an_ellipsis_when_narrow(chat_input, qtbot):
    hint = chat_input.hint
    full = "Enter to send \u00b7 Shift+Enter for a new line \u00b7 Esc to stop"
    chat_input.resize(900, 200)
    qtbot.waitUntil(lambda: hint.text() == full)
    chat_input.resize(360, 200)
    qtbot.waitUntil(lambda: hint.text() != full)
    assert hint.text().endswith("\u2026") and full.startswith(hint.text()[:-1])
    assert hint.fontMetrics().horizontalAdvance(hint.text()) <= hint.width()
    assert hint.toolTip() == full


def test_age_text():
    now = 1_000_000.0
    assert age_text(now - 5, now) == "just now"
    assert age_text(now - 300, now) == "5 min ago"
    assert age_text(now - 7200, now) == "2 h ago"
    assert age_text(now - 86400 * 1.5, now) == "yesterday"
    assert age_text(now - 86400 * 3, now) == "3 days ago"
    assert age_text(now - 86400 * 30, now).count("-") == 2


def test_list_selection_rename_and_empty_state(qtbot):
    lst = ConversationList()
    qtbot.addWidget(lst)
    lst.show()
    assert lst.empty_label.isVisible() and lst.empty_label.text() == "No chats yet"
    selected = []
    lst.selected.connect(selected.append)
    lst.set_conversations([conv(3, "c"), conv(2, "b", 100), conv(1, "a", 1e6)], current_id=2)
    assert selected == []                                   # filling the list selects silently
    assert lst.ids() == [3, 2, 1] and lst.current_id() == 2 and not lst.empty_label.isVisible()
    lst.list.setCurrentRow(0)
    assert selected == [3]
    renamed = []
    lst.renameRequested.connect(lambda i, t: renamed.append((i, t)))
    lst.list.item(2).setText("  new a  ")
    assert renamed == [(1, "new a")]
    lst.list.item(2).setText("   ")                          # an empty title is refused
    assert lst.list.item(2).text() == "new a" and renamed == [(1, "new a")]
    lst.search.setText("zzz")
    lst.set_conversations([], None)
    assert lst.empty_label.text() == "No chats match"


def test_search_is_debounced(qtbot):
    lst = ConversationList()
    qtbot.addWidget(lst)
    got = []
    lst.searchChanged.connect(got.append)
    for ch in "hello":
        qtbot.keyClicks(lst.search, ch)
    qtbot.waitUntil(lambda: got == ["hello"], timeout=2000)


def test_delete_key_and_f2(qtbot):
    lst = ConversationList()
    qtbot.addWidget(lst)
    lst.show()
    lst.set_conversations([conv(5, "x")], current_id=5)
    deleted = []
    lst.deleteRequested.connect(deleted.append)
    lst.list.setFocus()
    qtbot.keyClick(lst.list, Qt.Key.Key_Delete)
    assert deleted == [5]
    qtbot.keyClick(lst.list, Qt.Key.Key_F2)                  # F2 opens the inline title editor
    assert lst.list.state() == lst.list.State.EditingState


# ---------------------------------------------------------------- timing panel

@pytest.fixture
def panel(qtbot):
    p = TimingPanel(LIGHT)
    qtbot.addWidget(p)
    p.show()
    return p


KERNELS = [
    {"name": "gemv_qkvz", "launches_per_token": 18, "us_per_token": 60.0, "share": 0.25, "gb_s": 3000.0},
    {"name": "lm_head_sample", "launches_per_token": 1, "us_per_token": 120.0, "share": 0.5, "gb_s": 4100.0},
    {"name": "rms_norm", "launches_per_token": 49, "us_per_token": 60.0, "share": 0.25, "gb_s": None},
]


def test_timing_panel_plots_tok_s_and_summary(panel):
    panel.begin_generation()
    for n, tok_s in ((5, 100.0), (10, 120.0), (15, 0.0), (20, 130.0)):
        panel.add_stats({"new_tokens": n, "decode_tok_s": tok_s, "ttft_ms": 12.0,
                         "context_tokens": 40 + n, "max_context": 4096, "kernels": None})
    assert panel.xs == [5.0, 10.0, 20.0] and panel.ys == [100.0, 120.0, 130.0]   # no rate yet: no point
    xs, ys = panel.curve.getData()
    assert list(xs) == panel.xs and list(ys) == panel.ys
    assert "130.0" in panel.summary.text() and "60 / 4,096" in panel.summary.text()
    panel.begin_generation()
    assert panel.xs == [] and len(panel.curve.getData()[0] or []) == 0


def test_timing_panel_kernel_table_sorted_with_roofline(panel):
    panel.set_capabilities({"triton": True})
    assert not panel.note.isVisible() and panel.table.isVisible()
    panel.set_timings({"kernels": None, "roofline": {"gb_s": 4000.0}, "memory": {}})
    panel.add_stats({"new_tokens": 3, "decode_tok_s": 900.0, "kernels": KERNELS})
    t = panel.table
    assert t.rowCount() == 3
    assert t.item(0, 0).text() == "lm_head_sample"          # most time first
    assert [t.item(0, j).text() for j in range(1, 6)] == ["1", "120.0", "50.0%", "4,100", "102%"]
    assert t.item(2, 4).text() == "\u2013" and t.item(2, 5).text() == "\u2013"   # unknown bandwidth
    assert panel.bar_item is not None
    assert list(panel.bar_item.opts["width"]) == [120.0, 60.0, 60.0]


def test_timing_panel_reference_note_and_memory(panel):
    panel.set_capabilities({"triton": False})
    assert panel.note.isVisible() and "Triton" in panel.note.text()
    assert not panel.table.isVisible() and not panel.bars.isVisible()
    gib = 1024 ** 3
    panel.set_timings({"kernels": None, "roofline": None,
                       "memory": {"allocated_bytes": 2 * gib, "reserved_bytes": 3 * gib, "total_bytes": 141 * gib}})
    assert panel.memory.text() == "GPU memory: 2.00 GiB allocated, 3.00 GiB reserved of 141.0 GiB"
    panel.set_timings({"kernels": None, "roofline": None, "memory": {}})
    assert panel.memory.text() == ""


@pytest.mark.slow                      # 5,000 points: ~35 s on 2 cores
def test_timing_panel_theme_and_many_points(panel):
    panel.set_colors(DARK)
    assert panel.colors is DARK
    panel.begin_generation()
    for n in range(1, 5000):
        panel.add_stats({"new_tokens": n, "decode_tok_s": 100.0 + n % 7})
    assert len(panel.xs) <= 4000 and panel.xs == sorted(panel.xs)


def test_plan_range_text_names_the_range_and_its_tuned_kernels():
    assert plan_range_text(None) == "" and plan_range_text({"count": 1}) == ""
    short = {"index": 0, "count": 4, "start": 0, "below": 768, "tuned": ["gemv_attn_qkv_norm"]}
    assert plan_range_text(short) == ("Kernel plans for context positions 0\u2013767 (set 1 of 4): "
                                      "gemv_attn_qkv_norm tuned for this range.")
    middle = {"index": 2, "count": 4, "start": 1792, "below": 22528, "tuned": []}
    assert plan_range_text(middle) == ("Kernel plans for context positions 1,792\u201322,527 "
                                       "(set 3 of 4): the base plans.")
    last = {"index": 3, "count": 4, "start": 22528, "below": None,
            "tuned": ["attention_decode", "gemv_mlp_down"]}
    assert plan_range_text(last) == ("Kernel plans for context positions from 22,528 on (set 4 of "
                                     "4): attention_decode, gemv_mlp_down tuned for this range.")


def test_timing_panel_shows_the_running_plan_range(panel):
    panel.set_capabilities({"triton": True})
    info = {"kernels": None, "roofline": None, "memory": {},
            "plan_range": {"index": 1, "count": 4, "start": 768, "below": 1792,
                           "tuned": ["gemv_attn_qkv_norm"]}}
    panel.set_timings(info)
    assert panel.plan_range.isVisibleTo(panel) and "768\u20131,791" in panel.plan_range.text()
    assert "CUDA graph" in panel.plan_range.toolTip()
    panel.set_timings(dict(info, plan_range=None))          # the ranges switched off
    assert not panel.plan_range.isVisibleTo(panel) and panel.plan_range.text() == ""
    panel.set_timings(info)
    panel.set_capabilities({"triton": False})               # the reference engine: no plans
    assert not panel.plan_range.isVisibleTo(panel)
    panel.set_timings(info)
    assert not panel.plan_range.isVisibleTo(panel)


def test_memory_sizes_read_right_at_every_scale():
    assert format_bytes(2 * 1024 ** 3) == "2.00 GiB" and format_bytes(141 * 1024 ** 3) == "141.0 GiB"
    assert format_bytes(12.5 * 1024 ** 2) == "12.5 MiB" and format_bytes(640 * 1024) == "640.0 KiB"
    assert format_bytes(0) == "0 B"


def test_kernel_names_keep_their_width_in_a_narrow_panel(panel, qtbot):
    panel.resize(380, 700)
    panel.show()
    name = "gemv_gdn_in_proj_norm_conv"
    panel.set_kernels([{"name": name, "launches_per_token": 18, "us_per_token": 183.6, "share": 0.2,
                        "gb_s": 1653.0}])
    qtbot.waitUntil(lambda: panel.table.columnWidth(0) > 0)
    metrics = panel.table.fontMetrics()
    assert panel.table.columnWidth(0) >= metrics.horizontalAdvance(name)
    assert all(panel.table.horizontalHeaderItem(i).toolTip() for i in range(len(COLUMNS)))


DECODE_KERNELS = [   # the decode step's call sites, as the Triton backend reports them
    {"name": n, "launches_per_token": c, "us_per_token": us, "share": us / 1054.0, "gb_s": bw}
    for n, c, us, bw in (("gemv_mlp_gate_up_norm_silu", 24, 195.2, 1806.0),
                         ("gemv_gdn_in_proj_norm_conv", 18, 168.7, 1800.0),
                         ("gemv_mlp_down", 24, 163.7, 1077.0),
                         ("lm_head_norm_argmax", 1, 135.9, 3743.0),
                         ("gemv_gdn_out_proj_gatednorm", 18, 124.2, 609.0),
                         ("gdn_decode_core", 18, 91.9, 411.0),
                         ("attention_decode", 6, 68.4, 0.2),
                         ("gemv_attn_qkv_norm", 6, 44.3, 1421.0),
                         ("gemv_attn_o_proj", 6, 35.1, 717.0),
                         ("sample", 1, 10.0, 1.0), ("embedding_gather", 1, 4.7, 1.0))]


@pytest.mark.parametrize("with_rows", [False, True])
def test_panel_at_its_preferred_width_shows_every_column(panel, qtbot, with_rows):
    # before any timings the width is estimated from the longest decode kernel name; after,
    # from the table itself: either way the whole table fits, no sideways scrolling
    panel.set_timings({"kernels": None, "roofline": {"gb_s": 4100.0}, "memory": {}})
    before = panel.preferred_width()
    if with_rows:
        panel.set_kernels(DECODE_KERNELS)
    panel.resize(before, 800)
    qtbot.waitUntil(lambda: panel.width() == before)
    panel.resize(panel.preferred_width(), 800)
    t = panel.table
    qtbot.waitUntil(lambda: t.viewport().width() > 0)
    need = sum(t.columnWidth(i) for i in range(len(COLUMNS)))
    assert need <= t.viewport().width()
    qtbot.waitUntil(lambda: not t.horizontalScrollBar().isVisible(), timeout=3000)
    if with_rows:
        assert t.item(0, 5).text() == "44%"


def test_bar_labels_get_a_row_each(panel, qtbot):
    # pyqtgraph drops tick labels that overlap: the bar chart grows a row per kernel and its
    # axis fits the longest (elided) name
    panel.resize(480, 820)
    panel.set_kernels(DECODE_KERNELS[:3])        # a first, short table: the bars stay small
    qtbot.waitUntil(lambda: panel.bars.height() > 0)
    panel.set_kernels(DECODE_KERNELS)            # the table gives the chart its room
    fm = panel.bars.fontMetrics()
    n = len(DECODE_KERNELS)                      # 11 call sites: every one gets a bar
    assert panel.bars.minimumHeight() >= n * fm.height()
    qtbot.waitUntil(lambda: panel.bars.height() >= panel.bars.minimumHeight())
    assert panel.split.sizes()[2] >= panel.bars.minimumHeight()
    assert panel.bars.geometry().bottom() < panel.split.height()
    ticks = panel.bars.getAxis("left")._tickLevels[0]
    labels = [text for _, text in ticks]
    assert len(labels) == n and labels[0] == "gemv_mlp_gate_up_norm_s\u2026"
    assert "gdn_decode_core" in labels and all(len(x) <= 24 for x in labels)
    assert panel.bars.getAxis("left").width() >= max(fm.horizontalAdvance(x) for x in labels)


def test_final_stats_replace_the_last_live_point(panel):
    panel.begin_generation()
    panel.add_stats({"new_tokens": 10, "decode_tok_s": 100.0})
    panel.add_stats({"new_tokens": 20, "decode_tok_s": 120.0})
    panel.add_stats({"new_tokens": 20, "decode_tok_s": 90.0, "ttft_ms": 12})   # the final stats
    assert panel.xs == [10.0, 20.0] and panel.ys == [100.0, 90.0]
    assert "90.0" in panel.summary.text()


def test_tok_s_plot_starts_at_zero_and_marks_each_update(panel):
    panel.show()
    panel.begin_generation()
    panel.add_stats({"new_tokens": 96, "decode_tok_s": 2400.0})    # a short answer: one update
    (xmin, xmax), (ymin, ymax) = panel.plot.getViewBox().viewRange()
    assert ymin == 0.0 and ymax >= 2400.0 and xmin == 0.0 and xmax >= 96
    assert panel.curve.opts["symbol"] == "o"


def test_tok_s_axis_labels_stay_short_so_the_title_clears_them(panel, qtbot):
    """A fast (tiny) model's 15,000 tok/s printed as '15000' overlapped the axis title in the
    H200 screenshot: ticks are at most four characters, and the axis fits them and its title."""
    from tritonchat.app.timing_panel import rate_tick
    assert [rate_tick(v) for v in (0, 0.5, 2500, 9999, 10_000, 10_500, 15_000, 250_000)] == \
        ["0", "0.5", "2500", "9999", "10k", "10.5k", "15k", "250k"]
    panel.show()
    panel.begin_generation()
    panel.add_stats({"new_tokens": 96, "decode_tok_s": 14_155.1})
    axis = panel.plot.getAxis("left")
    spacing, values = axis.tickValues(0.0, 14_155.1 * 1.15, 120)[0]      # the labelled level
    ticks = axis.tickStrings(values, 1.0, spacing)
    assert ticks and all(len(t) <= 4 for t in ticks), ticks
    fm = panel.plot.fontMetrics()
    assert axis.width() >= max(fm.horizontalAdvance(t) for t in ticks) + fm.height()


def test_kernel_sum_says_how_the_kernels_add_up_against_the_loop():
    rows = [{"us_per_token": 700.0}, {"us_per_token": 300.0}, {"us_per_token": None}]
    assert kernel_sum_text([], 1000.0) == ""
    assert kernel_sum_text([{"us_per_token": 0.0}], 1000.0) == ""
    alone = kernel_sum_text(rows, None)
    assert "1,000 \u00b5s per token" in alone and "decode loop" not in alone
    # the graphed step overlaps its kernels: the loop is faster than their sum
    fast = kernel_sum_text(rows, 1600.0)
    assert "625 \u00b5s per token (1,600 tok/s)" in fast and "overlap" in fast
    # without the graph the host's launches make the loop slower than the sum
    slow = kernel_sum_text(rows, 250.0)
    assert "4,000 \u00b5s per token (250 tok/s)" in slow and "host" in slow
    even = kernel_sum_text(rows, 1010.0)
    assert "990 \u00b5s" in even and "overlap" not in even and "host" not in even


def test_timing_panel_kernel_sum_line_follows_kernels_and_rate(panel):
    panel.set_capabilities({"triton": True})
    assert not panel.kernel_sum.isVisibleTo(panel)
    panel.set_kernels(DECODE_KERNELS)
    total = sum(r["us_per_token"] for r in DECODE_KERNELS)
    assert panel.kernel_sum.isVisibleTo(panel)
    assert f"{total:,.0f} \u00b5s per token" in panel.kernel_sum.text()
    panel.add_stats({"new_tokens": 64, "decode_tok_s": 1680.0})
    assert "595 \u00b5s per token" in panel.kernel_sum.text() and "overlap" in panel.kernel_sum.text()
    panel.add_stats({"new_tokens": 65, "decode_tok_s": 0.0})     # no rate: the last one stays
    assert "595 \u00b5s per token" in panel.kernel_sum.text()
    panel.set_capabilities({"triton": False})                    # the reference engine: no kernels
    assert not panel.kernel_sum.isVisibleTo(panel) and panel.kernel_sum.text() == ""
