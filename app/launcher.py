"""The `tritonchat` program: the engine's sub-commands (engine/cli.py) plus the app's own.

No sub-command opens the desktop app; `install-desktop` installs its menu entry. This module
imports no Qt itself, so `tritonchat generate` on a headless machine never loads it.
"""
from __future__ import annotations

import sys
from typing import Optional

from tritonchat.engine import cli
from tritonchat.engine.errors import TritonChatError


def cmd_install_desktop(args) -> int:
    from .desktop_install import install, uninstall
    if args.uninstall:
        uninstall()
        print("Removed the tritonchat desktop entry.")
    else:
        for p in install():
            print(p)
    return 0


def cmd_app(args) -> int:
    try:
        from .main import main as app_main
    except ImportError as e:
        raise TritonChatError(f"The desktop app cannot start: {e}. Install PySide6 (pip install PySide6).") from e
    argv = (["--model", args.app_model] if args.app_model else []) + (["--demo"] if args.demo else [])
    return app_main(argv)


APP_COMMANDS = {None: cmd_app, "install-desktop": cmd_install_desktop}


def main(argv: Optional[list[str]] = None) -> int:
    return cli.main(argv, app_commands=APP_COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
