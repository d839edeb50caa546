"""Guard against a PySide6 reference-count bug that aborts the app on Python < 3.12.

Seen with PySide6 6.12.0 on CPython 3.11 (not with 6.11): every Python-side `signal.emit()`
drops one reference to True that it never took, and some setters (QAbstractButton.setChecked)
do the same to None. On 3.12+ True/False/None are immortal, so the bug is invisible there; on
3.11 their reference counts run down with each emit and after a few hundred emits CPython
aborts with "bool_dealloc: deallocating True or False" (or none_dealloc). The streaming chat
emits tens of signals a second, and pyqtgraph emits many more.

apply() probes for the bug once (a few emits of a throwaway signal) and only where it is
present gives True, False and None a very large reference count (2**40: centuries of emits).
They are statically allocated singletons that are never freed, so this is safe, and it makes
them effectively immortal as they are on newer Pythons.
"""
from __future__ import annotations

import ctypes
import sys

_PIN = 1 << 40
_PROBE_EMITS = 16
_state: bool | None = None      # None: not probed yet; True: pinned; False: not needed / not possible


def emit_drops_true() -> bool:
    """True when emitting a signal loses a reference to True (the PySide6 bug)."""
    from PySide6.QtCore import QObject, Signal

    class _Probe(QObject):
        ping = Signal()

    probe = _Probe()
    before = sys.getrefcount(True)
    for _ in range(_PROBE_EMITS):
        probe.ping.emit()
    return before - sys.getrefcount(True) >= _PROBE_EMITS


def apply() -> bool:
    """Probe once per process; pin True, False and None if the bug is there."""
    global _state
    if _state is not None:
        return _state
    _state = False
    if sys.version_info >= (3, 12) or hasattr(sys, "getobjects"):
        return False          # immortal already, or a trace-refs build with another layout
    if not emit_drops_true():
        return False
    for obj in (True, False, None):
        # ob_refcnt is the first field of every PyObject (a Py_ssize_t) in release builds
        field = ctypes.c_ssize_t.from_address(id(obj))
        before = sys.getrefcount(obj)
        field.value += _PIN
        if sys.getrefcount(obj) - before != _PIN:       # not the layout we thought: undo
            field.value -= _PIN
            return False
    _state = True
    return True


apply()
