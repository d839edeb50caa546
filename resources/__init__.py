"""tritonchat.resources: the app icon (SVG and its PNG renders) and the .desktop entry.

Qt-free helpers that locate the files, so the app (QIcon), the desktop installer and the tests
agree on names.  The PNGs are rendered from the SVG by packaging/render_icons.py.
"""
from __future__ import annotations

from pathlib import Path

RESOURCE_DIR = Path(__file__).resolve().parent
ICON_NAME = "tritonchat"                       # the freedesktop icon name (Icon= in the entry)
ICON_SIZES = (16, 32, 48, 64, 128, 256, 512)


def resource_path(name: str) -> Path:
    """Path of a file shipped in this package, e.g. ``resource_path("tritonchat.svg")``."""
    return RESOURCE_DIR / name


def icon_svg_path() -> Path:
    return RESOURCE_DIR / f"{ICON_NAME}.svg"


def icon_png_paths() -> dict[int, Path]:
    """{pixel size: PNG path} for every rendered size, smallest first."""
    return {size: RESOURCE_DIR / "icons" / f"{ICON_NAME}-{size}.png" for size in ICON_SIZES}


def desktop_file_path() -> Path:
    return RESOURCE_DIR / f"{ICON_NAME}.desktop"
