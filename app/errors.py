"""Errors as users see them: one plain sentence they can act on, plus a details expander.

describe_exception() turns any exception into (sentence, details); show_error() shows them in a
modal box whose "Show Details..." says what failed and what to do, while the traceback goes to
a rotating log file (platformdirs' user log dir) that the box names; ErrorBanner is the
non-modal bar for problems the user can keep working around.
torch is never imported here: exceptions are recognised by type name and message, so this
module works before (and without) the engine being loaded.
"""
from __future__ import annotations

import logging
import logging.handlers
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Iterator

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QHBoxLayout, QLabel, QMessageBox, QSizePolicy, QToolButton,
                               QWidget)

from tritonchat.engine.errors import TritonChatError

OOM_SENTENCE = "The GPU ran out of memory: choose a shorter context length in Settings."
NO_CC_SENTENCE = ("Triton cannot compile its kernels because no C compiler was found: install "
                  "gcc (for example `sudo apt install gcc`) and start tritonchat again.")
NO_GPU_SENTENCE = ("No usable CUDA GPU was found (check the NVIDIA driver with `nvidia-smi`): "
                   "only the slow CPU reference backend can run here.")
HOST_OOM_SENTENCE = ("The computer ran out of memory: close other programs or choose a shorter "
                     "context length in Settings.")

# Files of a Hugging Face model folder that the engine reads.
_MODEL_FILE = re.compile(r"(\.safetensors|\.safetensors\.index\.json|config\.json|tokenizer[^/]*"
                         r"\.json|chat_template\.jinja|vocab\.json|merges\.txt)$")
_COMPILERS = re.compile(r"^(cc|c\+\+|gcc|g\+\+|clang|clang\+\+)(-[\d.]+)?$")


def _python_dev_sentence() -> str:
    pkg = f"python{sys.version_info.major}.{sys.version_info.minor}-dev"
    return ("Triton cannot compile its kernels because the Python headers (Python.h) are "
            f"missing: install them (for example `sudo apt install {pkg}`) and start tritonchat "
            "again.")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and those it was raised from or during, outermost first."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def _type_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _compile_failure(exc: subprocess.CalledProcessError) -> str | None:
    """Sentence for Triton's helper-module build (cc src.c -shared -I<python include> ...)."""
    cmd = exc.cmd if isinstance(exc.cmd, (list, tuple)) else str(exc.cmd).split()
    if not cmd or not _COMPILERS.match(os.path.basename(str(cmd[0]))) or "-shared" not in cmd:
        return None
    includes = [str(a)[2:] for a in cmd if str(a).startswith("-I")]
    # The compiler's own output went to the terminal, so ask the file system what is missing.
    if includes and not any(Path(d, "Python.h").is_file() for d in includes):
        return _python_dev_sentence()
    return ("Triton could not compile one of its helper modules with "
            f"{os.path.basename(str(cmd[0]))}: the compiler's messages are in the terminal "
            "tritonchat was started from.")


def _sentence_for(exc: BaseException) -> str | None:
    """A specific sentence for one exception of the chain, or None if it is not recognised."""
    if isinstance(exc, TritonChatError):
        return str(exc)
    names = _type_names(exc)
    text = str(exc)
    if "OutOfMemoryError" in names or re.search(r"CUDA (error: )?out of memory", text, re.I):
        return OOM_SENTENCE
    if "Failed to find C compiler" in text or "Failed to find C++ compiler" in text:
        return NO_CC_SENTENCE
    if "Python.h: No such file" in text or "fatal error: Python.h" in text:
        return _python_dev_sentence()
    if isinstance(exc, subprocess.CalledProcessError):
        return _compile_failure(exc)
    if isinstance(exc, FileNotFoundError):
        name = exc.filename or ""
        if _COMPILERS.match(os.path.basename(str(name))):
            return NO_CC_SENTENCE          # CC points at a compiler that is not installed
        if name and _MODEL_FILE.search(str(name)):
            return (f"The model file {os.path.basename(str(name))} is missing: download the model "
                    "again, or start `tritonchat --model DIR` with a folder holding all its files.")
        return f"A file tritonchat needs was not found: {name or _first_line(text)}."
    if "SafetensorError" in names or "Error while deserializing header" in text:
        return ("A model weights file is corrupt or incomplete: download the model again, or "
                "start `tritonchat --model DIR` with a complete copy.")
    if ("Torch not compiled with CUDA enabled" in text or "No CUDA GPUs are available" in text
            or "Found no NVIDIA driver" in text):
        return NO_GPU_SENTENCE
    if isinstance(exc, MemoryError):
        return HOST_OOM_SENTENCE
    return None


def describe_exception(exc: BaseException) -> tuple[str, str]:
    """(one plain sentence, details) for any exception; details ends with the traceback."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    for link in _chain(exc):
        sentence = _sentence_for(link)
        if sentence is not None:
            break
    else:
        msg = _first_line(str(exc))
        sentence = f"Something went wrong: {type(exc).__name__}" + (f": {msg}" if msg else "")
    own = exc.details if isinstance(exc, TritonChatError) else None
    details = f"{own.rstrip()}\n\n{tb}" if own and exc.__traceback__ is not None else (own or tb)
    return sentence, details


LOG_FILE = "tritonchat.log"
LOG_BYTES = 1 << 20            # per file; LOG_BACKUPS older files are kept beside it
LOG_BACKUPS = 3
TRACEBACK_START = "Traceback (most recent call last):"
_log_handler: logging.Handler | None = None


def log_dir() -> Path:
    """Where the log goes: TRITONCHAT_LOG_DIR, else platformdirs' user log dir."""
    if os.environ.get("TRITONCHAT_LOG_DIR"):
        return Path(os.environ["TRITONCHAT_LOG_DIR"]).expanduser()
    import platformdirs

    return Path(platformdirs.user_log_dir("tritonchat", appauthor=False))


def log_path() -> Path:
    return log_dir() / LOG_FILE


def app_logger() -> logging.Logger:
    """The "tritonchat" logger, writing to the rotating log file (set up on first use)."""
    global _log_handler
    logger = logging.getLogger("tritonchat")
    path = log_path()
    if _log_handler is None or getattr(_log_handler, "baseFilename", "") != str(path.resolve()):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handler = logging.handlers.RotatingFileHandler(path, maxBytes=LOG_BYTES,
                                                           backupCount=LOG_BACKUPS, encoding="utf-8")
        except OSError:
            return logger
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        if _log_handler is not None:
            logger.removeHandler(_log_handler)
            _log_handler.close()
        _log_handler = handler
        logger.addHandler(handler)
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)
    return logger


def log_error(sentence: str, details: str) -> Path | None:
    """Write the sentence and its details (traceback included) to the log; its path, or None."""
    logger = app_logger()
    if _log_handler is None:
        return None
    logger.error("%s\n%s", sentence, details.rstrip())
    _log_handler.flush()
    return Path(_log_handler.baseFilename)


def split_details(details: str) -> tuple[str, str]:
    """(the part a person reads, the traceback) of a details text."""
    i = details.find(TRACEBACK_START)
    if i < 0:
        return details.strip(), ""
    return details[:i].strip(), details[i:].strip()


def what_to_do(sentence: str) -> str:
    """The action in a sentence like "X failed: do Y.", else a general one."""
    head, sep, action = sentence.partition(": ")
    if sep and action and re.match(r"(?i)(install|download|choose|start|close|check|use|run|set|"
                                   r"free|open|pick|try|raise|lower|update|delete|move)", action):
        return action[:1].upper() + action[1:]
    return ("Try again; if it keeps failing, start tritonchat from a terminal and send the log "
            "file below with a bug report.")


def details_text(sentence: str, details: str, log: Path | None) -> str:
    """What "Show Details..." holds: what failed, what to do, the error's own details, and where
    the traceback went (the traceback itself only when there is no log file)."""
    own, tb = split_details(details)
    failed = next((ln.strip() for ln in reversed(tb.splitlines()) if ln.strip()), "") if tb else ""
    parts = [f"What failed: {failed or sentence}", f"What to do: {what_to_do(sentence)}"]
    if own:
        parts.append(own)
    if tb:
        parts.append(f"The full traceback is in the log file {log}." if log else tb)
    elif log:
        parts.append(f"Log file: {log}")
    return "\n\n".join(parts)


def build_error_box(parent: QWidget | None, sentence: str, details: str = "",
                    title: str = "tritonchat") -> QMessageBox:
    """The box show_error() runs; separate so it can be inspected without a modal loop."""
    box = QMessageBox(parent)
    box.setIcon(QMessageBox.Icon.Warning)
    box.setWindowTitle(title)
    box.setTextFormat(Qt.TextFormat.PlainText)     # messages quote paths and code, not HTML
    box.setText(sentence)
    if details:
        log = log_error(sentence, details)
        box.setDetailedText(details_text(sentence, details, log))   # Qt's "Show Details..."
        if log is not None and TRACEBACK_START in details:
            box.setInformativeText(f"Details are in {log}.")
    box.setStandardButtons(QMessageBox.StandardButton.Ok)
    box.setWindowModality(Qt.WindowModality.ApplicationModal)
    return box


def show_error(parent: QWidget | None, sentence: str, details: str = "",
               title: str = "tritonchat") -> None:
    """Show a modal warning with ``sentence`` and an expander holding ``details``."""
    box = build_error_box(parent, sentence, details, title)
    box.exec()
    box.deleteLater()


class ErrorBanner(QWidget):
    """A slim coloured bar across the top of the window, hidden until there is something to say."""

    dismissed = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("ErrorBanner")
        # A plain QWidget paints no style-sheet background without this attribute.
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        self.setStyleSheet(
            "#ErrorBanner { background: #b3261e; border-radius: 4px; }"
            "#ErrorBanner QLabel { color: white; }"
            "#ErrorBanner QToolButton { color: white; border: none; font-weight: bold;"
            " padding: 0 6px; }"
            "#ErrorBanner QToolButton:hover { background: rgba(255, 255, 255, 40); }")
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)
        self.label = QLabel(self)
        self.label.setTextFormat(Qt.TextFormat.PlainText)
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.dismiss_button = QToolButton(self)
        self.dismiss_button.setText("\u2715")
        self.dismiss_button.setToolTip("Dismiss")
        self.dismiss_button.setAccessibleName("Dismiss")
        self.dismiss_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.dismiss_button.clicked.connect(self._dismiss)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(10, 4, 4, 4)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.dismiss_button, 0, Qt.AlignmentFlag.AlignTop)
        self.hide()

    def text(self) -> str:
        return self.label.text()

    def show_message(self, text: str, tooltip: str = "") -> None:
        self.label.setText(text)
        # The tooltip carries the details (e.g. the traceback) on hover of the whole bar.
        self.setToolTip(tooltip)
        self.label.setToolTip(tooltip)
        self.show()

    def clear(self) -> None:
        self.label.clear()
        self.setToolTip("")
        self.label.setToolTip("")
        self.hide()

    def _dismiss(self) -> None:
        self.clear()
        self.dismissed.emit()
