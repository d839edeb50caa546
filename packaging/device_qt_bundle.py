"""Pack the Qt side of the app for a GPU machine that has no PySide6 and no internet.

    python packaging/device_qt_bundle.py [--out .qtbundle/qt-device.tar.xz]

The lent GPU machine has torch and Triton but not PySide6, and a PySide6 wheel set is larger than
what can be carried there. The app needs only QtCore/QtGui/QtWidgets/QtSvg (+ QtOpenGL for
pyqtgraph's optional imports), the offscreen platform plugin and the SVG image/icon plugins, so
this copies exactly those from the installed PySide6 (abi3 modules: any CPython >= 3.9 loads
them), with shiboken6, pyqtgraph (+ colorama), platformdirs and pytest-qt (the app tests' qtbot), three
DejaVu fonts (a machine without fonts draws boxes), plus the system libraries Qt links that a
slim image may lack (found with ldd; glibc, libstdc++ and libgcc stay the machine's own), into
one xz tarball (~40 MB). On the GPU machine:

    mkdir -p /tmp/qt && tar -xJf .qtbundle/qt-device.tar.xz -C /tmp/qt && source /tmp/qt/env.sh
    python -m pytest -m gpu tests/app

(`.qtbundle/` is git-ignored; pass it to the device tool's `carry`.)
"""
from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

QT_MODULES = ("QtCore", "QtGui", "QtWidgets", "QtSvg", "QtOpenGL", "QtOpenGLWidgets", "QtTest")
QT_LIBS = ("Core", "Gui", "Widgets", "DBus", "Svg", "OpenGL", "OpenGLWidgets", "Test")
PLUGINS = ("platforms/libqoffscreen.so", "platforms/libqminimal.so", "imageformats/libqsvg.so",
           "iconengines/libqsvgicon.so")
# provided by any Linux with a working Python/torch: never shipped (mixing them breaks things)
SYSTEM_KEEP = ("libc.so", "libm.so", "libpthread.so", "libdl.so", "librt.so", "ld-linux",
               "libstdc++.so", "libgcc_s.so", "linux-vdso")

ENV_SH = """# source me: the app's Qt side from this bundle
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$_here/site${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="$_here/lib:$_here/site/PySide6/Qt/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export QT_PLUGIN_PATH="$_here/site/PySide6/Qt/plugins"
export QT_QPA_PLATFORM="${QT_QPA_PLATFORM:-offscreen}"
export TRITONCHAT_FONT_DIR="$_here/fonts"       # the GPU window test registers these for its picture
"""
# a machine without fonts draws boxes: carry a sans, its bold and a mono for the screenshots
FONTS = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSansMono.ttf")
FONT_DIRS = ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/dejavu", "/usr/share/fonts/TTF")


def _pkg_dir(name: str) -> Path:
    mod = __import__(name)
    return Path(mod.__file__).parent


def _ldd(paths: list[Path]) -> set[Path]:
    """System libraries the given shared objects need (outside the bundle's own Qt libs)."""
    out: set[Path] = set()
    for p in paths:
        r = subprocess.run(["ldd", str(p)], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            parts = line.split("=>")
            if len(parts) != 2:
                continue
            name, target = parts[0].strip(), parts[1].split("(")[0].strip()
            if not target or "PySide6" in target or "shiboken6" in target:
                continue
            if any(name.startswith(k) for k in SYSTEM_KEEP):
                continue
            out.add(Path(target))
    return out


def collect() -> list[tuple[Path, str]]:
    """(source file, path in the archive) pairs."""
    pyside, shiboken = _pkg_dir("PySide6"), _pkg_dir("shiboken6")
    items: list[tuple[Path, str]] = []

    def add_tree(root: Path, arc: str, skip_dirs: tuple[str, ...] = ()) -> None:
        for dirpath, dirnames, files in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and d not in skip_dirs]
            for f in files:
                src = Path(dirpath) / f
                items.append((src, f"{arc}/{src.relative_to(root)}"))

    for f in pyside.iterdir():
        keep = (f.suffix in (".py", ".pyi", ".json") or f.name == "py.typed"
                or f.name.startswith("libpyside6.abi3.so")
                or any(f.name.startswith(m + ".") for m in QT_MODULES))
        if f.is_file() and keep:
            items.append((f, f"site/PySide6/{f.name}"))
    add_tree(pyside / "support", "site/PySide6/support")
    qt = pyside / "Qt"
    qt_objs = []
    for f in sorted((qt / "lib").iterdir()):
        if f.name.startswith("libicu") or any(f.name.startswith(f"libQt6{n}.so") for n in QT_LIBS):
            items.append((f, f"site/PySide6/Qt/lib/{f.name}"))
            qt_objs.append(f)
    for rel in PLUGINS:
        if (qt / "plugins" / rel).exists():
            items.append((qt / "plugins" / rel, f"site/PySide6/Qt/plugins/{rel}"))
            qt_objs.append(qt / "plugins" / rel)
    add_tree(shiboken, "site/shiboken6", skip_dirs=("include",))
    for name in ("pyqtgraph", "colorama", "platformdirs", "pytestqt"):
        add_tree(_pkg_dir(name), f"site/{name}", skip_dirs=("examples",))
    # pytest finds the pytest-qt plugin (qtbot) through its dist-info's entry point
    from importlib.metadata import distribution
    dist_info = Path(distribution("pytest-qt")._path)
    add_tree(dist_info, f"site/{dist_info.name}")
    for font in FONTS:
        found = next((Path(d) / font for d in FONT_DIRS if (Path(d) / font).exists()), None)
        if found is not None:
            items.append((found, f"fonts/{font}"))
    for lib in sorted(_ldd(qt_objs)):
        items.append((lib, f"lib/{lib.name}"))
    return items


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".qtbundle/qt-device.tar.xz")
    args = ap.parse_args(argv)
    try:
        items = collect()
    except ImportError as e:
        print(f"device_qt_bundle: install the app's dependencies first ({e}).", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = 0
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for src, arc in items:
            tar.add(str(src.resolve()), arcname=arc)        # links stored as the files they name
            raw += src.resolve().stat().st_size
        data = ENV_SH.encode()
        info = tarfile.TarInfo("env.sh")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    print(f"wrote {out}: {len(items)} files, {raw / 2**20:.0f} MiB unpacked, "
          f"{out.stat().st_size / 2**20:.1f} MiB packed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
