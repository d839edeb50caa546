"""Desktop integration: the icon (SVG + PNGs), the .desktop entry, install/uninstall per XDG."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import configparser
import fnmatch
import importlib.util
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tritonchat import resources
from tritonchat.app import desktop_install as di

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = {"Type": "Application", "Name": "tritonchat", "Exec": "tritonchat", "Icon": "tritonchat",
            "Terminal": "false", "Categories": "Utility;Development;",
            "StartupWMClass": "tritonchat"}


def read_entry(text: str) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str                      # keys are case-sensitive in desktop files
    parser.read_string(text)
    assert parser.sections() == ["Desktop Entry"]
    return dict(parser["Desktop Entry"])


def exec_argv(value: str) -> list[str]:
    """Exec= value -> argv, by the Desktop Entry spec: string escapes first, then quoting."""
    string_escapes = {"s": " ", "n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    unescaped, i = [], 0
    while i < len(value):
        if value[i] == "\\":
            unescaped.append(string_escapes[value[i + 1]])
            i += 2
        else:
            unescaped.append(value[i])
            i += 1
    text = "".join(unescaped)
    assert "%" not in text.replace("%%", "")        # no field codes are used
    args, current, quoted, i = [], None, False, 0
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                assert text[i + 1] in '"`$\\', text     # the only escapes allowed in quotes
                current.append(text[i + 1])
                i += 1
            elif c == '"':
                quoted = False
            else:
                current.append(c)
        elif c == " ":
            if current is not None:
                args.append("".join(current))
            current = None
        elif c == '"':
            assert current is None, "a quote must start an argument"
            current, quoted = [], True
        else:
            assert c not in '"`$\\', f"reserved {c!r} outside quotes"
            current = (current or []) + [c]
        i += 1
    assert not quoted
    if current is not None:
        args.append("".join(current))
    return [a.replace("%%", "%") for a in args]


def validate(path: Path) -> None:
    tool = shutil.which("desktop-file-validate")
    if tool is None:
        return                                     # our own key checks still ran
    result = subprocess.run([tool, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def load_render_icons():
    spec = importlib.util.spec_from_file_location("render_icons",
                                                  ROOT / "packaging" / "render_icons.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- resources ---------------------------------------------------------------------------------

def test_svg_is_valid_and_square(qapp):
    from PySide6.QtSvg import QSvgRenderer

    svg = resources.icon_svg_path()
    root = ET.parse(svg).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert root.get("viewBox") == "0 0 512 512"
    renderer = QSvgRenderer(str(svg))
    assert renderer.isValid()
    assert renderer.defaultSize().width() == renderer.defaultSize().height() == 512


@pytest.mark.parametrize("size", resources.ICON_SIZES)
def test_png_sizes_are_real_renders(qapp, size):
    from PySide6.QtGui import QImage

    path = resources.icon_png_paths()[size]
    image = QImage(str(path))
    assert not image.isNull(), path
    assert (image.width(), image.height()) == (size, size)
    assert image.hasAlphaChannel()
    assert image.pixelColor(0, 0).alpha() == 0                  # rounded tile: clear corner
    assert image.pixelColor(size // 2, size // 2).alpha() == 255  # opaque middle


def test_committed_pngs_match_the_svg(qapp):
    render_icons = load_render_icons()
    assert tuple(render_icons.SIZES) == resources.ICON_SIZES
    assert render_icons.stale() == []


def test_icon_check_tolerates_antialiasing_but_not_a_change(qapp):
    """Another Qt release shades edge pixels a few levels differently: still the same icon.
    A moved shape or a recoloured area is a stale PNG."""
    from PySide6.QtGui import QColor, QImage

    render_icons = load_render_icons()
    fresh = render_icons.render(render_icons.SVG, 64)
    shaded = QImage(fresh)
    for x in range(0, 64, 3):                   # an anti-aliasing-like nudge along some edges
        c = shaded.pixelColor(x, 10)
        shaded.setPixelColor(x, 10, QColor(min(255, c.red() + 20), c.green(), c.blue(), c.alpha()))
    assert render_icons.same_picture(fresh, shaded)
    changed = QImage(fresh)
    for x in range(16, 48):
        for y in range(16, 48):
            changed.setPixelColor(x, y, QColor(255, 0, 255, 255))
    assert not render_icons.same_picture(fresh, changed)
    assert not render_icons.same_picture(fresh, render_icons.render(render_icons.SVG, 32))


def test_render_icons_writes_every_size(qapp, tmp_path):
    render_icons = load_render_icons()
    written = render_icons.render_all(out_dir=tmp_path, sizes=(16, 48))
    assert [p.name for p in written] == ["tritonchat-16.png", "tritonchat-48.png"]
    assert render_icons.stale(out_dir=tmp_path, sizes=(16, 48)) == []
    assert render_icons.stale(out_dir=tmp_path, sizes=(32,)) == ["tritonchat-32.png"]


def test_packaged_desktop_file_keys():
    entry = read_entry(resources.desktop_file_path().read_text(encoding="utf-8"))
    for key, value in REQUIRED.items():
        assert entry[key] == value, key
    assert entry["Comment"]
    validate(resources.desktop_file_path())


def test_package_data_covers_every_resource():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["tritonchat.resources"]
    base = resources.RESOURCE_DIR
    files = [p.relative_to(base).as_posix() for p in base.rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert len(files) >= 2 + len(resources.ICON_SIZES)
    uncovered = [f for f in files if not any(fnmatch.fnmatch(f, pat) and f.count("/") ==
                                             pat.count("/") for pat in patterns)]
    assert uncovered == []


# --- install / uninstall -------------------------------------------------------------------

def test_install_and_uninstall_under_xdg_data_home(tmp_path, monkeypatch):
    home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_DATA_HOME", str(home))
    other = home / "applications" / "someone-else.desktop"
    other.parent.mkdir(parents=True)
    other.write_text("[Desktop Entry]\nType=Application\nName=x\nExec=x\n")

    written = di.install(refresh=False)
    entry_path = home / "applications" / "tritonchat.desktop"
    assert written[0] == entry_path
    assert len(written) == 2 + len(resources.ICON_SIZES)
    for size, png in resources.icon_png_paths().items():
        target = home / "icons" / "hicolor" / f"{size}x{size}" / "apps" / "tritonchat.png"
        assert target in written and target.read_bytes() == png.read_bytes()
    svg = home / "icons" / "hicolor" / "scalable" / "apps" / "tritonchat.svg"
    assert svg.read_bytes() == resources.icon_svg_path().read_bytes()

    entry = read_entry(entry_path.read_text(encoding="utf-8"))
    for key, value in REQUIRED.items():
        if key != "Exec":
            assert entry[key] == value, key
    argv = exec_argv(entry["Exec"])
    assert argv == di.launcher_command()
    assert os.access(argv[0], os.X_OK)
    assert entry["TryExec"].replace("\\\\", "\\") == argv[0]
    validate(entry_path)

    assert di.install(refresh=False) == written               # idempotent
    removed = di.uninstall(refresh=False)
    assert sorted(removed) == sorted(written)
    assert not any(p.exists() for p in written)
    assert other.exists()                                     # only our files go
    assert di.uninstall(refresh=False) == []


def test_install_with_refresh_runs_clean(tmp_path):
    written = di.install(tmp_path)                # with the cache tools, when they are installed
    assert all(p.is_file() for p in written)
    di.uninstall(tmp_path)
    assert not any(p.exists() for p in written)


def test_user_dirs_and_xdg_fallbacks(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert di.data_home() == tmp_path / "xdg"
    assert di.data_home(tmp_path / "explicit") == tmp_path / "explicit"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/dir")            # invalid: ignored
    assert di.data_home() == tmp_path / "home" / ".local" / "share"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert di.data_home() == tmp_path / "home" / ".local" / "share"
    written = di.install(refresh=False)
    assert written[0] == tmp_path / "home" / ".local" / "share" / "applications" / \
        "tritonchat.desktop"


@pytest.mark.parametrize("arg", [
    "/usr/bin/tritonchat",
    "/home/me/My Apps/venv/bin/tritonchat",
    '/odd/"quoted" $HOME `tick` back\\slash/tritonchat',
    "/opt/100%/tritonchat",
])
def test_exec_quoting_round_trips(arg, tmp_path):
    value = di.quote_exec_arg(arg)
    assert exec_argv(value) == [arg]
    if " " not in arg and "%" not in arg and '"' not in arg:
        assert value == arg                                # plain paths stay unquoted
    text = di.desktop_entry([arg, "-m", "x"])
    path = tmp_path / "tritonchat.desktop"
    path.write_text(text, encoding="utf-8")
    entry = read_entry(text)
    assert exec_argv(entry["Exec"]) == [arg, "-m", "x"]
    assert entry["TryExec"].replace("\\\\", "\\") == arg
    validate(path)


def test_launcher_command_fallbacks(tmp_path, monkeypatch):
    fake_python = tmp_path / "bin" / "python3"
    fake_python.parent.mkdir()
    monkeypatch.setattr(sys, "executable", str(fake_python))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert di.launcher_command() == [str(fake_python), "-m", "tritonchat.app.launcher"]
    script = tmp_path / "bin" / "tritonchat"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert di.launcher_command() == [str(script)]


def test_packaging_script(tmp_path):
    script = ROOT / "packaging" / "install_desktop.py"
    out = subprocess.run([sys.executable, str(script), "--data-home", str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout.split()
    assert str(tmp_path / "applications" / "tritonchat.desktop") in out
    assert (tmp_path / "icons" / "hicolor" / "256x256" / "apps" / "tritonchat.png").is_file()
    out = subprocess.run([sys.executable, str(script), "--data-home", str(tmp_path), "--uninstall"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("Removed 9 files.")
    assert not (tmp_path / "applications" / "tritonchat.desktop").exists()


def test_installer_and_resources_are_qt_free():
    code = ("import sys, tritonchat.app.desktop_install, tritonchat.resources; "
            "assert not [m for m in sys.modules if m.startswith('PySide6')]")
    subprocess.run([sys.executable, "-c", code], check=True)
