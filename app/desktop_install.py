"""Install the desktop entry and icons for the current user (freedesktop.org, Linux).

    <data home>/applications/tritonchat.desktop
    <data home>/icons/hicolor/<N>x<N>/apps/tritonchat.png      N in 16 ... 512
    <data home>/icons/hicolor/scalable/apps/tritonchat.svg

<data home> is $XDG_DATA_HOME, else ~/.local/share.  Exec= is pointed at the `tritonchat` script
of the Python environment running this, because launchers do not see a virtualenv's PATH.
Qt-free: `tritonchat install-desktop` calls install() / uninstall().
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tritonchat.resources import (ICON_NAME, desktop_file_path, icon_png_paths,
                                  icon_svg_path)

DESKTOP_FILE = f"{ICON_NAME}.desktop"
# Characters that force an Exec argument into double quotes (Desktop Entry spec, "Exec key").
_EXEC_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")


def data_home(user_dirs: str | os.PathLike | None = None) -> Path:
    """The XDG data home: ``user_dirs`` if given, else $XDG_DATA_HOME, else ~/.local/share."""
    if user_dirs is not None:
        return Path(user_dirs).expanduser()
    env = os.environ.get("XDG_DATA_HOME", "")
    # The spec says a relative value is invalid and must be ignored.
    if env and os.path.isabs(env):
        return Path(env)
    return Path.home() / ".local" / "share"


def _targets(base: Path) -> dict[Path, Path]:
    """{installed path: packaged source} for every file install() writes."""
    hicolor = base / "icons" / "hicolor"
    targets = {hicolor / "scalable" / "apps" / f"{ICON_NAME}.svg": icon_svg_path()}
    for size, png in icon_png_paths().items():
        targets[hicolor / f"{size}x{size}" / "apps" / f"{ICON_NAME}.png"] = png
    return targets


def _desktop_string(value: str) -> str:
    """A value of type string: backslash and control characters escaped (spec, "Value types")."""
    return (value.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
            .replace("\r", "\\r"))


def quote_exec_arg(arg: str) -> str:
    """One Exec= argument, quoted and escaped as the Desktop Entry spec asks."""
    arg = arg.replace("%", "%%")                       # % starts a field code (%f, %u, ...)
    if any(c in _EXEC_RESERVED for c in arg):
        arg = '"' + re.sub(r'([`"$\\])', r"\\\1", arg) + '"'
    # The value is a desktop-file string first, where a backslash is itself escaped.
    return _desktop_string(arg)


def launcher_command() -> list[str]:
    """argv that starts the app from a launcher: this environment's `tritonchat` script."""
    script = Path(sys.executable).parent / "tritonchat"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    found = shutil.which("tritonchat")
    if found:
        return [str(Path(found).resolve())]
    # Not installed as a script (e.g. a source checkout): run the CLI module with this Python.
    return [sys.executable, "-m", "tritonchat.app.launcher"]


def desktop_entry(command: list[str] | None = None) -> str:
    """The packaged tritonchat.desktop with Exec= (and TryExec=) set to ``command``."""
    command = command or launcher_command()
    exec_value = " ".join(quote_exec_arg(a) for a in command)
    lines = []
    for line in desktop_file_path().read_text(encoding="utf-8").splitlines():
        if line.startswith("TryExec="):
            continue
        if line.startswith("Exec="):
            # TryExec hides the entry once the program is gone (e.g. the virtualenv deleted).
            lines.append(f"TryExec={_desktop_string(command[0])}")   # a path, never quoted
            line = f"Exec={exec_value}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)          # atomic: a launcher never reads a half-written entry


def _refresh_caches(base: Path) -> None:
    """Tell the desktop about the change; optional tools, so failures are ignored."""
    hicolor = base / "icons" / "hicolor"
    commands = [["update-desktop-database", "-q", str(base / "applications")]]
    if (hicolor / "icon-theme.cache").is_file():
        # Only refresh a cache that exists: creating one would make GTK trust it over the folder.
        commands.append(["gtk-update-icon-cache", "-q", "-t", "-f", str(hicolor)])
    for cmd in commands:
        if shutil.which(cmd[0]) and Path(cmd[-1]).is_dir():
            try:
                subprocess.run(cmd, check=False, timeout=30, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
            except (OSError, subprocess.SubprocessError):
                pass
    # Icon themes are re-scanned when the theme folder's mtime changes.
    if hicolor.is_dir():
        os.utime(hicolor)


def install(user_dirs: str | os.PathLike | None = None, *, refresh: bool = True) -> list[Path]:
    """Write the .desktop entry and the icons; returns the paths written."""
    base = data_home(user_dirs)
    written = []
    entry = base / "applications" / DESKTOP_FILE
    _write(entry, desktop_entry().encode("utf-8"))
    written.append(entry)
    for target, source in _targets(base).items():
        _write(target, source.read_bytes())
        written.append(target)
    if refresh:
        _refresh_caches(base)
    return written


def uninstall(user_dirs: str | os.PathLike | None = None, *, refresh: bool = True) -> list[Path]:
    """Remove what install() wrote (nothing else); returns the paths removed."""
    base = data_home(user_dirs)
    removed = []
    for path in [base / "applications" / DESKTOP_FILE, *_targets(base)]:
        if path.is_file() or path.is_symlink():
            path.unlink()
            removed.append(path)
    if refresh:
        _refresh_caches(base)
    return removed
