"""The window's layout (timing panel in the splitter), the demo banner and the remembered model."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tritonchat.app.settings import load_settings, open_settings


def test_timing_panel_in_a_resizable_collapsible_splitter(qtbot, make_window, qsettings, tmp_path):
    w = make_window()
    w.resize(1180, 780)
    qtbot.waitUntil(lambda: w.width() == 1180)
    w.timing.toggleViewAction().trigger()
    qtbot.waitUntil(lambda: w.timing.width() > 0)
    sp = w.splitter
    assert sp.indexOf(w.timing) == 2 and sp.isCollapsible(2) and not sp.isCollapsible(1)
    chat = sp.widget(1)
    assert chat.width() >= 0.6 * w.width(), (sp.sizes(), w.width())
    # the user drags the panel wider: the width is kept for the next launch
    sizes = sp.sizes()
    sp.setSizes([sizes[0], sizes[1] - 40, sizes[2] + 40])
    sp.splitterMoved.emit(0, 2)
    wanted = sp.sizes()[2]
    assert w._timing_width == wanted
    # dragged shut: the panel reads as closed
    sp.setSizes([sizes[0], sum(sizes) - sizes[0], 0])
    sp.splitterMoved.emit(0, 2)
    assert not w.timing.isVisible() and not w.timing_button.isChecked()
    w.close()
    again = make_window()
    again.resize(1180, 780)
    again.timing.toggleViewAction().trigger()
    qtbot.waitUntil(lambda: again.timing.width() > 0)
    assert abs(again.timing.width() - wanted) <= 2


def test_tiny_model_banner_says_the_answers_are_random(qtbot, make_window, tmp_path):
    from tritonchat.engine.tiny_model import make_tiny_model

    w = make_window(make_tiny_model(tmp_path / "tiny"))
    assert w.banner.isVisible() and "random" in w.banner.text()


def test_folder_on_disk_is_remembered(qtbot, make_window, tiny_model_dir, qsettings, monkeypatch, tmp_path):
    from tritonchat.app.main import saved_model

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    asked = []
    w = make_window("Qwen/Qwen3.5-0.8B", load=False,
                    download=lambda repo, parent: (asked.append(repo), tiny_model_dir)[1])
    with qtbot.waitSignal(w.modelLoaded, timeout=60000):
        w.start()
    assert asked == ["Qwen/Qwen3.5-0.8B"]
    assert saved_model(qsettings) == str(tiny_model_dir)
    s = load_settings(qsettings)
    assert s.model == str(tiny_model_dir) and s.recent_models == [str(tiny_model_dir)]
    assert w.settings.model == str(tiny_model_dir)


def test_timing_panel_says_when_split_k_changes_nothing(qtbot, qapp):
    from tritonchat.app import theme
    from tritonchat.app.timing_panel import TimingPanel

    p = TimingPanel(theme.resolve("light"))
    qtbot.addWidget(p)
    p.set_capabilities({"triton": True, "split_k_note": "split-K: no shape splits on this GPU"})
    assert not p.split_k_note.isHidden() and "no shape splits" in p.split_k_note.text()
    p.set_capabilities({"triton": True})
    assert p.split_k_note.isHidden()


def test_worker_reads_the_split_k_note():
    from types import SimpleNamespace

    from tritonchat.app.worker import split_k_note

    assert split_k_note(SimpleNamespace(backend=SimpleNamespace())) == ""
    assert split_k_note(SimpleNamespace(backend=SimpleNamespace(split_k_effective=False))) == \
        "split-K: no shape splits on this GPU"
    assert split_k_note(SimpleNamespace(split_k_note="x", backend=None)) == "x"
