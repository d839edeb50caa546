"""Render resources/tritonchat.svg to the PNG sizes desktops ask for (resources/icons/).

    python packaging/render_icons.py          # writes resources/icons/tritonchat-<N>.png
    python packaging/render_icons.py --check  # exit 1 if a committed PNG is missing or stale

Uses PySide6's QSvgRenderer so no extra tool (inkscape, rsvg) is needed; the PNGs are committed,
so installing the app never needs this script.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SIZES = (16, 32, 48, 64, 128, 256, 512)
ROOT = Path(__file__).resolve().parent.parent
SVG = ROOT / "resources" / "tritonchat.svg"
ICON_DIR = ROOT / "resources" / "icons"


def png_name(size: int) -> str:
    return f"tritonchat-{size}.png"


def render(svg: Path, size: int):
    """The SVG drawn anti-aliased into a transparent size x size QImage."""
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise ValueError(f"{svg} is not a valid SVG")
    image = QImage(size, size, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing, True)
    painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform, True)
    renderer.render(painter)
    painter.end()
    return image


def _app():
    # QSvgRenderer needs a QGuiApplication; none is shown, so the offscreen platform is enough.
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtGui import QGuiApplication

    return QGuiApplication.instance() or QGuiApplication(sys.argv[:1])


def render_all(svg: Path = SVG, out_dir: Path = ICON_DIR, sizes=SIZES) -> list[Path]:
    _app()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for size in sizes:
        path = out_dir / png_name(size)
        if not render(svg, size).save(str(path), "PNG"):
            raise OSError(f"could not write {path}")
        written.append(path)
    return written


# Qt's rasteriser changes its anti-aliasing between releases (PySide6 6.8 vs 6.11 differ by a
# few levels on edge pixels): a committed PNG is stale only when it differs by more than that.
MAX_CHANNEL_DIFF = 48       # of 255, on any one channel of any pixel (an edge pixel's coverage)
MAX_MEAN_DIFF = 1.0         # of 255, averaged over every channel of every pixel


def image_difference(a, b) -> tuple[int, float] | None:
    """(largest channel difference, mean channel difference) of two same-size images, in
    0..255; None when their sizes differ."""
    from PySide6.QtGui import QImage

    a = a.convertToFormat(QImage.Format.Format_ARGB32)
    b = b.convertToFormat(QImage.Format.Format_ARGB32)
    if a.isNull() or b.isNull() or a.size() != b.size():
        return None
    x, y = bytes(a.constBits()), bytes(b.constBits())
    if x == y:
        return 0, 0.0
    diffs = [abs(p - q) for p, q in zip(x, y)]
    return max(diffs), sum(diffs) / len(diffs)


def same_picture(a, b) -> bool:
    """Equal up to the anti-aliasing differences between Qt releases."""
    d = image_difference(a, b)
    return d is not None and d[0] <= MAX_CHANNEL_DIFF and d[1] <= MAX_MEAN_DIFF


def stale(svg: Path = SVG, out_dir: Path = ICON_DIR, sizes=SIZES) -> list[str]:
    """Sizes whose committed PNG is missing or differs from a fresh render (beyond the
    anti-aliasing tolerance)."""
    from PySide6.QtGui import QImage

    _app()
    bad = []
    for size in sizes:
        path = out_dir / png_name(size)
        committed = QImage(str(path))
        if committed.isNull() or not same_picture(committed, render(svg, size)):
            bad.append(path.name)
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check the committed PNGs")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for name in bad:
            print(f"stale or missing: {name}", file=sys.stderr)
        return 1 if bad else 0
    for path in render_all():
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
