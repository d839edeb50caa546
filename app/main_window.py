"""The main window: lays out the views and wires them to the conversation controller.

Send / edit / regenerate / stop, variants and drafts live in the Qt-free
`conversation.ConversationController`; this window forwards the views' signals to it and shows
what it reports (`_ChatWiring`). Threads: the GUI thread owns the widgets and the ChatStore; the
engine thread (worker.py) owns the ChatSession.
"""
from __future__ import annotations

from . import refcount_guard  # noqa: F401  (first: PySide6 refcount bug on Python 3.11)

import json
import re
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QByteArray, QSettings, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QActionGroup, QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (QApplication, QFileDialog, QHBoxLayout, QLabel, QMainWindow,
                               QMessageBox, QProgressBar, QSplitter, QToolButton,
                               QVBoxLayout, QWidget)

from tritonchat.engine.options import SamplingParams

from . import theme
from .chat_input import ChatInput, ElidedLabel
from .chat_view import ChatView
from .conversation import ConversationController, ConversationListener
from .conversation_list import ConversationList
from .errors import ErrorBanner, show_error
from .settings import ChatSettings, load_settings, remember_model, save_settings
from .settings_dialog import SettingsDialog
from .stats_text import engine_label
from .store import ChatStore, Message
from .timing_panel import TimingPanel
from .worker import EngineClient, SessionLoader

MIN_CHAT_WIDTH = 320             # what a user-dragged timing panel leaves the chat at least
CHAT_SHARE = 0.62               # the chat keeps at least this share of the width beside the timing panel
NEW_CHAT_TITLE = "New chat"
DRAFT_IDLE_MS = 400              # after typing stops: save the draft, count its tokens
STAGES = {"weights": "Loading weights", "kernels": "Compiling Triton kernels",
          "graph": "Capturing the CUDA graph"}
CPU_BANNER = "Running the reference engine on the CPU: slow."
TINY_BANNER = ("This is a tiny model with random weights (tritonchat --demo / make-tiny): its "
               "answers are random text.")
DEFAULT_MODEL = "Qwen/Qwen3.5-0.8B"


class MainWindow(QMainWindow):
    # after the window has handled the engine's report (tests and the screenshot wait on these)
    generationFinished = Signal(dict)       # the stored stats of a finished answer
    generationFailed = Signal(str, str)     # sentence, details
    modelLoaded = Signal(dict)
    modelLoadFailed = Signal(str, str)      # sentence, details

    # the conversation's state lives in the controller; these read and set it there
    settings = property(lambda self: self.conversation.settings,
                        lambda self, v: setattr(self.conversation, "settings", v))
    loaded = property(lambda self: self.conversation.loaded,
                      lambda self, v: setattr(self.conversation, "loaded", v))
    max_context = property(lambda self: self.conversation.max_context,
                           lambda self, v: setattr(self.conversation, "max_context", v))
    engine_options = property(lambda self: self.conversation.engine_options,
                              lambda self, v: setattr(self.conversation, "engine_options", v))
    conv_id = property(lambda self: self.conversation.conv_id)
    gen = property(lambda self: self.conversation.gen)

    def __init__(self, model: str, store: ChatStore, qsettings: QSettings, *,
                 loader: SessionLoader | None = None, engine_overrides: dict | None = None,
                 download: Callable[[str, QWidget], Path | None] | None = None):
        super().__init__()
        self.model = model
        self.store = store
        self.qs = qsettings
        self.engine_overrides = dict(engine_overrides or {})
        self._download = download or _download_with_dialog
        self.model_defaults = SamplingParams()
        self.capabilities: dict = {}
        self._engine_wanted: dict = {}
        self.model_dir: str | None = None
        self._closing = False
        self.engine = EngineClient(loader, self)
        self.conversation = ConversationController(store, self.engine, load_settings(qsettings, None),
                                                   _ChatWiring(self))

        app = QApplication.instance()
        self.colors = theme.apply_theme(app, self.settings.theme)
        self.setWindowTitle("tritonchat")
        self.resize(1180, 780)
        self.setMinimumSize(720, 480)

        # bound methods of this QObject, never lambdas: PySide runs a lambda connected to a
        # signal of another thread in *that* thread; a method of a QObject runs in its owner's
        w = self.engine.worker
        w.loadProgress.connect(self._on_load_progress)
        w.loaded.connect(self._on_loaded)
        w.loadFailed.connect(self._on_load_failed)
        w.fellBack.connect(self._on_fell_back)
        w.textDelta.connect(self._on_text)
        w.statsUpdate.connect(self._on_stats)
        w.finished.connect(self._on_finished)
        w.failed.connect(self._on_failed)
        w.configured.connect(self._on_configured)
        w.configureFailed.connect(self._on_configure_failed)
        w.fellBackMode.connect(self._on_mode_fell_back)
        w.timings.connect(self._on_timings)
        w.tokenCount.connect(self._on_token_count)

        self._build_ui()
        self._build_menus()
        self.conversation.recover()             # answers a crash cut off: marked, or gone if empty
        # "system" follows the desktop when it switches between light and dark
        QGuiApplication.styleHints().colorSchemeChanged.connect(self._on_system_scheme)
        self._restore_ui()
        self.refresh_conversations()
        last = self.qs.value("ui/last_conversation")
        try:
            last_id = int(last) if last not in (None, "") else None
        except (TypeError, ValueError):
            last_id = None
        if last_id is not None and last_id in self.sidebar.ids():
            self.open_conversation(last_id)
        else:
            self.new_chat()

    # ================================================================== UI
    def _build_ui(self) -> None:
        style = theme.render_style(self.colors)
        self.sidebar = ConversationList(self)
        self.sidebar.setMinimumWidth(200)
        self.sidebar.newRequested.connect(self.new_chat)
        self.sidebar.selected.connect(self.open_conversation)
        self.sidebar.renameRequested.connect(self.rename_conversation)
        self.sidebar.deleteRequested.connect(self.delete_conversation)
        self.sidebar.exportRequested.connect(self.export_conversation)
        self.sidebar.searchChanged.connect(lambda _t: self.refresh_conversations())

        self.banner = ErrorBanner(self)
        self._banner_error_style = self.banner.styleSheet()
        self._banner_warning = False
        # a long title ends in an ellipsis before the buttons (was cut mid-word in a narrow window)
        self.header_title = ElidedLabel(NEW_CHAT_TITLE, self)
        self.header_title.setStyleSheet("font-size: 12pt; font-weight: 600;")
        self.timing_button = QToolButton(self)
        self.timing_button.setText("Timing")
        self.timing_button.setCheckable(True)
        self.timing_button.setToolTip("Show the timing panel: live tokens/s and GPU time per kernel (Ctrl+T)")
        self.settings_button = QToolButton(self)
        self.settings_button.setText("Settings")
        self.settings_button.setToolTip("Sampling, system prompt, context length, engine switches (Ctrl+,)")
        self.settings_button.clicked.connect(self.open_settings)
        header = QHBoxLayout()
        header.setContentsMargins(24, 10, 16, 6)
        header.addWidget(self.header_title, 1)
        header.addWidget(self.timing_button)
        header.addWidget(self.settings_button)

        self.chat = ChatView(style, self)
        self.chat.editSubmitted.connect(self.edit_and_resend)
        self.chat.regenerateRequested.connect(self.regenerate)
        self.chat.variantRequested.connect(self.conversation.select_variant)
        self.chat.suggestionChosen.connect(self._use_suggestion)
        self.chat.copied.connect(lambda _t: self.statusBar().showMessage("Copied to the clipboard", 2000))
        self.input = ChatInput(self)
        self.input.sendRequested.connect(self.send)
        self.input.stopRequested.connect(self.stop)
        self.input.set_ready(False, "The model is loading")
        # the draft: kept per conversation at once, saved and counted once typing pauses
        self._draft_timer = QTimer(self)
        self._draft_timer.setSingleShot(True)
        self._draft_timer.setInterval(DRAFT_IDLE_MS)
        self._draft_timer.timeout.connect(self._draft_idle)
        self._showing_draft = False
        self.input.box.textChanged.connect(self._on_draft_changed)

        main = QWidget(self)
        main.setObjectName("ChatSurface")
        main.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        ml = QVBoxLayout(main)
        ml.setContentsMargins(0, 0, 0, 0)
        ml.setSpacing(0)
        banner_row = QHBoxLayout()
        banner_row.setContentsMargins(16, 8, 16, 0)
        banner_row.addWidget(self.banner)
        ml.addLayout(banner_row)
        ml.addLayout(header)
        ml.addWidget(self.chat, 1)
        ml.addWidget(self.input)

        self.timing = TimingPanel(self.colors, self)
        # sidebar | chat | timing panel: the user drags the handles, the panel collapses to the
        # right edge (then it reads as closed), and the sizes are kept in ui/splitter
        self.splitter = QSplitter(Qt.Orientation.Horizontal, self)
        self.splitter.addWidget(self.sidebar)
        self.splitter.addWidget(main)
        self.splitter.addWidget(self.timing)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setStretchFactor(2, 0)
        self.splitter.setSizes([260, 920, 0])
        self.splitter.setChildrenCollapsible(False)
        for i, collapsible in enumerate((False, False, True)):
            self.splitter.setCollapsible(i, collapsible)
        self.splitter.splitterMoved.connect(self._on_splitter_moved)
        self.setCentralWidget(self.splitter)

        self.timing.hide()
        toggle = self.timing.toggleViewAction()
        toggle.setText("Timing panel")
        toggle.setShortcut(QKeySequence("Ctrl+T"))
        toggle.toggled.connect(self._on_timing_toggled)
        toggle.toggled.connect(self.timing_button.setChecked)
        self.timing_button.clicked.connect(lambda on: self.timing.setVisible(on))
        self._timing_sent: bool | None = None
        self._timing_width: int | None = None    # the user's width for the panel, once dragged

        self.engine_label = QLabel("Starting\u2026", self)
        self.engine_label.setObjectName("MutedLabel")
        self.load_bar = QProgressBar(self)
        self.load_bar.setRange(0, 1000)
        self.load_bar.setFixedWidth(180)
        self.load_bar.setTextVisible(False)
        self.load_bar.hide()
        self.statusBar().addWidget(self.engine_label, 1)
        self.statusBar().addPermanentWidget(self.load_bar)
        self.statusBar().setSizeGripEnabled(True)

        self.stop_shortcut = QShortcut(QKeySequence(Qt.Key.Key_Escape), self)
        self.stop_shortcut.setContext(Qt.ShortcutContext.WindowShortcut)
        self.stop_shortcut.activated.connect(self.stop)
        self.stop_shortcut.setEnabled(False)

    def _build_menus(self) -> None:
        bar = self.menuBar()
        file = bar.addMenu("&File")
        self.new_action = self._action(file, "&New chat", "Ctrl+N", self.new_chat)
        self.export_md_action = self._action(file, "Export as &Markdown\u2026", "Ctrl+E",
                                             lambda: self._export_current("markdown"))
        self.export_json_action = self._action(file, "Export as &JSON\u2026", "Ctrl+Shift+E",
                                               lambda: self._export_current("json"))
        self.delete_action = self._action(file, "&Delete chat\u2026", None,
                                          lambda: self.conv_id is not None and self.delete_conversation(self.conv_id))
        file.addSeparator()
        self.download_action = self._action(file, "&Download the model\u2026", None, self.start)
        self.download_action.setVisible(False)
        file.addSeparator()
        self._action(file, "&Quit", QKeySequence.StandardKey.Quit, self.close)

        edit = bar.addMenu("&Edit")
        self.copy_last_action = self._action(edit, "&Copy last answer", "Ctrl+Shift+C", self.copy_last_answer)
        self.regenerate_action = self._action(edit, "&Regenerate last answer", "Ctrl+R", self._regenerate_last)
        self.stop_action = self._action(edit, "&Stop generating", None, self.stop)
        edit.addSeparator()
        self.settings_action = self._action(edit, "&Settings\u2026", "Ctrl+,", self.open_settings)
        self.settings_action.setMenuRole(QAction.MenuRole.PreferencesRole)

        view = bar.addMenu("&View")
        view.addAction(self.timing.toggleViewAction())
        self._action(view, "&Find chats", "Ctrl+K", self._focus_search)
        themes = view.addMenu("&Theme")
        group = QActionGroup(self)
        self.theme_actions: dict[str, QAction] = {}
        for value, label in (("system", "Follow the &system"), ("light", "&Light"), ("dark", "&Dark")):
            a = themes.addAction(label)
            a.setCheckable(True)
            a.setChecked(value == self.settings.theme)
            a.triggered.connect(lambda _=False, v=value: self.set_theme(v))
            group.addAction(a)
            self.theme_actions[value] = a

        help_menu = bar.addMenu("&Help")
        self._action(help_menu, "&About tritonchat", None, self._about)

    def _action(self, menu, text: str, shortcut, slot) -> QAction:
        a = QAction(text, self)
        if shortcut is not None:
            a.setShortcut(QKeySequence(shortcut))
        a.triggered.connect(lambda _=False: slot())
        menu.addAction(a)
        return a

    def _restore_ui(self) -> None:
        geometry = self.qs.value("ui/geometry")
        if isinstance(geometry, (QByteArray, bytes)):
            self.restoreGeometry(QByteArray(geometry))
        sizes = self.qs.value("ui/splitter")
        if isinstance(sizes, (QByteArray, bytes)):
            self.splitter.restoreState(QByteArray(sizes))
            for i, collapsible in enumerate((False, False, True)):   # the state restores these too
                self.splitter.setCollapsible(i, collapsible)
            self.timing.hide()                   # the panel opens when asked (Ctrl+T)
        try:
            width = int(self.qs.value("ui/timing_width") or 0)
        except (TypeError, ValueError):
            width = 0
        self._timing_width = width if width >= self.timing.minimumWidth() else None

    # ================================================================== model loading
    def start(self) -> None:
        """Find the model (download it on first launch), then load it on the engine thread."""
        from tritonchat.engine.hub import is_local_dir, local_model_dir

        self.download_action.setVisible(False)
        if is_local_dir(self.model):
            model_dir = Path(self.model).expanduser()
        else:
            model_dir = local_model_dir(self.model)
            if model_dir is None:
                model_dir = self._download(self.model, self)
                if model_dir is not None and not _in_hub_cache(model_dir):
                    # "Use a folder on disk...": the next launch opens it, Settings shows it
                    remember_model(self.qs, str(model_dir))
                    self.settings.model = str(model_dir)
                    self.settings.recent_models = load_settings(self.qs, self.model_defaults).recent_models
                if model_dir is None:
                    self.show_banner(
                        f"The model {self.model} is not downloaded yet: use File \u2192 Download the "
                        "model to fetch it.", warning=True)
                    self.download_action.setVisible(True)
                    self.engine_label.setText("No model")
                    self.input.set_ready(False, "No model is loaded")
                    return
        self.load_model(str(model_dir))

    def _switch_model(self, model: str) -> None:
        """Open another model (chosen in Settings) in place of the running one."""
        self.model = model
        self.banner.clear()
        self.start()

    def load_model(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.loaded = False
        self.input.set_ready(False, "The model is loading")
        self.engine_label.setText("Loading the model\u2026")
        self.load_bar.setValue(0)
        self.load_bar.show()
        self._engine_wanted = {"max_context": self.settings.context_length, **self.settings.engine_settings()}
        settings = dict(self.engine_overrides)
        settings.update(self._engine_wanted, timing=self.timing.isVisible())
        self.engine.load(model_dir, settings)

    def _on_load_progress(self, stage: str, fraction: float) -> None:
        if self._closing:        # reports still queued when the window closed
            return
        self.load_bar.show()
        self.load_bar.setValue(int(max(0.0, min(1.0, fraction)) * 1000))
        text = f"{STAGES.get(stage, stage)}\u2026 {fraction:.0%}"
        self.engine_label.setText(text)
        self.chat.welcome.set_model_text(f"Loading the model: {text}")

    def _on_loaded(self, info: dict) -> None:
        if self._closing:        # reports still queued when the window closed
            return
        self.loaded = True
        self.load_bar.hide()
        self.engine_options = dict(info.get("options") or {})
        self.capabilities = dict(info.get("capabilities") or {})
        self._timing_sent = bool(self.engine_options.get("timing"))
        defaults = info.get("generation_defaults") or {}
        self.model_defaults = SamplingParams(**{k: v for k, v in defaults.items()
                                                if k in SamplingParams.__dataclass_fields__})
        self.settings = load_settings(self.qs, self.model_defaults)
        self.max_context = int(self.engine_options.get("max_context") or self.settings.context_length)
        self.timing.set_capabilities(self.capabilities)
        self.input.set_ready(True)
        self._update_engine_label()
        self.chat.welcome.set_model_text(self._welcome_text())
        from tritonchat.engine.tiny_model import is_tiny_model

        warnings = []
        if self.model_dir and is_tiny_model(self.model_dir):
            warnings.append(TINY_BANNER + ("" if self.capabilities.get("cuda") else " " + CPU_BANNER))
        elif not self.capabilities.get("cuda", False):
            warnings.append(CPU_BANNER)
        if self.capabilities.get("decode_mode_error"):     # persistent decode fell back at load
            warnings.append(self.capabilities["decode_mode_error"])
        if warnings:
            self.show_banner(" ".join(warnings), self.capabilities.get("reason", ""), warning=True)
        self._request_token_count()
        if self.timing.isVisible():
            self._on_timing_toggled(True)
        self.modelLoaded.emit(dict(info))

    def _on_load_failed(self, sentence: str, details: str, kind: str) -> None:
        if self._closing:        # reports still queued when the window closed
            return
        self.load_bar.hide()
        self.engine_label.setText("The model could not be loaded")
        self.input.set_ready(False, "No model is loaded")
        self.show_banner(sentence, details)
        show_error(self, sentence, details)
        self.modelLoadFailed.emit(sentence, details)

    def _on_fell_back(self, sentence: str, details: str) -> None:
        if self._closing:        # reports still queued when the window closed
            return
        self.show_banner(f"{sentence} The reference engine runs instead: slow.", details, warning=True)

    def _welcome_text(self) -> str:
        o, caps = self.engine_options, self.capabilities
        if o.get("backend") == "triton":
            where = f"on hand-written Triton kernels ({caps.get('device_name') or 'GPU'})"
        else:
            where = "on the PyTorch reference engine" + (" (CPU)" if o.get("device") == "cpu" else "")
        name = Path(self.model_dir).name if self.model_dir else "Qwen3.5"
        return f"{name}, running locally {where}. Your chats stay on this computer."

    def show_banner(self, text: str, details: str = "", warning: bool = False) -> None:
        """The bar above the chat: amber for a working-but-degraded state, red for errors."""
        self._banner_warning = warning
        if warning:
            c = self.colors
            self.banner.setStyleSheet(
                f"#ErrorBanner {{ background: {c.banner_bg}; border-radius: 6px; }}"
                f"#ErrorBanner QLabel {{ color: {c.banner_text}; }}"
                f"#ErrorBanner QToolButton {{ color: {c.banner_text}; border: none; font-weight: bold; padding: 0 6px; }}")
        else:
            self.banner.setStyleSheet(self._banner_error_style)
        self.banner.show_message(text, details)

    def _update_engine_label(self) -> None:
        name = Path(self.model_dir).name if self.model_dir else ""
        text = engine_label(self.engine_options, self.capabilities.get("device_name") or "", name)
        if text:
            self.engine_label.setText(text)

    # ================================================================== conversations
    def refresh_conversations(self) -> None:
        convs = self.store.list_conversations(self.sidebar.search.text().strip())
        self.sidebar.set_conversations(convs, self.conv_id)

    def new_chat(self) -> None:
        self.conversation.new_chat()
        self.input.box.setFocus()

    def open_conversation(self, conv_id: int) -> None:
        self.conversation.open(conv_id)

    def rename_conversation(self, conv_id: int, title: str) -> None:
        self.conversation.rename(conv_id, title)

    def delete_conversation(self, conv_id: int) -> None:
        try:
            title = self.store.get_conversation(conv_id).title
        except Exception:
            return
        if not self._confirm("Delete chat", f"Delete \u201c{title}\u201d? This cannot be undone."):
            return
        self.conversation.delete(conv_id)

    def export_conversation(self, conv_id: int, fmt: str) -> None:
        try:
            title = self.store.get_conversation(conv_id).title
        except Exception:
            return
        path = self._ask_save_path(title, fmt)
        if not path:
            return
        try:
            if fmt == "json":
                text = json.dumps(self.store.export_json(conv_id), indent=2, ensure_ascii=False) + "\n"
            else:
                text = self.store.export_markdown(conv_id)
            Path(path).write_text(text, encoding="utf-8")
        except OSError as exc:
            show_error(self, f"The chat could not be saved to {path}: {exc.strerror or exc}.", str(exc))
            return
        self.statusBar().showMessage(f"Exported to {path}", 4000)

    def _export_current(self, fmt: str) -> None:
        if self.conv_id is not None:
            self.export_conversation(self.conv_id, fmt)

    # ---- dialogs, separate so tests can answer them
    def _confirm(self, title: str, text: str) -> bool:
        answer = QMessageBox.question(self, title, text,
                                      QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel,
                                      QMessageBox.StandardButton.Cancel)
        return answer == QMessageBox.StandardButton.Yes

    def _ask_save_path(self, title: str, fmt: str) -> str | None:
        ext = "json" if fmt == "json" else "md"
        safe = re.sub(r"[^\w\- ]+", "", title).strip() or "chat"
        path, _ = QFileDialog.getSaveFileName(
            self, "Export chat", str(Path.home() / f"{safe}.{ext}"),
            "JSON (*.json)" if ext == "json" else "Markdown (*.md)")
        return path or None

    # ================================================================== sending
    def send(self, text: str) -> None:
        if self.conversation.send(text):
            self._draft_timer.stop()
            self._showing_draft = True          # clearing the box is not a new draft
            self.input.clear()
            self._showing_draft = False

    def edit_and_resend(self, user_msg_id: int, text: str) -> None:
        self.conversation.edit(user_msg_id, text)

    def regenerate(self, assistant_msg_id: int) -> None:
        self.conversation.regenerate(assistant_msg_id)

    def _regenerate_last(self) -> None:
        self.conversation.regenerate_last()

    def engine_messages(self, conv_id: int) -> list[dict]:
        return self.conversation.engine_messages(conv_id)

    def stop(self) -> None:
        if self.conversation.stop():
            self.statusBar().showMessage("Stopping\u2026", 1500)

    def _set_generating(self, on: bool) -> None:
        self.input.set_generating(on)
        self.chat.set_busy(on)
        self.stop_shortcut.setEnabled(on)
        self._update_actions()

    def _update_actions(self) -> None:
        busy = self.gen is not None
        has_conv = self.conv_id is not None
        self.export_md_action.setEnabled(has_conv)
        self.export_json_action.setEnabled(has_conv)
        self.delete_action.setEnabled(has_conv)
        self.regenerate_action.setEnabled(has_conv and not busy)
        self.stop_action.setEnabled(busy)

    # ---- engine reports: to the controller, and to the timing panel
    def _on_text(self, request_id: int, thinking: str, answer: str) -> None:
        self.conversation.on_text(request_id, thinking, answer)

    def _on_stats(self, request_id: int, stats: dict) -> None:
        if self.gen is not None and self.gen.request.request_id == request_id:
            self.timing.add_stats(stats)
        self.conversation.on_stats(request_id, stats)

    def _on_finished(self, request_id: int, reply: dict) -> None:
        self.conversation.on_finished(request_id, reply)

    def _on_failed(self, request_id: int, sentence: str, details: str, kind: str) -> None:
        self.conversation.on_failed(request_id, sentence, details)

    def _on_configure_failed(self, sentence: str, details: str) -> None:
        if self._closing:        # reports still queued when the window closed
            return
        show_error(self, sentence, details)

    def _on_mode_fell_back(self, sentence: str) -> None:
        """The decode mode asked for could not run (persistent: the GPU cannot hold its grid):
        the engine's sentence in the banner; the settings show the mode that runs."""
        if self._closing:        # reports still queued when the window closed
            return
        self.capabilities["decode_mode_error"] = sentence
        self.show_banner(sentence, warning=True)

    def _on_configured(self, options: dict) -> None:
        if self._closing:        # reports still queued when the window closed
            return
        self.engine_options = dict(options)
        if options.get("decode_mode") == self._engine_wanted.get("decode_mode"):
            self.capabilities.pop("decode_mode_error", None)    # the mode asked for runs
        self.max_context = int(options.get("max_context") or self.max_context)
        self._update_engine_label()
        self._request_token_count()

    # ================================================================== context meter, draft
    def _request_token_count(self) -> None:
        self.conversation.count_context(self.input.text())

    def _on_token_count(self, tag: int, n: int, max_context: int) -> None:
        if self._closing:        # reports still queued when the window closed
            return
        self.conversation.on_token_count(tag, n, max_context)

    def _on_draft_changed(self) -> None:
        if self._showing_draft:
            return
        self.conversation.set_draft(self.input.text())      # the estimate shows at once
        self._draft_timer.start()

    def _draft_idle(self) -> None:
        self.conversation.flush_drafts()
        self._request_token_count()                         # the tokenizer's exact count

    # ================================================================== timing panel
    def _place_timing(self) -> None:
        """Open the panel at the width the user last dragged it to; the first time at its
        table's width, but never more than leaves the chat CHAT_SHARE of the splitter (the
        sidebar gives way down to its minimum before the panel goes below its own)."""
        sizes = self.splitter.sizes()
        total = sum(sizes) or self.splitter.width()
        sidebar = sizes[0]
        if self._timing_width:
            width = min(self._timing_width, max(self.timing.minimumWidth(), total - sidebar - MIN_CHAT_WIDTH))
        else:
            room = total - int(CHAT_SHARE * total)          # for the sidebar and the panel
            width = min(self.timing.preferred_width(), room - sidebar)
            if width < self.timing.minimumWidth():
                sidebar = max(self.sidebar.minimumWidth(), room - self.timing.minimumWidth())
                width = max(self.timing.minimumWidth(), room - sidebar)
        self.splitter.setSizes([sidebar, total - sidebar - width, width])

    def _on_splitter_moved(self, _pos: int, _index: int) -> None:
        width = self.splitter.sizes()[2]
        if width > 0:
            self._timing_width = width
        elif self.timing.isVisible():            # dragged shut: the panel is closed
            self.timing.hide()

    def _on_timing_toggled(self, visible: bool) -> None:
        if visible:
            self._place_timing()
        if not self.loaded or self._closing:
            return
        if self._timing_sent != visible:
            self._timing_sent = visible
            self.engine.configure(timing=visible)
        if visible:
            self.engine.read_timings()

    def _on_timings(self, info: dict) -> None:
        if self._closing:        # reports still queued when the window closed
            return
        self.timing.set_timings(info)

    # ================================================================== settings
    def open_settings(self) -> None:
        dialog = SettingsDialog(self.settings, self.model_defaults, self.capabilities,
                                parent=self, running=self.engine_options)
        if dialog.exec() == SettingsDialog.DialogCode.Accepted:
            self.apply_settings(dialog.settings())
        dialog.deleteLater()

    def apply_settings(self, new: ChatSettings) -> None:
        """Store the settings and push what changed to the engine (no restart needed)."""
        save_settings(self.qs, new, self.model_defaults)
        old_model, self.settings = self.settings.model, new
        switch_model = new.model != old_model and self.gen is None
        # compare with what the engine was last asked for (the reference backend keeps its
        # split-K / graph flags unchanged, so its options cannot tell what was sent)
        wanted = {**new.engine_settings(), "max_context": new.context_length}
        changes = {k: v for k, v in wanted.items() if self._engine_wanted.get(k) != v}
        if changes and self.loaded and not switch_model:
            self.engine.configure(**changes)
            if self.timing.isVisible():
                self.engine.read_timings()      # after the change (the worker runs them in order)
        self._engine_wanted.update(wanted)
        if new.theme != self.colors.name and not (new.theme == "system" and theme.resolve("system") is self.colors):
            self.set_theme(new.theme)
        elif new.theme in self.theme_actions:
            self.theme_actions[new.theme].setChecked(True)
        if switch_model:
            self._switch_model(new.model or DEFAULT_MODEL)
            return
        self._request_token_count()

    def set_theme(self, mode: str) -> None:
        if mode != self.settings.theme:
            self.settings.theme = mode
            self.qs.setValue("ui/theme", mode)
        self.colors = theme.apply_theme(QApplication.instance(), mode)
        self.chat.set_style(theme.render_style(self.colors))
        self.timing.set_colors(self.colors)
        if self.banner.isVisible() and self._banner_warning:
            self.show_banner(self.banner.text(), self.banner.toolTip(), warning=True)
        if mode in self.theme_actions:
            self.theme_actions[mode].setChecked(True)

    def _on_system_scheme(self, *_):
        if self.settings.theme == "system":
            self.set_theme("system")

    # ================================================================== misc actions
    def copy_last_answer(self) -> None:
        text = self.chat.last_answer()
        if text is not None:
            QGuiApplication.clipboard().setText(text)
            self.statusBar().showMessage("Last answer copied", 2000)

    def _use_suggestion(self, prompt: str) -> None:
        # never over what was typed: the suggestion goes after it, one Ctrl+Z away
        self.input.insert_text(prompt)
        self.input.box.setFocus()

    def _focus_search(self) -> None:
        self.sidebar.search.setFocus()
        self.sidebar.search.selectAll()

    def _about(self) -> None:
        QMessageBox.about(self, "About tritonchat",
                          "<b>tritonchat</b><br>A desktop chat app for Qwen3.5-0.8B whose inference "
                          "runs on hand-written Triton kernels.<br><br>"
                          f"{self.engine_label.text()}")

    # ================================================================== closing
    def save_in_flight(self) -> None:
        """Write the streaming answer as it stands, and the drafts (used on close)."""
        self.conversation.save_in_flight()

    def closeEvent(self, event) -> None:
        self._closing = True
        self.qs.setValue("ui/geometry", self.saveGeometry())
        self.qs.setValue("ui/splitter", self.splitter.saveState())
        if self._timing_width:
            self.qs.setValue("ui/timing_width", int(self._timing_width))
        if self.conv_id is not None:
            self.qs.setValue("ui/last_conversation", self.conv_id)
        self.qs.sync()
        self.save_in_flight()
        self.engine_closed = self.engine.close(timeout_s=30.0)
        super().closeEvent(event)


class _ChatWiring(ConversationListener):
    """The controller's reports, shown in the window's views."""

    def __init__(self, window: MainWindow):
        self.w = window

    def opened(self, conv_id, title, messages, streaming, draft) -> None:
        w = self.w
        if conv_id is None:
            w.chat.clear()
        else:
            w.chat.set_messages(messages)
            if streaming is not None:
                w.chat.attach_stream(streaming.assistant_msg_id, streaming.thinking,
                                     streaming.answer, streaming.thinking_enabled)
            w.qs.setValue("ui/last_conversation", conv_id)
        w.chat.set_busy(w.gen is not None)
        w.sidebar.select(conv_id)
        self.title_changed(conv_id, title)
        w._showing_draft = True                 # the box shows this conversation's draft
        w.input.set_text(draft)
        w._showing_draft = False
        w._update_actions()

    def title_changed(self, conv_id, title) -> None:
        w = self.w
        if conv_id == w.conv_id:
            w.header_title.setText(title)
            w.setWindowTitle(f"{title} \u2014 tritonchat" if conv_id is not None else "tritonchat")
            if conv_id is not None:
                w.qs.setValue("ui/last_conversation", conv_id)

    def message_added(self, message: Message) -> None:
        self.w.chat.add_message(message.id, message.role, message.content, message.thinking,
                                message.stats, variant=(message.variant, message.variants))

    def removed_from(self, msg_id) -> None:
        self.w.chat.remove_from(msg_id)

    def stream_started(self, message: Message, thinking_enabled) -> None:
        self.w.chat.begin_stream(message.id, thinking_enabled,
                                 variant=(message.variant, message.variants))
        self.w.timing.begin_generation()

    def stream_text(self, thinking, answer) -> None:
        if self.w.chat.streaming is not None:
            self.w.chat.append_stream(thinking, answer)

    def stream_finished(self, message: Message, thinking_seconds) -> None:
        self.w.chat.finish_stream(message.content, message.thinking, thinking_seconds, message.stats)

    def busy_changed(self, busy) -> None:
        self.w._set_generating(busy)

    def text_returned(self, text) -> None:
        self.w.input.restore(text)

    def conversations_changed(self) -> None:
        self.w.refresh_conversations()

    def context_changed(self, used, total, exact) -> None:
        self.w.input.set_context(used, total, exact=exact)

    def refused(self, sentence) -> None:
        show_error(self.w, sentence)

    def generation_finished(self, stats) -> None:
        w = self.w
        w.timing.add_stats(stats)             # the panel ends on the answer's own numbers
        if w.timing.isVisible():
            w.engine.read_timings()
        w.generationFinished.emit(stats)

    def generation_failed(self, sentence, details) -> None:
        show_error(self.w, sentence, details)
        self.w.generationFailed.emit(sentence, details)


def _in_hub_cache(folder) -> bool:
    from tritonchat.engine.hub import model_cache_dir

    try:
        Path(folder).resolve().relative_to(model_cache_dir().resolve())
        return True
    except (ValueError, OSError):
        return False


def _download_with_dialog(repo_id: str, parent: QWidget) -> Path | None:
    from .download_dialog import DownloadDialog

    dialog = DownloadDialog(repo_id, parent=parent)
    try:
        if dialog.exec() == DownloadDialog.DialogCode.Accepted and dialog.result_dir is not None:
            return Path(dialog.result_dir)
        return None
    finally:
        dialog.deleteLater()
