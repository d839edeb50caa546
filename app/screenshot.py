"""Grab a screenshot of the main window in mid-conversation.

    python -m tritonchat.app.screenshot OUT.png [--model DIR] [--theme light|dark] [--timing]
                                        [--regenerate]

Without --model it writes a tiny random-weight model (`tritonchat make-tiny`) to a temporary folder
(so the answer text is gibberish; pass the real model folder for a representative picture). It uses a
temporary chat history and settings file, sends one message, waits for the answer, sends a
second one and grabs the window while that answer is still streaming. With --regenerate it
answers the first message twice instead and grabs the second answer with its "‹ 2/2 ›" arrows. Run it under Xvfb (or
QT_QPA_PLATFORM=offscreen) on a machine with fonts installed.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

FIRST_PROMPT = "Write a Python function that checks whether a string is a palindrome."
SECOND_PROMPT = "Now explain how it works, step by step."


def _tiny_checkpoint(folder: Path) -> Path:
    from tritonchat.engine.tiny_model import make_tiny_model

    return make_tiny_model(folder / "tiny-qwen35")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default=None, help="model folder (default: a tiny random checkpoint)")
    ap.add_argument("--theme", choices=("light", "dark"), default="light")
    ap.add_argument("--timing", action="store_true", help="open the timing panel too")
    ap.add_argument("--size", default="1280x820", help="window size WxH")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--stream-chars", type=int, default=120,
                    help="grab once the streaming answer has this many characters")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--regenerate", action="store_true",
                    help="regenerate the first answer and grab its variant arrows")
    args = ap.parse_args(argv)

    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen" if not os.environ.get("DISPLAY") else "xcb")
    from . import refcount_guard  # noqa: F401
    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from .main import app_icon
    from .main_window import MainWindow
    from .settings import open_settings
    from .store import ChatStore

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("tritonchat")
    app.setDesktopFileName("tritonchat")
    app.setWindowIcon(app_icon())
    tmp = Path(tempfile.mkdtemp(prefix="tritonchat-shot-"))
    model = args.model or str(_tiny_checkpoint(tmp))
    store = ChatStore(tmp / "chats.sqlite3")
    qs = open_settings(str(tmp / "settings.ini"))
    qs.setValue("ui/theme", args.theme)
    qs.setValue("generation/max_new_tokens", args.max_new_tokens)
    qs.setValue("generation/seed", "3")
    qs.setValue("engine/context_length", 4096)
    w, h = (int(v) for v in args.size.lower().split("x"))

    window = MainWindow(model, store, qs)
    window.resize(w, h)
    window.show()
    loop = QEventLoop()
    failure: list[str] = []
    window.modelLoadFailed.connect(lambda s, d: (failure.append(s), loop.quit()))
    window.generationFailed.connect(lambda s, d: (failure.append(s), loop.quit()))
    QTimer.singleShot(int(args.timeout * 1000), lambda: (failure.append("timed out"), loop.quit()))

    def run(step):
        step()
        if not failure:
            loop.exec()
        if failure:
            raise SystemExit(f"screenshot: {failure[0]}")

    window.modelLoaded.connect(lambda _info: loop.quit())
    run(window.start)
    if args.timing:
        window.timing.show()
    window.generationFinished.connect(lambda _s: loop.quit())
    run(lambda: window.send(FIRST_PROMPT))
    if args.regenerate:
        run(window._regenerate_last)
        return _grab(app, window, store, args.out)

    # the second answer: grab while it streams (or when it ends, if it is short)
    poll = QTimer()
    poll.setInterval(30)
    poll.timeout.connect(lambda: (window.gen is None or len(window.gen.answer) + len(window.gen.thinking)
                                  >= args.stream_chars) and loop.quit())
    poll.start()
    run(lambda: window.send(SECOND_PROMPT))
    poll.stop()
    return _grab(app, window, store, args.out)


def _grab(app, window, store, out: Path) -> int:
    from PySide6.QtCore import QEventLoop

    app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 100)
    window.chat._tick()                       # the streaming text as of now
    app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 100)
    out.parent.mkdir(parents=True, exist_ok=True)
    ok = window.grab().save(str(out))
    window.close()
    store.close()
    print(f"wrote {out}" if ok else f"could not write {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
