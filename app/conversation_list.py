"""The sidebar: New chat, search, and the list of conversations (newest first)."""
from __future__ import annotations

from . import refcount_guard  # noqa: F401  (first: PySide6 refcount bug on Python 3.11)

import time

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QLabel, QLineEdit, QListWidget, QListWidgetItem, QMenu,
                               QPushButton, QVBoxLayout, QWidget)

ID_ROLE = Qt.ItemDataRole.UserRole


def age_text(ts: float, now: float | None = None) -> str:
    """'just now', '5 min ago', 'yesterday', '3 days ago', or the date."""
    now = time.time() if now is None else now
    d = max(0.0, now - ts)
    if d < 60:
        return "just now"
    if d < 3600:
        return f"{int(d // 60)} min ago"
    if d < 86400:
        return f"{int(d // 3600)} h ago"
    if d < 2 * 86400:
        return "yesterday"
    if d < 7 * 86400:
        return f"{int(d // 86400)} days ago"
    return time.strftime("%Y-%m-%d", time.localtime(ts))


class _ListWidget(QListWidget):
    deletePressed = Signal()

    def keyPressEvent(self, event) -> None:
        if event.key() == Qt.Key.Key_Delete and self.state() != QListWidget.State.EditingState:
            self.deletePressed.emit()
            return
        super().keyPressEvent(event)


class ConversationList(QWidget):
    """Emits what the user asked for; the main window does it (and refreshes this list)."""

    newRequested = Signal()
    selected = Signal(int)                 # conversation id
    renameRequested = Signal(int, str)     # id, new title
    deleteRequested = Signal(int)
    exportRequested = Signal(int, str)     # id, "markdown" | "json"
    searchChanged = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("Sidebar")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        self.new_button = QPushButton("+  New chat", self)
        self.new_button.setObjectName("NewChatButton")
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.new_button.clicked.connect(self.newRequested)
        self.search = QLineEdit(self)
        self.search.setObjectName("SearchBox")
        self.search.setPlaceholderText("Search chats")
        self.search.setClearButtonEnabled(True)
        self.search.setToolTip("Find conversations by title or message text (Ctrl+F)")
        # debounce: one query per pause in typing, not one per key
        self._search_timer = QTimer(self)
        self._search_timer.setSingleShot(True)
        self._search_timer.setInterval(200)
        self._search_timer.timeout.connect(lambda: self.searchChanged.emit(self.search.text()))
        self.search.textChanged.connect(lambda _: self._search_timer.start())
        self.list = _ListWidget(self)
        self.list.setObjectName("ConversationList")
        self.list.setUniformItemSizes(True)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.currentItemChanged.connect(self._on_current)
        self.list.itemChanged.connect(self._on_item_changed)
        self.list.setToolTip("Right-click a chat to rename, export or delete it; F2 renames")
        self.empty_label = QLabel("No chats yet", self)
        self.empty_label.setObjectName("MutedLabel")
        self.empty_label.setAlignment(Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignTop)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 12, 10, 10)
        layout.setSpacing(8)
        layout.addWidget(self.new_button)
        layout.addWidget(self.search)
        layout.addWidget(self.list, 1)
        layout.addWidget(self.empty_label, 1)
        self._titles: dict[int, str] = {}
        self._updating = False

        # F2 renames (the list's own edit key); Delete asks to delete the current chat
        self.list.deletePressed.connect(
            lambda: self.current_id() is not None and self.deleteRequested.emit(self.current_id()))

    def set_conversations(self, conversations, current_id: int | None) -> None:
        """Fill the list from store.Conversation rows without emitting `selected`."""
        self._updating = True
        try:
            self.list.clear()
            self._titles = {}
            now = time.time()
            for c in conversations:
                item = QListWidgetItem(c.title)
                item.setData(ID_ROLE, c.id)
                item.setToolTip(f"{c.title}\nLast message {age_text(c.updated_at, now)}")
                item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
                self.list.addItem(item)
                self._titles[c.id] = c.title
                if c.id == current_id:
                    self.list.setCurrentItem(item)
            if current_id is None:
                self.list.setCurrentRow(-1)
                self.list.clearSelection()
        finally:
            self._updating = False
        searching = bool(self.search.text().strip())
        self.empty_label.setText("No chats match" if searching else "No chats yet")
        empty = self.list.count() == 0
        self.empty_label.setVisible(empty)
        self.list.setVisible(not empty)

    def ids(self) -> list[int]:
        return [self.list.item(i).data(ID_ROLE) for i in range(self.list.count())]

    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return item.data(ID_ROLE) if item is not None else None

    def select(self, conv_id: int | None) -> None:
        self._updating = True
        try:
            for i in range(self.list.count()):
                if self.list.item(i).data(ID_ROLE) == conv_id:
                    self.list.setCurrentRow(i)
                    return
            self.list.setCurrentRow(-1)
            self.list.clearSelection()
        finally:
            self._updating = False

    def rename_current(self) -> None:
        item = self.list.currentItem()
        if item is not None:
            self.list.editItem(item)

    def _on_current(self, item: QListWidgetItem | None, _prev) -> None:
        if not self._updating and item is not None:
            self.selected.emit(item.data(ID_ROLE))

    def _on_item_changed(self, item: QListWidgetItem) -> None:
        if self._updating:
            return
        conv_id = item.data(ID_ROLE)
        title = item.text().strip()
        if title and title != self._titles.get(conv_id):
            self._titles[conv_id] = title
            self.renameRequested.emit(conv_id, title)
        elif not title:
            self._updating = True
            item.setText(self._titles.get(conv_id, ""))
            self._updating = False

    def _menu(self, pos) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        conv_id = item.data(ID_ROLE)
        menu = QMenu(self)
        menu.addAction("Rename", lambda: self.list.editItem(item))
        menu.addAction("Export as Markdown\u2026", lambda: self.exportRequested.emit(conv_id, "markdown"))
        menu.addAction("Export as JSON\u2026", lambda: self.exportRequested.emit(conv_id, "json"))
        menu.addSeparator()
        menu.addAction("Delete\u2026", lambda: self.deleteRequested.emit(conv_id))
        menu.exec(self.list.viewport().mapToGlobal(pos))
        menu.deleteLater()
