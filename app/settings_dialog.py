"""Settings: system prompt, samplers, lengths, thinking, engine switches, theme.

The dialog only edits a ChatSettings copy; the main window applies the result (engine switches
through the worker's configure / set_max_context, without a restart).
"""
from __future__ import annotations

from . import refcount_guard  # noqa: F401  (first: PySide6 refcount bug on Python 3.11)

from dataclasses import replace

from PySide6.QtGui import QIntValidator
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox,
                               QFormLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton,
                               QSpinBox, QTabWidget, QVBoxLayout, QWidget)

from tritonchat.engine.options import SamplingParams

from .settings import CONTEXT_CHOICES, ChatSettings


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
                 parent: QWidget | None = None):
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
        self.top_p = _double(0.01, 1.0, 0.01, 2, "Nucleus sampling: the smallest set of tokens whose "
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
        self.split_k = QCheckBox("Split-K for the narrow projections")
        self.graph = QCheckBox("CUDA Graph for the decode step")
        self.l2_state = QCheckBox("Keep the linear-attention states in L2")
        self.context_ranges = QCheckBox("Kernel plans tuned per context length")
        self.launch_cache = QCheckBox("Without the CUDA Graph, replay the recorded kernel launches")
        triton = bool(caps.get("triton", False))
        why = caps.get("reason") or "Needs the Triton backend on a CUDA GPU."
        for box, tip in ((self.split_k, "Split the reduction of the 1024-row projections over more "
                                         "thread blocks (fills the GPU; deterministic fp32 partial sums)"),
                         (self.graph, "Replay the whole decode step as one CUDA graph (removes CPU "
                                      "launch overhead)"),
                         (self.l2_state, "Set ~20 MB of the GPU's L2 cache aside so the 18 Gated "
                                         "DeltaNet layers' recurrent states (18 MB, read and written "
                                         "every token) stay there instead of coming back from memory "
                                         "(with the CUDA graph; ~1% faster on an H200)"),
                         (self.context_ranges, "Use the decode table's other launch plans where they "
                                               "measured faster: a persistent q|k|v projection below "
                                               "1,792 tokens, a wider split of the attention from "
                                               "22,528 on (one CUDA graph per range; ~1% faster at "
                                               "short and at long contexts on an H200)"),
                         (self.launch_cache, "With the CUDA Graph off, record the decode step's "
                                             "~120 kernel launches once and then launch them "
                                             "straight from that record, instead of through "
                                             "Triton's Python dispatch each token (~7-10x faster "
                                             "without the graph on an H200; off shows what the "
                                             "dispatch costs)")):
            box.setEnabled(triton)
            box.setToolTip(tip if triton else why)
        self.engine_note = QLabel(why if not triton else (f"Triton backend on {caps.get('device_name')}"
                                                            if caps.get("device_name") else "Triton backend"))
        self.engine_note.setObjectName("MutedLabel")
        self.engine_note.setWordWrap(True)
        f.addRow("Context length", self.context_length)
        f.addRow("", self.split_k)
        f.addRow("", self.graph)
        f.addRow("", self.l2_state)
        f.addRow("", self.context_ranges)
        f.addRow("", self.launch_cache)
        f.addRow("", self.engine_note)
        tabs.addTab(engine, "Engine")

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
        self.split_k.setChecked(s.split_k)
        self.graph.setChecked(s.graph)
        self.l2_state.setChecked(s.l2_state)
        self.context_ranges.setChecked(s.context_ranges)
        self.launch_cache.setChecked(s.launch_cache)
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

    def _context(self) -> int:
        text = self.context_length.currentText().strip()
        try:
            return max(256, int(text))
        except ValueError:
            return self._original.context_length

    def settings(self) -> ChatSettings:
        """The edited settings (the dialog's fields as a ChatSettings)."""
        temperature = round(self.temperature.value(), 4)
        sampling = replace(self._original.sampling, temperature=temperature,
                           top_k=int(self.top_k.value()), top_p=round(self.top_p.value(), 4),
                           min_p=round(self.min_p.value(), 4),
                           presence_penalty=round(self.presence_penalty.value(), 4),
                           repetition_penalty=round(self.repetition_penalty.value(), 4),
                           greedy=temperature <= 0.0, seed=None)
        seed = self.seed.text().strip()
        return ChatSettings(
            system_prompt=self.system_prompt.toPlainText(),
            sampling=sampling,
            max_new_tokens=int(self.max_new_tokens.value()),
            seed=int(seed) if seed else None,
            context_length=self._context(),
            thinking=self.thinking.isChecked(),
            split_k=self.split_k.isChecked(),
            graph=self.graph.isChecked(),
            l2_state=self.l2_state.isChecked(),
            context_ranges=self.context_ranges.isChecked(),
            launch_cache=self.launch_cache.isChecked(),
            theme=self.theme.currentData() or "system",
        )
