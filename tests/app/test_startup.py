"""Before Qt starts: a bad --model, no display or a missing Qt library is one sentence and an exit."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from tritonchat.app import main as app_main
from tritonchat.app.main import NO_DISPLAY_SENTENCE, qt_platform_problem


def run(args, env, timeout=60):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tritonchat.app.launcher", *args], capture_output=True,
                       text=True, timeout=timeout, env=env)
    return r, time.monotonic() - t0


def _env(**changes):
    env = dict(os.environ)
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the display check is Linux only")
def test_no_display_is_one_sentence_and_exit_1(tmp_path):
    r, took = run([], _env(DISPLAY=None, WAYLAND_DISPLAY=None, QT_QPA_PLATFORM=None,
                           XDG_CONFIG_HOME=str(tmp_path), XDG_DATA_HOME=str(tmp_path)), timeout=60)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == "tritonchat: " + NO_DISPLAY_SENTENCE
    assert "tritonchat generate" in r.stderr and took < 30


def test_missing_xcb_library_names_the_packages():
    err = ("qt.qpa.plugin: From 6.5.0, xcb-cursor0 or libxcb-cursor0 is needed to load the Qt xcb "
           "platform plugin.\nqt.qpa.plugin: Could not load the Qt platform plugin \"xcb\" in \"\" even "
           "though it was found.\nlibxcb-icccm.so.4: cannot open shared object file: No such file\n")
    calls = []
    sentence = qt_platform_problem({"DISPLAY": ":0"}, probe=lambda env: (calls.append(env) or (134, err)))
    if not sys.platform.startswith("linux"):
        assert sentence is None
        return
    assert calls and sentence.startswith("Qt's display plugin is missing ")
    assert "libxcb-cursor0" in sentence and "libxcb-icccm4" in sentence          # Debian/Ubuntu
    assert "xcb-util-cursor" in sentence and "xcb-util-wm" in sentence           # Fedora
    assert sentence.count(".") >= 1 and "\n" not in sentence


def test_offscreen_skips_the_check_and_a_working_probe_passes():
    never = lambda env: pytest.fail("probed")              # noqa: E731
    assert qt_platform_problem({"QT_QPA_PLATFORM": "offscreen"}, probe=never) is None
    if sys.platform.startswith("linux"):
        assert qt_platform_problem({}, probe=never) == NO_DISPLAY_SENTENCE
        assert qt_platform_problem({"QT_QPA_PLATFORM": "xcb", "WAYLAND_DISPLAY": "w"}, probe=never) \
            == NO_DISPLAY_SENTENCE
        assert qt_platform_problem({"DISPLAY": ":0"}, probe=lambda env: (0, "")) is None


@pytest.mark.parametrize("kind", ["missing", "no-config"])
def test_bad_model_folder_fails_fast_before_qt(tmp_path, kind):
    folder = tmp_path / "nope"
    if kind == "no-config":
        folder.mkdir()
        (folder / "notes.txt").write_text("x")
    r, took = run(["--model", str(folder)], _env(QT_QPA_PLATFORM="offscreen", XDG_CONFIG_HOME=str(tmp_path),
                                                 XDG_DATA_HOME=str(tmp_path)), timeout=40)
    assert r.returncode == 2 and took < 20
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("tritonchat: ") and line.count("tritonchat") == 1
    assert ("does not exist" in line) if kind == "missing" else ("no config.json" in line)


def test_model_problem_accepts_hub_ids_and_folders(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert app_main.model_problem("Qwen/Qwen3.5-0.8B") is None
    assert app_main.model_problem(str(tmp_path)) is None
    assert "neither a folder" in app_main.model_problem("not a model")


def test_demo_makes_the_tiny_model_and_opens_it(qtbot, tmp_path, monkeypatch):
    demo = tmp_path / "data" / "tiny-demo-model"
    monkeypatch.setattr(app_main, "demo_model_dir", lambda: demo)
    from tritonchat.app.main_window import MainWindow

    seen = {}

    def drive():
        windows = [w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()]
        if not windows or not windows[0].loaded:
            QTimer.singleShot(50, drive)
            return
        w = windows[0]
        seen.update(model_dir=w.model_dir, banner=w.banner.text())
        w.close()

    QTimer.singleShot(0, drive)
    switch = sys.getswitchinterval()
    try:
        code = app_main.main(["--demo", "--backend", "reference", "--device", "cpu",
                              "--db", str(tmp_path / "c.db"), "--settings", str(tmp_path / "s.ini")])
    finally:
        sys.setswitchinterval(switch)
    assert code == 0 and seen["model_dir"] == str(demo)
    assert (demo / "config.json").is_file() and "random" in seen["banner"]


def test_no_font_database_warnings_at_start(tmp_path):
    """The app starts offscreen on the tiny model, loads it and quits: stderr has no font lines."""
    from tritonchat.engine.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "m")
    code = ("import sys\n"
            "from PySide6.QtCore import QTimer\n"
            "from PySide6.QtWidgets import QApplication\n"
            "def drive():\n"
            "    ws = [w for w in QApplication.topLevelWidgets() if type(w).__name__ == 'MainWindow']\n"
            "    if ws and ws[0].loaded:\n"
            "        ws[0].timing.show(); QApplication.processEvents(); ws[0].close(); return\n"
            "    QTimer.singleShot(50, drive)\n"
            "QTimer.singleShot(0, drive)\n"
            "from tritonchat.app.main import main\n"
            f"sys.exit(main(['--model', {str(model)!r}, '--backend', 'reference', '--device', 'cpu',"
            f" '--db', {str(tmp_path / 'c.db')!r}, '--settings', {str(tmp_path / 's.ini')!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=_env(QT_QPA_PLATFORM="offscreen"))
    assert r.returncode == 0, r.stderr
    assert "qt.text.font" not in r.stderr and "QFont" not in r.stderr, r.stderr[:2000]


@pytest.mark.parametrize("user_rules", [None, "qt.text.font.db.warning=true"])
def test_font_database_category_is_quiet_unless_the_user_asks(user_rules):
    """Where the fonts make Qt warn (a desktop whose fonts lack OpenType tables: ~40 lines), the
    category is off before the QApplication exists; a user's QT_LOGGING_RULES turns it back on."""
    code = ("from PySide6.QtCore import QLoggingCategory, qCWarning\n"
            "from tritonchat.app.main import quiet_font_database\n"
            "quiet_font_database()\n"
            "qCWarning(QLoggingCategory('qt.text.font.db'), 'OpenType support missing for \"X\", script 11')\n")
    env = _env(QT_QPA_PLATFORM="offscreen", QT_LOGGING_RULES=user_rules)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert ("OpenType support missing" in r.stderr) == bool(user_rules), r.stderr
