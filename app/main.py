"""`tritonchat` without a sub-command: open the desktop app."""
from __future__ import annotations

import argparse
import os
import sys
from importlib import resources
from pathlib import Path

DEFAULT_MODEL = "Qwen/Qwen3.5-0.8B"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tritonchat", description="Chat with Qwen3.5-0.8B on Triton kernels.")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="a model folder, or a Hugging Face repo id (downloaded on first launch)")
    ap.add_argument("--backend", choices=("triton", "reference"), default=None,
                    help="inference backend (default: triton on a CUDA GPU, else the CPU reference)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    ap.add_argument("--db", type=Path, default=None, help="chat history file (default: user data dir)")
    ap.add_argument("--settings", type=Path, default=None,
                    help="settings file (INI) instead of the user's tritonchat settings")
    return ap.parse_args(argv)


def app_icon():
    from PySide6.QtGui import QIcon

    icon = QIcon()
    try:
        base = resources.files("tritonchat.resources")
        svg = base / "tritonchat.svg"
        if svg.is_file():
            with resources.as_file(svg) as path:
                icon.addFile(str(path))
        icons = base / "icons"
        if icons.is_dir():
            for png in icons.iterdir():
                if png.name.endswith(".png"):
                    with resources.as_file(png) as path:
                        icon.addFile(str(path))
    except (ModuleNotFoundError, FileNotFoundError, OSError):
        pass
    return icon


GIL_SWITCH_INTERVAL_S = 0.0005


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from PySide6.QtWidgets import QApplication

    from tritonchat.engine.errors import TritonChatError

    from .errors import show_error
    from .main_window import MainWindow
    from .settings import APPLICATION, ORGANIZATION, open_settings
    from .store import ChatStore

    # The engine thread needs the GIL for a moment between decode steps (~0.75 ms apart); when
    # the GUI thread is in Python (rendering an answer) CPython hands the GIL over only every
    # switch interval, 5 ms by default: 0.5 ms keeps the GPU fed. (Simulated decode loop next
    # to a re-rendering 10,000-word answer: 76% of its speed at 5 ms, 86% at 0.5 ms.)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    app.setApplicationDisplayName("tritonchat")
    app.setDesktopFileName("tritonchat")            # Wayland matches the window to tritonchat.desktop
    app.setWindowIcon(app_icon())

    try:
        store = ChatStore(args.db or ChatStore.default_path())
    except TritonChatError as exc:
        show_error(None, str(exc), exc.details or "")
        return 1
    qs = open_settings(str(args.settings) if args.settings else None)
    overrides = {k: v for k, v in (("backend", args.backend), ("device", args.device),
                                   ("dtype", args.dtype)) if v}
    window = MainWindow(args.model, store, qs, engine_overrides=overrides)
    window.show()
    from PySide6.QtCore import QTimer

    QTimer.singleShot(0, window.start)           # the download dialog opens over the window
    code = app.exec()
    store.close()
    if not getattr(window, "engine_closed", True):
        # the engine thread is still busy (e.g. compiling kernels); Qt would abort on exit
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
