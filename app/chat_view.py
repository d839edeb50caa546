"""The chat area: message widgets in a scroll area, the thinking block, the welcome state.

Views only lay out and render; the main window decides what happens. Finished messages are
rendered once; the streaming message keeps its text in buffers and re-renders on a timer,
so the GUI does a bounded amount of work however fast tokens arrive.
"""
from __future__ import annotations

from . import refcount_guard  # noqa: F401  (first: PySide6 refcount bug on Python 3.11)

import time

from PySide6.QtCore import QSize, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication, QKeySequence, QTextOption
from PySide6.QtWidgets import (QFrame, QGridLayout, QHBoxLayout, QLabel, QPlainTextEdit,
                               QPushButton, QScrollArea, QSizePolicy, QTextBrowser, QToolButton,
                               QVBoxLayout, QWidget)

from .markdown import COPY_SCHEME, RenderStyle, render_markdown, render_plain
from .stats_text import stats_line as format_stats  # noqa: F401  (one formatter for every place)
from .stats_text import stats_tooltip

RENDER_INTERVAL_MS = 50          # the streaming message re-renders at most this often
# A re-render parses the whole answer again (~2 ms per 1,000 words), holding the GIL the engine
# thread needs between decode steps: the interval grows to RENDER_COST_FACTOR x the last
# render's cost (at most RENDER_MAX_INTERVAL_MS), so rendering stays ~1/8 of the GUI thread's
# time however long the answer gets. (Simulated decode loop next to a 10,000-word answer: 76% of
# its speed with a fixed 50 ms interval, ~100% with this.)
RENDER_COST_FACTOR = 8
RENDER_MAX_INTERVAL_MS = 1000
STICKY_PX = 24                   # "at the bottom" tolerance for auto-scroll



class RichText(QTextBrowser):
    """Read-only rich text that is exactly as tall as its content (the page scrolls, not it)."""

    copyCode = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.viewport().setAutoFillBackground(False)
        self.setStyleSheet("QTextBrowser { background: transparent; }")
        self.document().setDocumentMargin(2)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self.anchorClicked.connect(self._on_anchor)
        self._html = None
        self.preferred_width = 0          # 0: as wide as the layout gives

    def set_html(self, html: str) -> None:
        if html == self._html:
            return
        self._html = html
        # keep the user's selection-free scroll position: the outer page does the scrolling
        self.setHtml(html)
        self._fit()

    def _fit(self, *_):
        height = int(self.document().size().height() + 0.999) + self.frameWidth() * 2
        if height != self.height():
            self.setFixedHeight(max(height, 4))

    def resizeEvent(self, event):
        super().resizeEvent(event)
        self._fit()

    def wheelEvent(self, event):
        event.ignore()     # let the page scroll

    def _on_anchor(self, url: QUrl) -> None:
        if url.scheme() == COPY_SCHEME:
            try:
                self.copyCode.emit(int(url.path()))
            except ValueError:
                pass
        elif url.scheme() in ("http", "https", "mailto"):
            QDesktopServices.openUrl(url)

    def sizeHint(self) -> QSize:
        width = self.preferred_width if self.preferred_width else super().sizeHint().width()
        return QSize(width, self.height())

    def minimumSizeHint(self) -> QSize:
        return QSize(40, self.height())        # never forces the page wider: it wraps instead


def _action(text: str, tooltip: str, parent: QWidget) -> QToolButton:
    b = QToolButton(parent)
    b.setObjectName("MessageAction")
    b.setText(text)
    b.setToolTip(tooltip)
    b.setCursor(Qt.CursorShape.PointingHandCursor)
    b.setAutoRaise(True)
    return b


class ThinkingBlock(QWidget):
    """Collapsible thinking text: "Thinking..." while it streams, then "Thought for N s"."""

    def __init__(self, style: RenderStyle, parent: QWidget | None = None):
        super().__init__(parent)
        self._style = style
        self.toggle = QToolButton(self)
        self.toggle.setObjectName("ThinkingToggle")
        self.toggle.setCheckable(True)
        self.toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.toggle.setCursor(Qt.CursorShape.PointingHandCursor)
        self.toggle.setToolTip("Show or hide the model's reasoning")
        self.toggle.toggled.connect(self._on_toggled)
        self.box = QFrame(self)
        self.box.setObjectName("ThinkingBox")
        self.body = RichText(self.box)
        box_layout = QVBoxLayout(self.box)
        box_layout.setContentsMargins(12, 0, 0, 0)
        box_layout.addWidget(self.body)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 4)
        layout.setSpacing(2)
        layout.addWidget(self.toggle, 0, Qt.AlignmentFlag.AlignLeft)
        layout.addWidget(self.box)
        self.box.hide()
        self.user_toggled = False
        self._text = ""
        self._streaming = False
        self._started = time.monotonic()
        self._label = ""

    @property
    def expanded(self) -> bool:
        return self.toggle.isChecked()

    def set_expanded(self, on: bool, by_user: bool = False) -> None:
        if by_user:
            self.user_toggled = True
        self.toggle.blockSignals(True)
        self.toggle.setChecked(on)
        self.toggle.blockSignals(False)
        self._apply_expanded()

    def _on_toggled(self, on: bool) -> None:
        self.user_toggled = True
        self._apply_expanded()

    def _apply_expanded(self) -> None:
        on = self.toggle.isChecked()
        self.toggle.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)
        self.box.setVisible(on)
        if on:
            self._render()

    def set_text(self, text: str) -> None:
        self._text = text
        if self.expanded:
            self._render()

    def set_style(self, style: RenderStyle) -> None:
        self._style = style
        self.body._html = None
        if self.expanded:
            self._render()

    def _render(self) -> None:
        r = render_markdown(self._text.strip() or "\u2026", self._muted_style())
        self.body.set_html(f'<div style="color:{self._style.muted};">{r.html}</div>')

    def _muted_style(self) -> RenderStyle:
        st = RenderStyle(**{**self._style.__dict__})
        st.text = st.muted
        return st

    def set_streaming(self) -> None:
        self._streaming = True
        self._started = time.monotonic()
        self.label_text("Thinking\u2026")

    def set_done(self, seconds: float | None, stopped: bool = False) -> None:
        self._streaming = False
        if seconds is None:
            seconds = time.monotonic() - self._started
        if stopped and seconds < 0.05:
            self.label_text("Thinking stopped")
            return
        shown = f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.1f}"
        self.label_text(("Thought for " if not stopped else "Stopped after ") + f"{shown} s")

    def label_text(self, text: str) -> None:
        self._label = text
        self.toggle.setText(text)

    def text(self) -> str:
        return self._text

    def label(self) -> str:
        return self._label


class MessageWidget(QFrame):
    """One message: a right-aligned bubble for the user, full width for the assistant."""

    copyText = Signal(str)
    editSubmitted = Signal(int, str)           # message id, new text
    regenerateRequested = Signal(int)          # assistant message id
    variantRequested = Signal(int, int)        # message id, step (-1: the previous, +1: the next)

    def __init__(self, msg_id: int, role: str, style: RenderStyle, parent: QWidget | None = None):
        super().__init__(parent)
        self.msg_id = msg_id
        self.role = role
        self._style = style
        self.content = ""
        self.thinking = ""
        self.stats: dict | None = None
        self.code_blocks: list[str] = []
        self.streaming = False
        self._dirty = False
        self._editor: QFrame | None = None

        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 6, 0, 6)
        outer.setSpacing(2)
        self.role_label = QLabel("You" if role == "user" else "Qwen3.5" if role == "assistant" else "System", self)
        self.role_label.setObjectName("RoleLabel")
        self.body = RichText(self)
        self.body.copyCode.connect(self._copy_code)
        self.thinking_block: ThinkingBlock | None = None

        if role == "user":
            self.bubble = QFrame(self)
            self.bubble.setObjectName("UserBubble")
            bl = QVBoxLayout(self.bubble)
            bl.setContentsMargins(14, 8, 14, 8)
            bl.addWidget(self.body)
            row = QHBoxLayout()
            row.setContentsMargins(0, 0, 0, 0)
            row.addStretch(1)
            self.bubble.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
            row.addWidget(self.bubble, 0)
            self.role_label.setAlignment(Qt.AlignmentFlag.AlignRight)
            outer.addWidget(self.role_label)
            outer.addLayout(row)
            self._natural_width = 0
        else:
            self.bubble = None
            outer.addWidget(self.role_label)
            self.thinking_block = ThinkingBlock(style, self)
            self.thinking_block.hide()
            outer.addWidget(self.thinking_block)
            outer.addWidget(self.body)

        # the buttons in a row, and under an answer its stats line across the whole width (a
        # line beside the buttons would wrap into a tall narrow column when the panel is open)
        self.actions = QWidget(self)
        av = QVBoxLayout(self.actions)
        av.setContentsMargins(0, 0, 0, 0)
        av.setSpacing(0)
        al = QHBoxLayout()
        al.setContentsMargins(0, 0, 0, 0)
        al.setSpacing(2)
        av.addLayout(al)
        self.copy_button = _action("Copy", "Copy this message as markdown", self.actions)
        self.copy_button.clicked.connect(lambda: self.copyText.emit(self.content))
        self.edit_button = _action("Edit", "Edit this message and send it again", self.actions)
        self.edit_button.clicked.connect(self.begin_edit)
        self.regenerate_button = _action("Regenerate", "Answer this again", self.actions)
        self.regenerate_button.clicked.connect(lambda: self.regenerateRequested.emit(self.msg_id))
        # "‹ 1/2 ›": the other answers to the same prompt (regenerate) or the other prompts
        # in the same place (edit); hidden while there is only one
        self.variant = (1, 1)
        self.prev_button = _action("\u2039", "Show the previous version", self.actions)
        self.prev_button.clicked.connect(lambda: self.variantRequested.emit(self.msg_id, -1))
        self.variant_label = QLabel("1/1", self.actions)
        self.variant_label.setObjectName("MutedLabel")
        self.next_button = _action("\u203a", "Show the next version", self.actions)
        self.next_button.clicked.connect(lambda: self.variantRequested.emit(self.msg_id, +1))
        self.stats_label = QLabel(self.actions)
        self.stats_label.setObjectName("StatsLabel")
        self.stats_label.setWordWrap(True)       # wraps in a narrow window instead of widening it
        self.stats_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        nav = (self.prev_button, self.variant_label, self.next_button)
        if role == "user":
            al.addStretch(1)
            for b in nav:
                al.addWidget(b)
            al.addWidget(self.edit_button)
            al.addWidget(self.copy_button)
            self.regenerate_button.hide()
            self.stats_label.hide()
        else:
            for b in nav:
                al.addWidget(b)
            al.addWidget(self.copy_button)
            al.addWidget(self.regenerate_button)
            al.addStretch(1)
            self.edit_button.hide()
            av.addWidget(self.stats_label)
        outer.addWidget(self.actions)
        self.set_variant(1, 1)

    # ---------------------------------------------------------------- content
    def set_variant(self, index: int, count: int, enabled: bool = True) -> None:
        """Which version this is (1-based) of how many; the arrows step through them."""
        self.variant = (int(index), int(count))
        many = count > 1
        for b in (self.prev_button, self.variant_label, self.next_button):
            b.setVisible(many)
        self.variant_label.setText(f"{index}/{count}")
        self.prev_button.setEnabled(enabled and index > 1)
        self.next_button.setEnabled(enabled and index < count)

    def set_message(self, content: str, thinking: str = "", stats: dict | None = None,
                    thinking_seconds: float | None = None) -> None:
        """A finished message: render once."""
        self.content, self.thinking, self.stats = content, thinking, stats
        self.streaming = False
        if self.thinking_block is not None:
            self.thinking_block.setVisible(bool(thinking.strip()))
            self.thinking_block.set_text(thinking)
            if thinking.strip():
                secs = thinking_seconds if thinking_seconds is not None else (stats or {}).get("thinking_seconds")
                stopped = (stats or {}).get("stop_reason") in ("stopped", "error") and not content.strip()
                if secs is None:        # saved mid-stream (the app was closed or crashed)
                    self.thinking_block.label_text("Thoughts (interrupted)")
                else:
                    self.thinking_block.set_done(float(secs), stopped=stopped)
        self.stats_label.setText(format_stats(stats))
        self.stats_label.setToolTip(stats_tooltip(stats))
        self.render()
        self.actions.setVisible(True)

    def begin_stream(self, thinking_enabled: bool) -> None:
        self.streaming = True
        self.content = self.thinking = ""
        self.stats = None
        self.actions.setVisible(False)
        if self.thinking_block is not None and thinking_enabled:
            self.thinking_block.show()
            self.thinking_block.set_streaming()
            if not self.thinking_block.user_toggled:
                self.thinking_block.set_expanded(True)
        self.render()

    def append(self, thinking_delta: str, answer_delta: str) -> None:
        if thinking_delta:
            self.thinking += thinking_delta
            if self.thinking_block is not None and self.thinking_block.isHidden():
                self.thinking_block.show()
                self.thinking_block.set_streaming()
                if not self.thinking_block.user_toggled:
                    self.thinking_block.set_expanded(True)
        if answer_delta:
            if not self.content and self.thinking_block is not None and self.thinking_block._streaming:
                # the answer began: the thinking is over, fold it away unless the user chose
                self.thinking_block.set_done(None)
                if not self.thinking_block.user_toggled:
                    self.thinking_block.set_expanded(False)
            self.content += answer_delta
        self._dirty = True

    def flush_render(self) -> bool:
        if not self._dirty:
            return False
        self._dirty = False
        self.render()
        return True

    def render(self) -> None:
        if self.role == "user":
            self.code_blocks = []
            self.body.set_html(render_plain(self.content))
            # the bubble hugs short messages and wraps long ones at 80% of the column
            doc = self.body.document().clone()
            doc.setTextWidth(-1)
            self._natural_width = int(doc.idealWidth()) + 2
            self._fit_bubble()
            return
        if self.thinking_block is not None:
            self.thinking_block.set_text(self.thinking)
        text = self.content
        if self.streaming:
            text += " \u258d"                 # a caret while tokens arrive
        elif not text.strip():
            text = "*(no answer)*" if self.thinking.strip() else "*(empty answer)*"
        if not self.streaming and (self.stats or {}).get("stop_reason") == "interrupted":
            # cut off by a crash or a kill: say so where the answer ends
            text += "\n\n*(interrupted: the app closed before this answer ended)*"
        r = render_markdown(text, self._style)
        self.code_blocks = r.code_blocks
        self.body.set_html(r.html)
        if not self.streaming:
            self.body.setVisible(True)

    def _fit_bubble(self) -> None:
        """Preferred width = the text's natural width; at most 80% of the row. Only a maximum
        is set, so a narrower window still shrinks the bubble (and the text wraps)."""
        if self.bubble is None:
            return
        margins = self.bubble.layout().contentsMargins()
        self.body.preferred_width = self._natural_width
        self.body.updateGeometry()
        self.bubble.setMaximumWidth(min(max(120, int(self.width() * 0.8)),
                                        self._natural_width + margins.left() + margins.right()))

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit_bubble()

    def set_style(self, style: RenderStyle) -> None:
        self._style = style
        self.body._html = None
        if self.thinking_block is not None:
            self.thinking_block.set_style(style)
        self.render()

    def set_actions(self, *, can_edit: bool, can_regenerate: bool) -> None:
        if self.role == "user":
            self.edit_button.setVisible(True)
            self.edit_button.setEnabled(can_edit)
        else:
            self.regenerate_button.setVisible(can_regenerate)

    def _copy_code(self, index: int) -> None:
        if 0 <= index < len(self.code_blocks):
            self.copyText.emit(self.code_blocks[index])

    # ---------------------------------------------------------------- editing
    def begin_edit(self) -> None:
        if self.role != "user" or self._editor is not None:
            return
        editor = QFrame(self)
        editor.setObjectName("EditBox")
        el = QVBoxLayout(editor)
        el.setContentsMargins(10, 8, 10, 8)
        self.edit_box = QPlainTextEdit(editor)
        self.edit_box.setPlainText(self.content)
        self.edit_box.setFrameShape(QFrame.Shape.NoFrame)
        self.edit_box.setMinimumHeight(70)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        cancel = QPushButton("Cancel", editor)
        cancel.setShortcut(QKeySequence(Qt.Key.Key_Escape))
        send = QPushButton("Send", editor)
        send.setObjectName("PrimaryButton")
        send.setToolTip("Send the edited message; the answers after it are replaced (Ctrl+Enter)")
        send.setShortcut(QKeySequence("Ctrl+Return"))
        cancel.clicked.connect(self.cancel_edit)
        send.clicked.connect(self.submit_edit)
        buttons.addWidget(cancel)
        buttons.addWidget(send)
        el.addWidget(self.edit_box)
        el.addLayout(buttons)
        self._editor = editor
        self.bubble.hide()
        self.actions.hide()
        self.layout().insertWidget(2, editor)
        self.edit_box.setFocus()

    def submit_edit(self) -> None:
        if self._editor is None:
            return
        text = self.edit_box.toPlainText()
        if not text.strip():
            return
        self.cancel_edit()
        self.editSubmitted.emit(self.msg_id, text)

    def cancel_edit(self) -> None:
        if self._editor is None:
            return
        self._editor.hide()
        self._editor.deleteLater()
        self._editor = None
        self.bubble.show()
        self.actions.show()

    @property
    def editing(self) -> bool:
        return self._editor is not None


class WelcomeWidget(QWidget):
    """What an empty chat shows: what this is and a few prompts to start from."""

    suggestionChosen = Signal(str)

    SUGGESTIONS = (   # (title, subtitle, the prompt it fills in)
        ("Explain", "how attention works",
         "Explain how self-attention in a transformer works, with a small numeric example."),
        ("Write code", "merge sorted lists",
         "Write a Python function that merges two sorted lists, with a few tests."),
        ("Compare", "SQLite vs PostgreSQL",
         "Compare SQLite and PostgreSQL for a small desktop app: what are the trade-offs?"),
        ("Brainstorm", "names for a chat app",
         "Give me five names for a small open-source desktop chat app, with one line on each."),
    )

    CARD_MAX_WIDTH = 260

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(40, 40, 40, 40)
        layout.addStretch(2)
        title = QLabel("What can I help with?", self)
        title.setObjectName("WelcomeTitle")
        title.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.subtitle = QLabel(self)
        self.subtitle.setObjectName("WelcomeText")
        self.subtitle.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.subtitle.setWordWrap(True)
        self.set_model_text("Qwen3.5-0.8B, running locally on hand-written Triton kernels.")
        layout.addWidget(title)
        layout.addSpacing(6)
        layout.addWidget(self.subtitle)
        layout.addSpacing(22)
        # the suggestions as two rows of two cards: the chat column stays narrow enough to
        # leave the window room for the timing panel
        cards = QWidget(self)
        cards.setMaximumWidth(2 * self.CARD_MAX_WIDTH + 10)
        grid = QGridLayout(cards)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setSpacing(10)
        self.buttons: list[QPushButton] = []
        for i, (head, sub, prompt) in enumerate(self.SUGGESTIONS):
            b = QPushButton(f"{head}\n{sub}", cards)
            b.setToolTip(prompt)
            b.setCursor(Qt.CursorShape.PointingHandCursor)
            b.setMinimumSize(150, 60)
            b.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
            b.setStyleSheet("text-align: left; padding: 8px 10px;")
            b.clicked.connect(lambda _=False, p=prompt: self.suggestionChosen.emit(p))
            grid.addWidget(b, i // 2, i % 2)
            self.buttons.append(b)
        row = QHBoxLayout()
        row.addStretch(1)
        row.addWidget(cards, 4)
        row.addStretch(1)
        layout.addLayout(row)
        layout.addStretch(3)

    def set_model_text(self, text: str) -> None:
        self.subtitle.setText(text)


class ChatView(QWidget):
    """Scrollable list of MessageWidgets, the welcome state when empty, smart auto-scroll."""

    editSubmitted = Signal(int, str)
    regenerateRequested = Signal(int)
    variantRequested = Signal(int, int)       # message id, step
    suggestionChosen = Signal(str)
    copied = Signal(str)

    def __init__(self, style: RenderStyle, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("ChatSurface")
        self._style = style
        self.scroll = QScrollArea(self)
        self.scroll.setObjectName("ChatScroll")
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.content = QWidget()
        self.content.setObjectName("ChatContent")
        # a readable column: messages never stretch wider than this, centred in wide windows
        self.column = QWidget(self.content)
        self.column.setMaximumWidth(860)
        self.column_layout = QVBoxLayout(self.column)
        self.column_layout.setContentsMargins(24, 16, 24, 16)
        self.column_layout.setSpacing(6)
        self.column_layout.addStretch(1)
        row = QHBoxLayout(self.content)
        row.setContentsMargins(0, 0, 0, 0)
        row.addStretch(0)
        row.addWidget(self.column, 1)
        row.addStretch(0)
        self.scroll.setWidget(self.content)
        self.welcome = WelcomeWidget(self)
        self.welcome.suggestionChosen.connect(self.suggestionChosen)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.scroll)
        layout.addWidget(self.welcome)
        self.messages: list[MessageWidget] = []
        self.streaming: MessageWidget | None = None
        self._busy = False

        bar = self.scroll.verticalScrollBar()
        self._stick = True
        bar.valueChanged.connect(self._on_scrolled)
        bar.rangeChanged.connect(self._on_range)
        self._timer = QTimer(self)
        self._timer.setInterval(RENDER_INTERVAL_MS)
        self._timer.timeout.connect(self._tick)
        self._update_empty()

    # ---------------------------------------------------------------- scrolling
    def _on_scrolled(self, value: int) -> None:
        bar = self.scroll.verticalScrollBar()
        self._stick = value >= bar.maximum() - STICKY_PX

    def _on_range(self, _min: int, maximum: int) -> None:
        if self._stick:
            self.scroll.verticalScrollBar().setValue(maximum)

    def at_bottom(self) -> bool:
        return self._stick

    def scroll_to_bottom(self) -> None:
        self._stick = True
        bar = self.scroll.verticalScrollBar()
        bar.setValue(bar.maximum())

    # ---------------------------------------------------------------- messages
    def clear(self) -> None:
        self._timer.stop()
        for w in self.messages:
            w.hide()
            w.deleteLater()
        self.messages = []
        self.streaming = None
        self._update_empty()

    def set_messages(self, messages) -> None:
        """Show a stored conversation (store.Message list); renders each once."""
        self.clear()
        for m in messages:
            if m.role == "system":
                continue
            w = self._add(m.id, m.role)
            w.set_message(m.content, m.thinking, m.stats)
            w.set_variant(getattr(m, "variant", 1), getattr(m, "variants", 1))
        self._refresh_actions()
        self.scroll_to_bottom()

    def add_message(self, msg_id: int, role: str, content: str, thinking: str = "",
                    stats: dict | None = None, variant: tuple[int, int] = (1, 1)) -> MessageWidget:
        w = self._add(msg_id, role)
        w.set_message(content, thinking, stats)
        w.set_variant(*variant)
        self._refresh_actions()
        self.scroll_to_bottom()
        return w

    def begin_stream(self, msg_id: int, thinking_enabled: bool,
                     variant: tuple[int, int] = (1, 1)) -> MessageWidget:
        w = self._add(msg_id, "assistant")
        w.begin_stream(thinking_enabled)
        w.set_variant(*variant)
        self.streaming = w
        self._timer.setInterval(RENDER_INTERVAL_MS)
        self._timer.start()
        self.scroll_to_bottom()
        return w

    def attach_stream(self, msg_id: int, thinking: str, content: str, thinking_enabled: bool) -> MessageWidget | None:
        """Re-attach a generation that kept running while another chat was shown."""
        w = self.widget_for(msg_id)
        if w is None:
            return None
        w.begin_stream(thinking_enabled)
        w.append(thinking, content)
        w.flush_render()
        self.streaming = w
        self._timer.setInterval(RENDER_INTERVAL_MS)
        self._timer.start()
        return w

    def append_stream(self, thinking_delta: str, answer_delta: str) -> None:
        if self.streaming is not None:
            self.streaming.append(thinking_delta, answer_delta)

    def finish_stream(self, content: str, thinking: str, thinking_seconds: float | None,
                      stats: dict | None) -> None:
        w = self.streaming
        self._timer.stop()
        self.streaming = None
        if w is not None:
            w.set_message(content, thinking, stats, thinking_seconds)
        self._refresh_actions()

    def _tick(self) -> None:
        if self.streaming is not None:
            t0 = time.perf_counter()
            if self.streaming.flush_render():
                cost_ms = (time.perf_counter() - t0) * 1e3
                self._timer.setInterval(int(min(RENDER_MAX_INTERVAL_MS,
                                                max(RENDER_INTERVAL_MS, RENDER_COST_FACTOR * cost_ms))))

    def remove_from(self, msg_id: int) -> None:
        """Drop the widget of msg_id and every later one."""
        keep = []
        for w in self.messages:
            if keep is not None and w.msg_id == msg_id:
                keep, dropped = None, [w]
                continue
            if keep is None:
                dropped.append(w)
            else:
                keep.append(w)
        if keep is None:
            for w in dropped:
                if w is self.streaming:
                    self.streaming = None
                    self._timer.stop()
                w.hide()
                w.deleteLater()
            self.messages = [w for w in self.messages if w not in dropped]
        self._refresh_actions()
        self._update_empty()

    def widget_for(self, msg_id: int) -> MessageWidget | None:
        for w in self.messages:
            if w.msg_id == msg_id:
                return w
        return None

    def last_answer(self) -> str | None:
        for w in reversed(self.messages):
            if w.role == "assistant" and not w.streaming:
                return w.content
        return None

    def set_busy(self, busy: bool) -> None:
        self._busy = busy
        self._refresh_actions()

    def set_style(self, style: RenderStyle) -> None:
        self._style = style
        for w in self.messages:
            w._style = style
            w.set_style(style)

    def _add(self, msg_id: int, role: str) -> MessageWidget:
        w = MessageWidget(msg_id, role, self._style, self.column)
        w.copyText.connect(self._copy)
        w.editSubmitted.connect(self.editSubmitted)
        w.regenerateRequested.connect(self.regenerateRequested)
        w.variantRequested.connect(self.variantRequested)
        self.column_layout.insertWidget(self.column_layout.count() - 1, w)
        w.show()          # at once: the layout would only show it from the event loop
        self.messages.append(w)
        self._update_empty()
        return w

    def _refresh_actions(self) -> None:
        last_assistant = next((w for w in reversed(self.messages) if w.role == "assistant"), None)
        for w in self.messages:
            w.set_actions(can_edit=not self._busy,
                          can_regenerate=(w is last_assistant and not self._busy and not w.streaming))
            w.set_variant(*w.variant, enabled=not self._busy)   # no switching under a stream

    def _copy(self, text: str) -> None:
        QGuiApplication.clipboard().setText(text)
        self.copied.emit(text)

    def _update_empty(self) -> None:
        empty = not self.messages
        self.welcome.setVisible(empty)
        self.scroll.setVisible(not empty)
