"""The message box under the chat: Enter sends, Shift+Enter breaks the line, Esc stops.

It also carries the Send/Stop button and the context meter (tokens used / context length).
"""
from __future__ import annotations

from . import refcount_guard  # noqa: F401  (first: PySide6 refcount bug on Python 3.11)

from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QProgressBar,
                               QPushButton, QSizePolicy, QVBoxLayout, QWidget)

MAX_LINES = 10


class InputBox(QPlainTextEdit):
    submit = Signal()
    stop = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("InputBox")
        self.setPlaceholderText("Message Qwen3.5\u2026")
        self.setTabChangesFocus(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.document().contentsChanged.connect(self._fit)
        self._fit()

    def keyPressEvent(self, e: QKeyEvent) -> None:
        if e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            mods = e.modifiers()
            if mods & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")         # newline, never a paragraph break
                return
            if not mods & (Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.AltModifier):
                self.submit.emit()
                return
        if e.key() == Qt.Key.Key_Escape:
            self.stop.emit()
            return
        super().keyPressEvent(e)

    def _fit(self) -> None:
        """Grow with the text up to MAX_LINES lines, then scroll."""
        line = self.fontMetrics().lineSpacing()
        lines = max(1, min(MAX_LINES, int(self.document().size().height())))
        margins = self.contentsMargins()
        doc_margin = self.document().documentMargin()
        self.setFixedHeight(int(lines * line + 2 * doc_margin + margins.top() + margins.bottom()) + 2)


class ElidedLabel(QLabel):
    """A one-line label that ends in an ellipsis when it does not fit (never cut mid-letter);
    the whole text stays in its tooltip."""

    def __init__(self, text: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.setText(text)

    def setText(self, text: str) -> None:       # noqa: N802  (QLabel's name: callers set the whole text)
        self.full_text = text
        self.setToolTip(text)
        self._elide()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._elide()

    def changeEvent(self, event) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.FontChange, QEvent.Type.StyleChange):
            self._elide()                       # a style sheet's font arrives after construction

    def _elide(self) -> None:
        super().setText(self.fontMetrics().elidedText(self.full_text, Qt.TextElideMode.ElideRight,
                                                      max(0, self.width())))


class ChatInput(QWidget):
    """Input frame + Send/Stop + hint + context meter."""

    sendRequested = Signal(str)
    stopRequested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.frame = QFrame(self)
        self.frame.setObjectName("InputFrame")
        self.box = InputBox(self.frame)
        self.send_button = QPushButton("Send", self.frame)
        self.send_button.setObjectName("PrimaryButton")
        self.send_button.setToolTip("Send (Enter)")
        self.send_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.stop_button = QPushButton("Stop", self.frame)
        self.stop_button.setObjectName("StopButton")
        self.stop_button.setToolTip("Stop generating (Esc)")
        self.stop_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.stop_button.hide()
        fl = QHBoxLayout(self.frame)
        fl.setContentsMargins(12, 8, 8, 8)
        fl.setSpacing(8)
        fl.addWidget(self.box, 1)
        fl.addWidget(self.send_button, 0, Qt.AlignmentFlag.AlignBottom)
        fl.addWidget(self.stop_button, 0, Qt.AlignmentFlag.AlignBottom)

        self.hint = ElidedLabel("Enter to send \u00b7 Shift+Enter for a new line \u00b7 Esc to stop",
                                self)
        self.hint.setObjectName("MutedLabel")
        self.meter = QProgressBar(self)
        self.meter.setObjectName("ContextMeter")
        self.meter.setTextVisible(False)
        self.meter.setFixedWidth(120)
        self.meter.setFixedHeight(8)
        self.meter.setRange(0, 1)
        self.meter.setValue(0)
        self.meter_label = QLabel(self)
        self.meter_label.setObjectName("MutedLabel")
        self.meter.setToolTip("Context used: the conversation's tokens / the context length")
        self.meter_label.setToolTip(self.meter.toolTip())
        foot = QHBoxLayout()
        foot.setContentsMargins(6, 0, 6, 0)
        foot.addWidget(self.hint, 1)
        foot.addSpacing(12)
        foot.addWidget(self.meter_label)
        foot.addWidget(self.meter, 0, Qt.AlignmentFlag.AlignVCenter)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(24, 6, 24, 12)
        layout.setSpacing(4)
        layout.addWidget(self.frame)
        layout.addLayout(foot)

        self.box.submit.connect(self._submit)
        self.send_button.clicked.connect(self._submit)
        self.box.stop.connect(self.stopRequested)
        self.stop_button.clicked.connect(self.stopRequested)
        self.generating = False
        self.ready = True
        self.context_used, self.context_total, self.context_exact = 0, 1, True
        self.over_context = False
        self._update_buttons()
        self.box.textChanged.connect(self._update_buttons)

    def _submit(self) -> None:
        text = self.box.toPlainText()
        if self.generating or not self.ready or not text.strip():
            return
        self.sendRequested.emit(text)

    def text(self) -> str:
        return self.box.toPlainText()

    def set_text(self, text: str) -> None:
        self.box.setPlainText(text)
        cursor = self.box.textCursor()
        cursor.movePosition(cursor.MoveOperation.End)
        self.box.setTextCursor(cursor)

    def insert_text(self, text: str) -> None:
        """Add text without losing what is typed: into an empty box as is, else after the
        draft on a new paragraph, as one edit (Ctrl+Z takes it back out)."""
        cursor = self.box.textCursor()
        cursor.movePosition(cursor.MoveOperation.End)
        current = self.box.toPlainText()
        if current.strip():
            text = ("" if current.endswith("\n\n") else "\n" if current.endswith("\n") else "\n\n") + text
        cursor.insertText(text)
        self.box.setTextCursor(cursor)

    def clear(self) -> None:
        self.box.clear()

    def restore(self, text: str) -> None:
        """Put back the text of a send that failed; keep anything typed since."""
        current = self.box.toPlainText()
        if current.strip() and current != text:
            self.set_text(text + "\n\n" + current)
        else:
            self.set_text(text)

    def set_generating(self, on: bool) -> None:
        self.generating = on
        self.send_button.setVisible(not on)
        self.stop_button.setVisible(on)
        self._update_buttons()

    def set_ready(self, ready: bool, why: str = "") -> None:
        """ready=False while the model loads: typing is fine, sending waits."""
        self.ready = ready
        self.send_button.setToolTip("Send (Enter)" if ready else why)
        self._update_buttons()

    def _update_buttons(self) -> None:
        self.send_button.setEnabled(self.ready and bool(self.box.toPlainText().strip()))

    def set_context(self, used: int, total: int, exact: bool = True) -> None:
        """The conversation and the draft, in tokens; `exact` False: an estimate (shown "~")
        until the tokenizer has counted."""
        total = max(1, int(total))
        used = max(0, int(used))
        self.meter.setRange(0, total)
        self.meter.setValue(min(used, total))
        share = used / total
        self.context_used, self.context_total, self.context_exact = used, total, exact
        self.over_context = used >= total
        self.meter_label.setText(f"{'' if exact else '~'}{used:,} / {total:,} tokens")
        self.meter_label.setProperty("warning", self.over_context)
        self.meter_label.setStyleSheet("color: #c0392b; font-weight: 600;" if self.over_context else "")
        if self.over_context:
            warn = "  (too long to send: shorten the message, start a new chat or raise the context length)"
        elif share > 0.9:
            warn = "  (almost full: start a new chat or raise the context length)"
        else:
            warn = ""
        self.meter.setToolTip(f"Context used, with the message being typed: {used:,} of {total:,} "
                              f"tokens ({share:.0%}){'' if exact else ', estimated'}{warn}")
        self.meter_label.setToolTip(self.meter.toolTip())
