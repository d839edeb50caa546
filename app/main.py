"""`tritonchat` without a sub-command: open the desktop app.

Before Qt starts, two checks answer in one sentence (exit 1 or 2) instead of an abort or a window
that never appears: the model argument (a folder must exist and hold config.json) and, on Linux,
whether Qt's platform plugin can open a display (a child process tries; a missing system library
is named with the Debian/Ubuntu and Fedora packages that provide it).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

DEFAULT_MODEL = "Qwen/Qwen3.5-0.8B"
EXIT_NO_DISPLAY = 1
EXIT_BAD_MODEL = 2
DEMO_FOLDER = "tiny-demo-model"

# Platforms that need no display server (tests, screenshots, VNC): the display check is skipped.
HEADLESS_PLATFORMS = ("offscreen", "minimal", "vnc", "eglfs", "linuxfb", "vkkhrdisplay")

NO_DISPLAY_SENTENCE = ("no display found (DISPLAY / WAYLAND_DISPLAY unset): run it from a desktop "
                       "session, or use `tritonchat generate` / `tritonchat bench` on a headless machine.")

# shared library -> (Debian/Ubuntu package, Fedora package): what Qt's xcb plugin loads
QT_LIBRARY_PACKAGES = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-xinerama.so.0": ("libxcb-xinerama0", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb"),
    "libxcb-xinput.so.0": ("libxcb-xinput0", "libxcb"),
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl"),
    "libGL.so.1": ("libgl1", "libglvnd-glx"),
    "libOpenGL.so.0": ("libopengl0", "libglvnd-opengl"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs"),
    "libwayland-client.so.0": ("libwayland-client0", "libwayland-client"),
    "libwayland-cursor.so.0": ("libwayland-cursor0", "libwayland-cursor"),
}
# Qt 6.5+ says which one when the cursor library is missing, without naming a file
_QT_NEEDS = re.compile(r"(xcb-cursor0 or libxcb-cursor0) is needed")
_NOT_FOUND = re.compile(r"(lib[\w.+-]+\.so[\d.]*)(?: => not found|: cannot open shared object file)")

_PROBE = ("import sys\n"
          "from PySide6.QtGui import QGuiApplication\n"
          "app = QGuiApplication(sys.argv[:1])\n"
          "print(app.platformName())\n")
PROBE_TIMEOUT_S = 20.0


def _platform(env) -> str:
    return (env.get("QT_QPA_PLATFORM") or "").split(":", 1)[0].split(";", 1)[0].strip().lower()


def missing_libraries(text: str) -> list[str]:
    """Shared libraries named as missing in ldd output or a loader's error text, in order."""
    found = list(dict.fromkeys(m.group(1) for m in _NOT_FOUND.finditer(text)))
    if _QT_NEEDS.search(text) and "libxcb-cursor.so.0" not in found:
        found.append("libxcb-cursor.so.0")
    return found


def install_sentence(libs: list[str], detail: str = "") -> str:
    """What to install so Qt's platform plugin loads, for Debian/Ubuntu and for Fedora."""
    known = [QT_LIBRARY_PACKAGES[lib] for lib in libs if lib in QT_LIBRARY_PACKAGES]
    if not known:          # not told which: the set Qt's xcb plugin needs beyond a base system
        known = [QT_LIBRARY_PACKAGES[k] for k in ("libxcb-cursor.so.0", "libxcb-icccm.so.4",
                                                  "libxcb-keysyms.so.1", "libxcb-image.so.0",
                                                  "libxcb-render-util.so.0", "libxkbcommon-x11.so.0")]
    deb = " ".join(dict.fromkeys(d for d, _ in known))
    fed = " ".join(dict.fromkeys(f for _, f in known))
    what = f"is missing {', '.join(libs)}" if libs else f"cannot start{f' ({detail})' if detail else ''}"
    return (f"Qt's display plugin {what}: install the system packages (Debian/Ubuntu: "
            f"sudo apt install {deb}; Fedora: sudo dnf install {fed}) and start tritonchat again.")


def _xcb_plugin() -> Path | None:
    try:
        import PySide6
    except ImportError:
        return None
    plugin = Path(PySide6.__file__).parent / "Qt" / "plugins" / "platforms" / "libqxcb.so"
    return plugin if plugin.is_file() else None


def _ldd_missing(plugin: Path | None) -> list[str]:
    ldd = shutil.which("ldd")
    if plugin is None or ldd is None:
        return []
    try:
        out = subprocess.run([ldd, str(plugin)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return missing_libraries(out.stdout + out.stderr)


def qt_platform_problem(env=None, *, probe=None) -> str | None:
    """None when Qt can open its platform here, else the sentence that says what to do.

    Linux only (elsewhere Qt ships what it needs). `probe(env) -> (returncode, stderr)` starts
    a QGuiApplication in a child process; tests pass their own."""
    env = dict(os.environ if env is None else env)
    if not sys.platform.startswith("linux") or env.get("TRITONCHAT_SKIP_QT_CHECK") == "1":
        return None
    platform = _platform(env)
    if platform in HEADLESS_PLATFORMS:
        return None
    wants_x11 = platform == "xcb"
    wants_wayland = platform.startswith("wayland")
    if not (env.get("DISPLAY") or env.get("WAYLAND_DISPLAY")) or (wants_x11 and not env.get("DISPLAY")) \
            or (wants_wayland and not env.get("WAYLAND_DISPLAY")):
        return NO_DISPLAY_SENTENCE
    code, err = (probe or _run_probe)(env)
    if code == 0:
        return None
    libs = missing_libraries(err) or _ldd_missing(_xcb_plugin())
    if libs or "platform plugin" in err:
        return install_sentence(libs)
    last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), f"exit code {code}")
    return f"Qt cannot open a window on this display ({last[:160]}): check DISPLAY / WAYLAND_DISPLAY."


def _run_probe(env) -> tuple[int, str]:
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                           timeout=PROBE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return 1, "the display did not answer within 20 s"
    except OSError as e:
        return 0, str(e)              # cannot probe: let Qt itself try
    return r.returncode, r.stderr


def model_problem(model: str) -> str | None:
    """None for a usable --model value, else one sentence: a folder must exist and hold
    config.json; anything else must read as a Hugging Face repo id (owner/name)."""
    from tritonchat.engine.hub import is_local_dir

    path = Path(model).expanduser()
    if is_local_dir(model) or path.exists():
        if not path.exists():
            return f"The model folder {path} does not exist."
        if not path.is_dir():
            return f"{path} is a file, not a model folder."
        if not (path / "config.json").is_file():
            return (f"{path} is not a model folder (it has no config.json): choose the folder "
                    "that holds the model's config.json and *.safetensors files.")
        return None
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        return (f"{model} is neither a folder nor a Hugging Face repo id like {DEFAULT_MODEL}.")
    return None


def demo_model_dir() -> Path:
    """The tiny random model `--demo` opens (made on first use, in the user data dir)."""
    import platformdirs

    return Path(platformdirs.user_data_dir("tritonchat", appauthor=False)) / DEMO_FOLDER


def ensure_demo_model(folder: Path | None = None) -> Path:
    from tritonchat.engine.tiny_model import make_tiny_model

    folder = folder or demo_model_dir()
    if not (folder / "config.json").is_file():
        if folder.exists() and not any(folder.iterdir()):
            folder.rmdir()
        make_tiny_model(folder)
    return folder


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tritonchat", description="Chat with Qwen3.5-0.8B on Triton kernels.")
    ap.add_argument("--model", default=None,
                    help="a model folder, or a Hugging Face repo id (downloaded on first launch; "
                         f"default: the model chosen in Settings, else {DEFAULT_MODEL})")
    ap.add_argument("--demo", action="store_true",
                    help="open the app on a tiny random-weight model (no GPU, no download; the "
                         "answers are gibberish)")
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


def quiet_font_database() -> None:
    """Silence Qt's font-database category (qt.text.font.db): on a desktop whose fonts lack
    OpenType tables, or without the default family, Qt writes one line per font it looks
    through while laying out the first text, ~40 lines of noise at every start. A user's own
    QT_LOGGING_RULES still wins (Qt applies the variable after these rules)."""
    from PySide6.QtCore import QLoggingCategory

    QLoggingCategory.setFilterRules("qt.text.font.db.warning=false\nqt.text.font.db.info=false")


def use_existing_font(app) -> None:
    """Ask for a font family this machine has: a default family that is missing (offscreen's
    "Sans Serif" where fontconfig knows no such alias) makes Qt search its aliases and warn in
    the qt.text.font.db category for every font the widgets derive from it."""
    from PySide6.QtGui import QFontDatabase

    families = set(QFontDatabase.families())
    if not families or app.font().family() in families:
        return
    general = QFontDatabase.systemFont(QFontDatabase.SystemFont.GeneralFont)
    if general.family() not in families:
        general.setFamily(sorted(families)[0])
    app.setFont(general)


def saved_model(qs) -> str | None:
    """The model chosen in Settings (or with "Use a folder on disk..."), if it is still usable."""
    from .settings import load_model_choice

    choice = load_model_choice(qs)
    return choice if choice and model_problem(choice) is None else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is not None:
        problem = model_problem(args.model)
        if problem:
            print(f"tritonchat: {problem}", file=sys.stderr)
            return EXIT_BAD_MODEL
    problem = qt_platform_problem()
    if problem:
        print(f"tritonchat: {problem}", file=sys.stderr)
        return EXIT_NO_DISPLAY
    if args.demo:
        from tritonchat.engine.errors import TritonChatError
        try:
            args.model = str(ensure_demo_model())
        except TritonChatError as exc:
            print(f"tritonchat: {exc}", file=sys.stderr)
            return EXIT_BAD_MODEL
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
    quiet_font_database()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    app.setApplicationDisplayName("tritonchat")
    app.setDesktopFileName("tritonchat")            # Wayland matches the window to tritonchat.desktop
    app.setWindowIcon(app_icon())
    use_existing_font(app)

    try:
        store = ChatStore(args.db or ChatStore.default_path())
    except TritonChatError as exc:
        show_error(None, str(exc), exc.details or "")
        return 1
    qs = open_settings(str(args.settings) if args.settings else None)
    overrides = {k: v for k, v in (("backend", args.backend), ("device", args.device),
                                   ("dtype", args.dtype)) if v}
    model = args.model or saved_model(qs) or DEFAULT_MODEL
    window = MainWindow(model, store, qs, engine_overrides=overrides)
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
