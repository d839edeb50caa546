"""Guard against a PySide6 reference-count bug that aborts the app on Python < 3.12.

Seen with PySide6 6.12 on CPython 3.11: every Python-side `signal.emit()` drops one reference
to True that it never took (and some setters, e.g. QAbstractButton.setChecked, do the same to
None). On 3.12+ True/False/None are immortal, so the bug is invisible there; on 3.11 their
reference count runs down with each emit and after a few hundred emits CPython aborts with
"bool_dealloc: deallocating True or False" (or none_dealloc). The streaming chat emits tens of
signals a second, and pyqtgraph emits many more.

These three objects are statically allocated singletons that are never freed, so giving each a
very large reference count (2**40: centuries of emits) is safe and makes them effectively
immortal, as they are on newer Pythons.
"""
from __future__ import annotations

import ctypes
import sys

_PIN = 1 << 40
_applied = False


def apply() -> bool:
    """Pin True, False and None once per process (no-op on Python >= 3.12)."""
    global _applied
    if _applied or sys.version_info >= (3, 12) or hasattr(sys, "getobjects"):
        return _applied       # immortal already, or a trace-refs build with another layout
    for obj in (True, False, None):
        # ob_refcnt is the first field of every PyObject (a Py_ssize_t) in release builds
        field = ctypes.c_ssize_t.from_address(id(obj))
        before = sys.getrefcount(obj)
        field.value += _PIN
        if sys.getrefcount(obj) - before != _PIN:      # not the layout we thought: undo
            field.value -= _PIN
            return False
    _applied = True
    return True


apply()
