"""The PySide6 refcount guard: many emits must not wear down True/None (PySide6 6.12 on 3.11)."""
from __future__ import annotations

import sys

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QCheckBox

from tritonchat.app import refcount_guard


class _Emitter(QObject):
    ping = Signal(int)


def test_many_emits_and_setters_leave_the_singletons_alive(qapp):
    refcount_guard.apply()
    e = _Emitter()
    got = []
    e.ping.connect(got.append)
    box = QCheckBox()
    for i in range(20000):          # far more than True's natural reference count on 3.11
        e.ping.emit(i)
        box.setChecked(i % 2 == 0)
    assert len(got) == 20000
    assert sys.getrefcount(True) > 100 and sys.getrefcount(None) > 100


def test_probe_is_consistent_with_the_state():
    state = refcount_guard.apply()
    assert state is refcount_guard.apply()                 # probed once, remembered
    if sys.version_info < (3, 12) and not state:
        assert not refcount_guard.emit_drops_true()        # not pinned: because not needed
