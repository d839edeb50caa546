"""Settings: system prompt, samplers, lengths, thinking, engine switches, model, theme.

The dialog only edits a ChatSettings copy; the main window applies the result (engine switches
through the worker's configure / set_max_context, without a restart). The engine tab is built
from EngineOptions' switch fields (label, help, measured figure, scope) and its named-value
fields (decode_mode: a drop-down): a setting that does not apply to the running engine is shown
off (a switch unchecked, a drop-down at its default) and greyed with the reason, and keeps the
stored choice for an engine where it does. Where the engine runs another value than the one
stored (persistent decode fell back: `decode_mode_error` in the capabilities), the drop-down
shows the value running and the engine's sentence says why.
"""
from __future__ import annotations

from . import refcount_guard  # noqa: F401  (first: PySide6 refcount bug on Python 3.11)

import re
from dataclasses import replace
from pathlib import Path

from PySide6.QtGui import QIntValidator
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox,
                               QFileDialog, QFormLayout, QLabel, QLineEdit, QPlainTextEdit,
                               QPushButton, QSpinBox, QTabWidget, QVBoxLayout, QWidget)

from tritonchat.engine.options import SCOPE_REASON, EngineOptions, OptionError, SamplingParams

from .settings import CONTEXT_CHOICES, ChatSettings, engine_choice_fields, engine_switch_fields

DEFAULT_MODEL_LABEL = "Qwen/Qwen3.5-0.8B (downloaded from Hugging Face)"
CHOOSE_FOLDER = "\x00choose"          # the picker's last item: opens a folder dialog
_FLAG_LABELS = {"--temperature": "Temperature", "--top-k": "Top-k", "--top-p": "Top-p",
                "--min-p": "Min-p", "--presence-penalty": "Presence penalty",
                "--repetition-penalty": "Repetition penalty"}


def switch_tooltip(f, device_name: str = "") -> str:
    """What the switch does and, where the field records one, what it measured."""
    text = f.metadata["help"]
    text = text[:1].upper() + text[1:] + "."
    if f.metadata.get("measured"):
        text += f" Measured: {f.metadata['measured']}."
    if device_name:
        text += f" Running on {device_name}."
    return text


def sampling_sentence(error: OptionError) -> str:
    """OptionError's sentence with the field's label where it names the CLI flag."""
    return re.sub(r"--[a-z-]+", lambda m: _FLAG_LABELS.get(m.group(0), m.group(0)), str(error))


def _double(lo: float, hi: float, step: float, decimals: int, tip: str) -> QDoubleSpinBox:
    w = QDoubleSpinBox()
    w.setRange(lo, hi)
    w.setSingleStep(step)
    w.setDecimals(decimals)
    w.setToolTip(tip)
    return w


class SettingsDialog(QDialog):
    def __init__(self, settings: ChatSettings, model_defaults: SamplingParams,
                 capabilities: dict | None = None, max_model_context: int | None = None,
                 parent: QWidget | None = None, running: dict | None = None):
        """running: the options the engine runs now (the worker's report), where they are known:
        a drop-down shows the value running when the engine fell back from the stored one."""
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.setMinimumWidth(480)
        self._original = settings
        self._defaults = model_defaults
        caps = capabilities or {}

        tabs = QTabWidget(self)

        # --- chat ---
        chat = QWidget()
        f = QFormLayout(chat)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("e.g. You are a concise assistant.")
        self.system_prompt.setToolTip("Sent as the first (system) message of every conversation")
        self.system_prompt.setMinimumHeight(90)
        self.thinking = QCheckBox("Think before answering")
        self.thinking.setToolTip("Let Qwen3.5 reason in a <think> block first (slower, often better "
                                 "for maths and code); the reasoning is shown folded above the answer")
        self.max_new_tokens = QSpinBox()
        self.max_new_tokens.setRange(1, 262144)
        self.max_new_tokens.setSingleStep(256)
        self.max_new_tokens.setToolTip("The longest answer (thinking included) in tokens")
        self.seed = QLineEdit()
        self.seed.setValidator(QIntValidator(0, 2**31 - 1))
        self.seed.setPlaceholderText("random")
        self.seed.setToolTip("A fixed seed repeats the same answer for the same prompt; empty = random")
        f.addRow("System prompt", self.system_prompt)
        f.addRow("", self.thinking)
        f.addRow("Max new tokens", self.max_new_tokens)
        f.addRow("Seed", self.seed)
        tabs.addTab(chat, "Chat")

        # --- sampling ---
        sampling = QWidget()
        f = QFormLayout(sampling)
        self.temperature = _double(0.0, 2.0, 0.05, 2, "Randomness; 0 = always the most likely token (greedy)")
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 1000)
        self.top_k.setSpecialValueText("off")
        self.top_k.setToolTip("Sample among the k most likely tokens only; 0 = off")
        self.top_p = _double(0.0, 1.0, 0.01, 2, "Nucleus sampling: the smallest set of tokens whose "
                                                  "probabilities sum to p; 1 = off")
        self.min_p = _double(0.0, 1.0, 0.01, 2, "Drop tokens less likely than min_p x the top token's "
                                                 "probability; 0 = off")
        self.presence_penalty = _double(-2.0, 2.0, 0.1, 2, "Subtracted from the logit of every token already "
                                                            "generated: discourages repeating topics")
        self.repetition_penalty = _double(0.5, 2.0, 0.05, 2, "Divides positive (multiplies negative) "
                                                              "logits of tokens seen before; 1 = off")
        f.addRow("Temperature", self.temperature)
        f.addRow("Top-k", self.top_k)
        f.addRow("Top-p", self.top_p)
        f.addRow("Min-p", self.min_p)
        f.addRow("Presence penalty", self.presence_penalty)
        f.addRow("Repetition penalty", self.repetition_penalty)
        self.reset_button = QPushButton("Reset to model defaults")
        self.reset_button.setToolTip("Use the values recommended in the checkpoint's generation_config.json")
        self.reset_button.clicked.connect(self.reset_sampling)
        f.addRow("", self.reset_button)
        self.sampling_error = QLabel()
        self.sampling_error.setObjectName("ErrorLabel")
        self.sampling_error.setStyleSheet("color: #b3261e;")
        self.sampling_error.setWordWrap(True)
        self.sampling_error.hide()
        f.addRow("", self.sampling_error)
        for w in (self.temperature, self.top_k, self.top_p, self.min_p, self.presence_penalty,
                  self.repetition_penalty):
            w.valueChanged.connect(self._check_sampling)
        tabs.addTab(sampling, "Sampling")

        # --- engine ---
        engine = QWidget()
        f = QFormLayout(engine)
        self.context_length = QComboBox()
        self.context_length.setEditable(True)
        self.context_length.lineEdit().setValidator(QIntValidator(256, 1 << 20))
        choices = [c for c in CONTEXT_CHOICES if max_model_context is None or c <= max_model_context]
        for c in choices:
            self.context_length.addItem(f"{c}", c)
        self.context_length.setToolTip("Tokens the conversation can hold (prompt + answers); a larger "
                                       "context uses more memory. Applied without a restart.")
        f.addRow("Context length", self.context_length)
        self._caps = caps
        self._engine_kind = EngineOptions(
            backend=caps.get("backend") or ("triton" if caps.get("triton") else "reference"),
            device=caps.get("device") or ("cuda" if caps.get("triton") and caps.get("cuda") else "cpu"))
        self._running = dict(running or {})
        self.choices: dict[str, QComboBox] = {}
        self._stored_choices: dict[str, str] = dict(settings.engine_choices)   # behind a greyed one
        for ch in engine_choice_fields():
            combo = QComboBox()
            combo.setObjectName(f"choice_{ch.name}")
            for value in ch.metadata["choices"]:
                combo.addItem(value, value)
            self.choices[ch.name] = combo
            f.addRow(ch.metadata["label"], combo)
            combo.activated.connect(lambda _i, name=ch.name: self._choice_activated(name))
        self._fallback = str(caps.get("decode_mode_error") or "")    # the engine's sentence
        self.decode_mode_note = QLabel(self._fallback)
        self.decode_mode_note.setObjectName("MutedLabel")
        self.decode_mode_note.setWordWrap(True)
        self.decode_mode_note.setVisible(bool(self._fallback))
        f.addRow("", self.decode_mode_note)
        self.switches: dict[str, QCheckBox] = {}
        self._stored: dict[str, bool] = dict(settings.engine)   # the choice behind a greyed box
        for sw in engine_switch_fields():
            box = QCheckBox(sw.metadata["label"])
            box.setObjectName(f"switch_{sw.name}")
            self.switches[sw.name] = box
            f.addRow("", box)
            box.toggled.connect(lambda on, name=sw.name: self._switch_toggled(name, on))
        self.split_k_note = QLabel(caps.get("split_k_note") or "")
        self.split_k_note.setObjectName("MutedLabel")
        self.split_k_note.setWordWrap(True)
        self.split_k_note.setVisible(bool(caps.get("split_k_note")))
        f.addRow("", self.split_k_note)
        triton = self._engine_kind.backend == "triton"
        why = caps.get("reason") or SCOPE_REASON["triton"]
        self.engine_note = QLabel(why if not triton else (f"Triton backend on {caps.get('device_name')}"
                                                            if caps.get("device_name") else "Triton backend"))
        self.engine_note.setObjectName("MutedLabel")
        self.engine_note.setWordWrap(True)
        f.addRow("", self.engine_note)
        tabs.addTab(engine, "Engine")

        # --- model ---
        model = QWidget()
        f = QFormLayout(model)
        self.model_choice = QComboBox()
        self.model_choice.setToolTip("The model the app opens: the default one from the Hugging Face "
                                     "hub, or a folder on disk holding config.json and *.safetensors")
        self.model_note = QLabel("A different model is loaded when you press OK.")
        self.model_note.setObjectName("MutedLabel")
        self.model_note.setWordWrap(True)
        f.addRow("Model", self.model_choice)
        f.addRow("", self.model_note)
        self._fill_models(settings.model, settings.recent_models)
        self.model_choice.activated.connect(self._model_activated)
        tabs.addTab(model, "Model")

        # --- appearance ---
        appearance = QWidget()
        f = QFormLayout(appearance)
        self.theme = QComboBox()
        for value, label in (("system", "Follow the system"), ("light", "Light"), ("dark", "Dark")):
            self.theme.addItem(label, value)
        f.addRow("Theme", self.theme)
        tabs.addTab(appearance, "Appearance")

        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(tabs)
        layout.addWidget(buttons)
        self.tabs = tabs
        self.buttons = buttons
        self.load(settings)

    def load(self, s: ChatSettings) -> None:
        self.system_prompt.setPlainText(s.system_prompt)
        self.thinking.setChecked(s.thinking)
        self.max_new_tokens.setValue(int(s.max_new_tokens))
        self.seed.setText("" if s.seed is None else str(s.seed))
        self._load_sampling(s.sampling)
        i = self.context_length.findData(int(s.context_length))
        if i >= 0:
            self.context_length.setCurrentIndex(i)
        else:
            self.context_length.setEditText(str(int(s.context_length)))
        self._stored = dict(s.engine)
        self._stored_choices = {f.name: s.choice(f.name) for f in engine_choice_fields()}
        for name, box in self.switches.items():
            box.setChecked(s.switch(name))
        self._update_scopes()
        self.theme.setCurrentIndex(max(0, self.theme.findData(s.theme)))

    def _load_sampling(self, p: SamplingParams) -> None:
        self.temperature.setValue(0.0 if p.greedy else p.temperature)
        self.top_k.setValue(int(p.top_k))
        self.top_p.setValue(p.top_p)
        self.min_p.setValue(p.min_p)
        self.presence_penalty.setValue(p.presence_penalty)
        self.repetition_penalty.setValue(p.repetition_penalty)

    def reset_sampling(self) -> None:
        self._load_sampling(self._defaults)

    def _sampling_values(self) -> SamplingParams:
        temperature = round(self.temperature.value(), 4)
        return replace(self._original.sampling, temperature=temperature,
                       top_k=int(self.top_k.value()), top_p=round(self.top_p.value(), 4),
                       min_p=round(self.min_p.value(), 4),
                       presence_penalty=round(self.presence_penalty.value(), 4),
                       repetition_penalty=round(self.repetition_penalty.value(), 4),
                       greedy=temperature <= 0.0, seed=None)

    def _check_sampling(self, *_) -> bool:
        """SamplingParams.validate() on the fields: its sentence under them, OK off meanwhile."""
        try:
            self._sampling_values().validate()
            message = ""
        except OptionError as e:
            message = sampling_sentence(e)
        self.sampling_error.setText(message)
        self.sampling_error.setVisible(bool(message))
        ok = getattr(self, "buttons", None)
        if ok is not None:
            ok.button(QDialogButtonBox.StandardButton.Ok).setEnabled(not message)
        return not message

    # ---- engine switches
    def _options_now(self) -> EngineOptions:
        graph = self.switches["graph"].isChecked() if "graph" in self.switches else True
        return replace(self._engine_kind, graph=graph)

    def _switch_toggled(self, name: str, on: bool) -> None:
        if self.switches[name].isEnabled():
            self._stored[name] = on
        if name == "graph":
            self._update_scopes()

    def _choice_activated(self, name: str) -> None:
        """The user picked a value: it is the stored choice from now on (a fallback note about
        the value the engine could not run no longer describes this choice)."""
        self._stored_choices[name] = str(self.choices[name].currentData())
        if name == "decode_mode":
            self._fallback = ""
            self.decode_mode_note.hide()
        self._update_scopes()

    def _shown_choice(self, f) -> str:
        """The value a drop-down shows: the stored one, or the one running where the engine
        fell back from it (the reason is in the tooltip and the note)."""
        stored = self._stored_choices.get(f.name, f.default)
        running = self._running.get(f.name)
        if f.name == "decode_mode" and self._fallback and running in f.metadata["choices"]:
            return running
        return stored

    def _update_scopes(self) -> None:
        """Grey out (unchecked or at its default, with the reason) each switch and drop-down
        outside the engine's scope."""
        options = self._options_now()
        device = self._caps.get("device_name") or ""
        for f in engine_choice_fields():
            combo = self.choices[f.name]
            applies = options.applies(f.name)
            combo.blockSignals(True)
            combo.setEnabled(applies)
            combo.setCurrentIndex(max(0, combo.findData(self._shown_choice(f) if applies else f.default)))
            combo.blockSignals(False)
            if applies:
                tip = switch_tooltip(f, device)
                if f.name == "decode_mode" and self._fallback:
                    tip += f" {self._fallback}"
            else:
                tip = f"Not applicable: {SCOPE_REASON[f.metadata['scope']]}."
            combo.setToolTip(tip)
        for f in engine_switch_fields():
            box = self.switches[f.name]
            applies = options.applies(f.name)
            box.blockSignals(True)
            box.setEnabled(applies)
            box.setChecked(bool(self._stored.get(f.name, f.default)) if applies else False)
            box.blockSignals(False)
            if applies:
                tip = switch_tooltip(f, device)
                if f.name == "split_k" and self._caps.get("split_k_note"):
                    tip += f" {self._caps['split_k_note']}."
            else:
                tip = f"Not applicable: {SCOPE_REASON[f.metadata['scope']]}."
            box.setToolTip(tip)

    # ---- model
    def _fill_models(self, current: str, recent: list[str]) -> None:
        self.model_choice.clear()
        self.model_choice.addItem(DEFAULT_MODEL_LABEL, "")
        for folder in dict.fromkeys(([current] if current else []) + list(recent)):
            self.model_choice.addItem(folder, folder)
        self.model_choice.addItem("Choose a folder\u2026", CHOOSE_FOLDER)
        self.model_choice.setCurrentIndex(max(0, self.model_choice.findData(current)))
        self._model_index = self.model_choice.currentIndex()

    def ask_folder(self) -> str:
        """The folder dialog (tests replace it)."""
        return QFileDialog.getExistingDirectory(self, "Folder with the model's files")

    def _model_activated(self, index: int) -> None:
        if self.model_choice.itemData(index) != CHOOSE_FOLDER:
            self._model_index = index
            self.model_note.setText("A different model is loaded when you press OK.")
            return
        folder = self.ask_folder()
        if folder and not (Path(folder) / "config.json").is_file():
            self.model_note.setText(f"{folder} is not a model folder: it has no config.json.")
            folder = ""
        if not folder:
            self.model_choice.setCurrentIndex(self._model_index)
            return
        i = self.model_choice.findData(folder)
        if i < 0:
            self.model_choice.insertItem(1, folder, folder)
            i = 1
        self.model_choice.setCurrentIndex(i)
        self._model_index = i
        self.model_note.setText("A different model is loaded when you press OK.")

    def chosen_model(self) -> str:
        data = self.model_choice.currentData()
        return "" if data in (None, CHOOSE_FOLDER) else str(data)

    def _context(self) -> int:
        text = self.context_length.currentText().strip()
        try:
            return max(256, int(text))
        except ValueError:
            return self._original.context_length

    def settings(self) -> ChatSettings:
        """The edited settings (the dialog's fields as a ChatSettings)."""
        seed = self.seed.text().strip()
        model = self.chosen_model()
        recent = list(dict.fromkeys(([model] if model else []) + list(self._original.recent_models)))
        return ChatSettings(
            system_prompt=self.system_prompt.toPlainText(),
            sampling=self._sampling_values(),
            max_new_tokens=int(self.max_new_tokens.value()),
            seed=int(seed) if seed else None,
            context_length=self._context(),
            thinking=self.thinking.isChecked(),
            engine={f.name: bool(self._stored.get(f.name, f.default)) for f in engine_switch_fields()},
            engine_choices={f.name: str(self._stored_choices.get(f.name, f.default))
                            for f in engine_choice_fields()},
            theme=self.theme.currentData() or "system",
            model=model,
            recent_models=recent,
        )
