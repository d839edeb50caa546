"""Preferences in QSettings and the settings dialog."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tritonchat.app.settings import (DEFAULT_CONTEXT, DEFAULT_MAX_NEW_TOKENS, ChatSettings,
                                     load_settings, open_settings, save_settings)
from tritonchat.app.settings_dialog import SettingsDialog
from tritonchat.engine.options import SCOPE_REASON, SamplingParams, switch_fields

MODEL = SamplingParams(temperature=0.7, top_k=20, top_p=0.95, min_p=0.0, presence_penalty=1.5,
                       repetition_penalty=1.0)


def test_fresh_settings_follow_the_model(qsettings):
    s = load_settings(qsettings, MODEL)
    assert s.sampling == MODEL
    assert s.system_prompt == "" and s.seed is None and s.thinking is False
    assert s.max_new_tokens == DEFAULT_MAX_NEW_TOKENS and s.context_length == DEFAULT_CONTEXT
    assert s.engine == {f.name: f.default for f in switch_fields() if f.name != "timing"}
    assert s.model == "" and s.recent_models == []
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
                     max_new_tokens=123, seed=42, context_length=8192, thinking=True,
                     engine={f.name: not f.default for f in switch_fields() if f.name != "timing"},
                     theme="dark", model="/models/a", recent_models=["/models/a", "/models/b"])
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
    engine = dict(ChatSettings().engine, split_k=False, graph=True, l2_state=False,
                  context_ranges=False, launch_cache=False)
    s = ChatSettings(system_prompt="sys", sampling=replace(MODEL, top_k=5), max_new_tokens=77, seed=9,
                     context_length=16384, thinking=True, engine=engine, theme="light")
    d = dialog(s, caps={"triton": True, "cuda": True, "device_name": "NVIDIA H200", "reason": "",
                        "backend": "triton", "device": "cuda"})
    sw = d.switches
    assert d.system_prompt.toPlainText() == "sys" and d.top_k.value() == 5
    assert d.max_new_tokens.value() == 77 and d.seed.text() == "9"
    assert d.context_length.currentData() == 16384 and d.thinking.isChecked()
    assert not sw["split_k"].isChecked() and sw["graph"].isChecked() and sw["split_k"].isEnabled()
    assert not sw["l2_state"].isChecked() and sw["l2_state"].isEnabled() and "L2" in sw["l2_state"].toolTip()
    assert not sw["context_ranges"].isChecked() and sw["context_ranges"].isEnabled()
    # with the graph on, the launch cache (graph off only) does not apply: greyed, choice kept
    assert not sw["launch_cache"].isEnabled() and SCOPE_REASON["no_graph"] in sw["launch_cache"].toolTip()
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
    for box in d.switches.values():
        assert not box.isEnabled() and not box.isChecked()
        assert box.toolTip().startswith("Not applicable: ")
    assert SCOPE_REASON["triton"] in d.switches["split_k"].toolTip()
    assert d.engine_note.text() == "No CUDA GPU: reference."
    # greyed boxes read unchecked but the stored choices come back unchanged
    assert d.settings().engine == ChatSettings().engine


def test_context_choices_capped_by_the_model(dialog):
    d = dialog(max_ctx=8192)
    values = [d.context_length.itemData(i) for i in range(d.context_length.count())]
    assert max(values) == 8192 and 2048 in values


# ---------------------------------------------------------------- generated from the options

GPU = {"triton": True, "cuda": True, "device_name": "NVIDIA H100", "reason": "", "backend": "triton",
       "device": "cuda"}


def test_switches_are_generated_from_the_options(dialog):
    d = dialog(caps=GPU)
    fields = [f for f in switch_fields() if f.name != "timing"]
    assert list(d.switches) == [f.name for f in fields]
    for f in fields:
        box = d.switches[f.name]
        assert box.text() == f.metadata["label"]
        if box.isEnabled():
            assert f.metadata["help"][1:40] in box.toolTip()
            if f.metadata["measured"]:
                assert f.metadata["measured"] in box.toolTip()
    # the graph-only switch follows the graph box
    d.switches["graph"].setChecked(False)
    assert not d.switches["l2_state"].isEnabled() and d.switches["launch_cache"].isEnabled()


def test_split_k_note_when_it_changes_nothing(dialog):
    d = dialog(caps=dict(GPU, split_k_note="split-K: no shape splits on this GPU"))
    assert not d.split_k_note.isHidden() and "no shape splits" in d.split_k_note.text()
    assert "no shape splits" in d.switches["split_k"].toolTip()
    assert dialog(caps=GPU).split_k_note.isHidden()


def test_old_switch_keys_are_migrated(qsettings):
    qsettings.setValue("engine/split_k", False)
    qsettings.setValue("engine/launch_cache", "false")
    s = load_settings(qsettings, MODEL)
    assert s.engine["split_k"] is False and s.engine["launch_cache"] is False and s.engine["graph"]
    save_settings(qsettings, s, MODEL)
    assert not qsettings.contains("engine/split_k")
    assert qsettings.value("engine/switches/split_k") in (False, "false")
    assert load_settings(qsettings, MODEL).engine == s.engine


def test_invalid_sampling_in_the_file_is_logged_and_dropped(qsettings, caplog):
    qsettings.setValue("sampling/top_p", 5.0)
    qsettings.setValue("sampling/repetition_penalty", -1)
    qsettings.setValue("sampling/top_k", 40)
    with caplog.at_level("WARNING", logger="tritonchat.settings"):
        s = load_settings(qsettings, MODEL)
    assert s.sampling.top_p == MODEL.top_p and s.sampling.repetition_penalty == MODEL.repetition_penalty
    assert s.sampling.top_k == 40
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and any("sampling/top_p" in ln and "(0, 1]" in ln for ln in lines)


def test_dialog_says_why_a_sampling_value_is_refused(dialog):
    from PySide6.QtWidgets import QDialogButtonBox

    d = dialog()
    ok = d.buttons.button(QDialogButtonBox.StandardButton.Ok)
    assert d.sampling_error.isHidden() and ok.isEnabled()
    d.top_p.setValue(0.0)
    assert not d.sampling_error.isHidden() and not ok.isEnabled()
    assert d.sampling_error.text().startswith("Top-p must be in (0, 1]")
    d.top_p.setValue(0.9)
    assert d.sampling_error.isHidden() and ok.isEnabled()


def test_model_picker(dialog, tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    (good / "config.json").write_text("{}")
    d = dialog(ChatSettings(sampling=replace(MODEL), model="", recent_models=["/old/one"]))
    items = [d.model_choice.itemData(i) for i in range(d.model_choice.count())]
    assert items[0] == "" and "/old/one" in items and d.chosen_model() == ""
    d.ask_folder = lambda: str(tmp_path)                  # no config.json: refused
    d._model_activated(d.model_choice.count() - 1)
    assert d.chosen_model() == "" and "not a model folder" in d.model_note.text()
    d.ask_folder = lambda: str(good)
    d._model_activated(d.model_choice.count() - 1)
    out = d.settings()
    assert out.model == str(good) and out.recent_models[:2] == [str(good), "/old/one"]


# ---------------------------------------------------------------- the decode mode (issue #59)

def test_decode_mode_is_stored_and_restored(qsettings, tmp_path):
    s = load_settings(qsettings, MODEL)
    assert s.engine_choices == {"decode_mode": "per_op"} and s.engine_settings()["decode_mode"] == "per_op"
    s.engine_choices["decode_mode"] = "persistent"
    save_settings(qsettings, s, MODEL)
    back = load_settings(open_settings(str(tmp_path / "settings.ini")), MODEL)
    assert back.engine_choices == {"decode_mode": "persistent"} and back == s
    assert back.engine_settings() == {**back.engine, "decode_mode": "persistent"}


def test_a_decode_mode_the_engine_lacks_is_logged_and_dropped(qsettings, caplog):
    qsettings.setValue("engine/choices/decode_mode", "megakernel")
    with caplog.at_level("WARNING", logger="tritonchat.settings"):
        s = load_settings(qsettings, MODEL)
    assert s.choice("decode_mode") == "per_op"
    assert "megakernel" in caplog.text and "per_op, persistent" in caplog.text


def test_decode_mode_drop_down_beside_the_switches(dialog):
    from tritonchat.engine.options import choice_fields
    d = dialog(caps=GPU)
    (f,) = [c for c in choice_fields() if c.name == "decode_mode"]
    combo = d.choices["decode_mode"]
    assert [combo.itemData(i) for i in range(combo.count())] == list(f.metadata["choices"])
    assert combo.isEnabled() and combo.currentData() == "per_op"
    assert f.metadata["help"][1:40] in combo.toolTip() and "NVIDIA H100" in combo.toolTip()
    # labelled from the metadata, in the engine form with the switches
    form = combo.parentWidget().layout()
    assert form.labelForField(combo).text() == f.metadata["label"]
    assert d.switches["split_k"].parentWidget() is combo.parentWidget()
    combo.setCurrentIndex(combo.findData("persistent"))
    combo.activated.emit(combo.currentIndex())
    assert d.settings().engine_choices == {"decode_mode": "persistent"}
    # shown again from stored settings
    d2 = dialog(ChatSettings(sampling=replace(MODEL), engine_choices={"decode_mode": "persistent"}), caps=GPU)
    assert d2.choices["decode_mode"].currentData() == "persistent"
    assert d2.settings().engine_choices == {"decode_mode": "persistent"}


def test_decode_mode_greyed_on_the_reference_engine(dialog):
    d = dialog(ChatSettings(sampling=replace(MODEL), engine_choices={"decode_mode": "persistent"}))
    combo = d.choices["decode_mode"]
    assert not combo.isEnabled() and combo.currentData() == "per_op"
    assert combo.toolTip() == f"Not applicable: {SCOPE_REASON['triton']}."
    assert d.settings().engine_choices == {"decode_mode": "persistent"}     # the choice is kept
    # the Triton engine under the interpreter (CPU) has it
    assert dialog(caps={"triton": True, "backend": "triton", "device": "cpu"}).choices["decode_mode"].isEnabled()


def test_decode_mode_fallback_shows_the_mode_running_and_why(dialog):
    why = ("The persistent decode step cannot run here: its grid of 264 programs cannot be resident "
           "at once; decoding per operator.")
    stored = ChatSettings(sampling=replace(MODEL), engine_choices={"decode_mode": "persistent"})
    d = SettingsDialog(stored, MODEL, dict(GPU, decode_mode_error=why),
                       running={"backend": "triton", "decode_mode": "per_op"})
    combo = d.choices["decode_mode"]
    assert combo.currentData() == "per_op" and why in combo.toolTip()
    assert not d.decode_mode_note.isHidden() and d.decode_mode_note.text() == why
    assert d.settings().engine_choices == {"decode_mode": "persistent"}   # untouched: the wish stays
    combo.setCurrentIndex(combo.findData("per_op"))
    combo.activated.emit(combo.currentIndex())                        # chosen: the note is gone
    assert d.decode_mode_note.isHidden() and why not in combo.toolTip()
    assert d.settings().engine_choices == {"decode_mode": "per_op"}
    d.deleteLater()
    # without a fallback the stored choice shows, whatever the last report said
    d = dialog(stored, caps=GPU)
    assert d.choices["decode_mode"].currentData() == "persistent" and d.decode_mode_note.isHidden()
