"""Preferences in QSettings and the settings dialog."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tritonchat.app.settings import (DEFAULT_CONTEXT, DEFAULT_MAX_NEW_TOKENS, ChatSettings,
                                     load_settings, open_settings, save_settings)
from tritonchat.app.settings_dialog import SettingsDialog
from tritonchat.engine.options import SamplingParams

MODEL = SamplingParams(temperature=0.7, top_k=20, top_p=0.95, min_p=0.0, presence_penalty=1.5,
                       repetition_penalty=1.0)


def test_fresh_settings_follow_the_model(qsettings):
    s = load_settings(qsettings, MODEL)
    assert s.sampling == MODEL
    assert s.system_prompt == "" and s.seed is None and s.thinking is False
    assert s.max_new_tokens == DEFAULT_MAX_NEW_TOKENS and s.context_length == DEFAULT_CONTEXT
    assert s.split_k and s.graph and s.l2_state and s.context_ranges and s.launch_cache
    assert s.theme == "system"
    assert s.sampling_params().seed is None


def test_only_changed_samplers_are_stored(qsettings, tmp_path):
    s = load_settings(qsettings, MODEL)
    s.sampling.top_k = 40
    save_settings(qsettings, s, MODEL)
    assert qsettings.contains("sampling/top_k")
    assert not qsettings.contains("sampling/temperature")
    # another checkpoint with other defaults: untouched fields follow it, the change stays
    other = replace(MODEL, temperature=1.0, top_p=0.8)
    s2 = load_settings(open_settings(str(tmp_path / "settings.ini")), other)
    assert s2.sampling.top_k == 40 and s2.sampling.temperature == 1.0 and s2.sampling.top_p == 0.8
    # setting it back to the model's value forgets the override
    s2.sampling.top_k = 20
    save_settings(qsettings, s2, other)
    assert not qsettings.contains("sampling/top_k")


def test_round_trip_everything(qsettings, tmp_path):
    s = ChatSettings(system_prompt="Be brief.\nAlways.", sampling=replace(MODEL, temperature=0.2, min_p=0.05,
                                                                          repetition_penalty=1.1),
                     max_new_tokens=123, seed=42, context_length=8192, thinking=True, split_k=False,
                     graph=False, l2_state=False, context_ranges=False, launch_cache=False,
                     theme="dark")
    save_settings(qsettings, s, MODEL)
    back = load_settings(open_settings(str(tmp_path / "settings.ini")), MODEL)
    assert back == s
    assert back.sampling_params().seed == 42


def test_bad_values_fall_back_to_defaults(qsettings):
    for key, value in (("sampling/temperature", "warm"), ("generation/max_new_tokens", "lots"),
                       ("generation/seed", "abc"), ("engine/context_length", "-5"),
                       ("ui/theme", "purple"), ("generation/thinking", "yes")):
        qsettings.setValue(key, value)
    s = load_settings(qsettings, MODEL)
    assert s.sampling.temperature == MODEL.temperature
    assert s.max_new_tokens == DEFAULT_MAX_NEW_TOKENS and s.seed is None
    assert s.context_length == 256                          # clamped to the smallest useful size
    assert s.theme == "system" and s.thinking is True


def test_greedy_model_default_and_user_override(qsettings):
    greedy_model = replace(MODEL, greedy=True)
    assert load_settings(qsettings, greedy_model).sampling.is_greedy
    qsettings.setValue("sampling/temperature", 0.8)
    s = load_settings(qsettings, greedy_model)
    assert not s.sampling.is_greedy and s.sampling.temperature == 0.8


# ---------------------------------------------------------------- dialog

@pytest.fixture
def dialog(qtbot):
    def make(settings=None, caps=None, max_ctx=None):
        d = SettingsDialog(settings or ChatSettings(sampling=replace(MODEL)), MODEL,
                           caps if caps is not None else {"triton": False, "reason": "No CUDA GPU: reference."},
                           max_model_context=max_ctx)
        qtbot.addWidget(d)
        return d
    return make


def test_dialog_shows_and_returns_the_settings(dialog):
    s = ChatSettings(system_prompt="sys", sampling=replace(MODEL, top_k=5), max_new_tokens=77, seed=9,
                     context_length=16384, thinking=True, split_k=False, graph=True, l2_state=False,
                     context_ranges=False, launch_cache=False,
                     theme="light")
    d = dialog(s, caps={"triton": True, "device_name": "NVIDIA H200", "reason": ""})
    assert d.system_prompt.toPlainText() == "sys" and d.top_k.value() == 5
    assert d.max_new_tokens.value() == 77 and d.seed.text() == "9"
    assert d.context_length.currentData() == 16384 and d.thinking.isChecked()
    assert not d.split_k.isChecked() and d.graph.isChecked() and d.split_k.isEnabled()
    assert not d.l2_state.isChecked() and d.l2_state.isEnabled() and "L2" in d.l2_state.toolTip()
    assert (not d.context_ranges.isChecked() and d.context_ranges.isEnabled()
            and "graph per range" in d.context_ranges.toolTip())
    assert (not d.launch_cache.isChecked() and d.launch_cache.isEnabled()
            and "dispatch" in d.launch_cache.toolTip())
    assert "H200" in d.engine_note.text()
    assert d.settings() == s


def test_dialog_edits(dialog):
    d = dialog()
    d.temperature.setValue(1.3)
    d.top_p.setValue(0.5)
    d.min_p.setValue(0.1)
    d.presence_penalty.setValue(-0.5)
    d.repetition_penalty.setValue(1.2)
    d.seed.setText("")
    d.context_length.setEditText("3000")
    d.theme.setCurrentIndex(d.theme.findData("dark"))
    out = d.settings()
    assert (out.sampling.temperature, out.sampling.top_p, out.sampling.min_p) == (1.3, 0.5, 0.1)
    assert (out.sampling.presence_penalty, out.sampling.repetition_penalty) == (-0.5, 1.2)
    assert out.seed is None and out.context_length == 3000 and out.theme == "dark"
    assert not out.sampling.is_greedy
    d.temperature.setValue(0.0)
    assert d.settings().sampling.is_greedy


def test_dialog_reset_to_model_defaults(dialog):
    d = dialog(ChatSettings(sampling=replace(MODEL, temperature=1.9, top_k=3, presence_penalty=0.0)))
    d.reset_button.click()
    out = d.settings().sampling
    assert (out.temperature, out.top_k, out.top_p, out.presence_penalty) == (0.7, 20, 0.95, 1.5)


def test_triton_switches_disabled_with_the_reason(dialog):
    d = dialog()
    for box in (d.split_k, d.graph, d.l2_state, d.context_ranges, d.launch_cache):
        assert not box.isEnabled() and box.toolTip() == "No CUDA GPU: reference."
    assert d.engine_note.text() == "No CUDA GPU: reference."


def test_context_choices_capped_by_the_model(dialog):
    d = dialog(max_ctx=8192)
    values = [d.context_length.itemData(i) for i in range(d.context_length.count())]
    assert max(values) == 8192 and 2048 in values
