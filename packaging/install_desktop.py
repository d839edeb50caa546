"""Add tritonchat to the desktop's application menu for this user (or remove it).

    python packaging/install_desktop.py              # same as `tritonchat install-desktop`
    python packaging/install_desktop.py --uninstall
    python packaging/install_desktop.py --data-home /some/dir   # instead of $XDG_DATA_HOME

Needs tritonchat installed in this Python (`pip install .` or `pip install -e .`), since the
menu entry starts that installation's `tritonchat` command.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--uninstall", action="store_true", help="remove the entry and the icons")
    ap.add_argument("--data-home", default=None,
                    help="XDG data folder to use (default: $XDG_DATA_HOME or ~/.local/share)")
    args = ap.parse_args(argv)
    try:
        from tritonchat.app.desktop_install import install, uninstall
    except ImportError as exc:
        print(f"tritonchat is not installed in this Python ({exc}): run `pip install .` in the "
              "repository first.", file=sys.stderr)
        return 2
    if args.uninstall:
        removed = uninstall(args.data_home)
        print(f"Removed {len(removed)} files." if removed else "Nothing to remove.")
        for path in removed:
            print(f"  {path}")
        return 0
    for path in install(args.data_home):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
