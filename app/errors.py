"""Errors as users see them: one plain sentence they can act on, plus a details expander.

describe_exception() turns any exception into (sentence, details); show_error() shows them in a
modal box; ErrorBanner is the non-modal bar for problems the user can keep working around.
torch is never imported here: exceptions are recognised by type name and message, so this
module works before (and without) the engine being loaded.
"""
from __future__ import annotations

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


def build_error_box(parent: QWidget | None, sentence: str, details: str = "",
                    title: str = "tritonchat") -> QMessageBox:
    """The box show_error() runs; separate so it can be inspected without a modal loop."""
    box = QMessageBox(parent)
    box.setIcon(QMessageBox.Icon.Warning)
    box.setWindowTitle(title)
    box.setTextFormat(Qt.TextFormat.PlainText)     # messages quote paths and code, not HTML
    box.setText(sentence)
    if details:
        box.setDetailedText(details)               # Qt's "Show Details..." expander
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
