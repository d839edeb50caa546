"""The entry point: `tritonchat` with no sub-command opens the window on the given model."""
from __future__ import annotations

import sys

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from tritonchat.app.main import GIL_SWITCH_INTERVAL_S, app_icon, main, parse_args
from tritonchat.app.main_window import MainWindow
from tritonchat.app.store import ChatStore


def test_parse_args_defaults():
    a = parse_args([])
    assert a.model is None and a.backend is None and a.db is None and not a.demo
    a = parse_args(["--model", "/m", "--backend", "reference", "--dtype", "float32"])
    assert (a.model, a.backend, a.dtype) == ("/m", "reference", "float32")


def test_icon_comes_from_the_resources_package(qapp):
    from importlib import resources

    if (resources.files("tritonchat.resources") / "tritonchat.svg").is_file():
        assert not app_icon().isNull()


def test_main_opens_the_window_loads_and_quits(qtbot, tmp_path, tiny_model_dir):
    seen = {}

    def drive():
        windows = [w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()]
        if not windows:
            QTimer.singleShot(50, drive)
            return
        w = windows[0]
        if not w.loaded:
            QTimer.singleShot(50, drive)
            return
        seen.update(model_dir=w.model_dir, options=dict(w.engine_options),
                    desktop=QApplication.desktopFileName(), org=QApplication.organizationName())
        w.close()

    QTimer.singleShot(0, drive)
    db = tmp_path / "chats.sqlite3"
    switch = sys.getswitchinterval()
    try:
        code = main(["--model", str(tiny_model_dir), "--backend", "reference", "--device", "cpu",
                     "--db", str(db), "--settings", str(tmp_path / "settings.ini")])
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)  # engine thread fed
    finally:
        sys.setswitchinterval(switch)
    assert code == 0
    assert seen["model_dir"] == str(tiny_model_dir)
    assert seen["options"]["backend"] == "reference" and seen["options"]["device"] == "cpu"
    assert seen["desktop"] == "tritonchat" and seen["org"] == "tritonchat"
    assert db.exists() and (tmp_path / "settings.ini").exists()
    with ChatStore(db) as store:
        assert store.list_conversations() == []


def test_screenshot_module_writes_a_picture(qapp, tmp_path, tiny_model_dir):
    from PySide6.QtGui import QImage

    from tritonchat.app.screenshot import main as screenshot

    out = tmp_path / "shot.png"
    assert screenshot([str(out), "--model", str(tiny_model_dir), "--size", "900x600",
                       "--max-new-tokens", "24", "--timing"]) == 0
    image = QImage(str(out))
    assert not image.isNull() and image.width() >= 900 and image.height() >= 600
    assert len({image.pixel(x, y) for x in range(0, 900, 37) for y in range(0, 600, 29)}) > 5
