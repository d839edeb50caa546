"""The user's preferences, kept in QSettings (organization "tritonchat").

Sampling values the user never touched follow the checkpoint's generation defaults: only the
fields that differ from the model's recommendation are stored, so "Reset to model defaults"
just forgets them.
"""
from __future__ import annotations

from . import refcount_guard  # noqa: F401  (first: PySide6 refcount bug on Python 3.11)

from dataclasses import dataclass, field, replace

from PySide6.QtCore import QSettings

from tritonchat.engine.options import EngineOptions, SamplingParams

ORGANIZATION = "tritonchat"
APPLICATION = "tritonchat"

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "repetition_penalty")
_FLOAT_FIELDS = {"temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"}

DEFAULT_MAX_NEW_TOKENS = 4096
DEFAULT_CONTEXT = EngineOptions().max_context
CONTEXT_CHOICES = (2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)


@dataclass
class ChatSettings:
    system_prompt: str = ""
    sampling: SamplingParams = field(default_factory=SamplingParams)   # effective values
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    seed: int | None = None             # None: a fresh random seed per answer
    context_length: int = DEFAULT_CONTEXT
    thinking: bool = False              # Qwen3.5-0.8B answers without thinking by default
    split_k: bool = True
    graph: bool = True
    l2_state: bool = True               # the GDN states in a persisting L2 window (Triton, CUDA)
    context_ranges: bool = True         # kernel plans per range of positions (Triton)
    launch_cache: bool = True           # graph off: replay the step's recorded launches (Triton)
    theme: str = "system"

    def sampling_params(self) -> SamplingParams:
        """The SamplingParams for the next answer (seed included)."""
        return replace(self.sampling, seed=self.seed)


def open_settings(path: str | None = None) -> QSettings:
    """The app's QSettings; tests pass a file path (INI) to stay out of the user's settings."""
    if path:
        return QSettings(str(path), QSettings.Format.IniFormat)
    return QSettings(ORGANIZATION, APPLICATION)


def _get(qs: QSettings, key: str, default, kind):
    if not qs.contains(key):
        return default
    value = qs.value(key)
    try:
        if kind is bool:
            if isinstance(value, str):
                return value.strip().lower() in ("1", "true", "yes", "on")
            return bool(value)
        return kind(value)
    except (TypeError, ValueError):
        return default


def load_settings(qs: QSettings, model_defaults: SamplingParams | None = None) -> ChatSettings:
    base = model_defaults or SamplingParams()
    sampling = replace(base, seed=None)
    for name in SAMPLING_FIELDS:
        kind = float if name in _FLOAT_FIELDS else int
        setattr(sampling, name, _get(qs, f"sampling/{name}", getattr(base, name), kind))
    # a temperature the user set above zero means sampling even if the model default was greedy
    if qs.contains("sampling/temperature"):
        sampling.greedy = sampling.temperature <= 0.0
    seed_text = str(_get(qs, "generation/seed", "", str)).strip()
    return ChatSettings(
        system_prompt=_get(qs, "chat/system_prompt", "", str),
        sampling=sampling,
        max_new_tokens=max(1, _get(qs, "generation/max_new_tokens", DEFAULT_MAX_NEW_TOKENS, int)),
        seed=int(seed_text) if seed_text.lstrip("-").isdigit() else None,
        context_length=max(256, _get(qs, "engine/context_length", DEFAULT_CONTEXT, int)),
        thinking=_get(qs, "generation/thinking", False, bool),
        split_k=_get(qs, "engine/split_k", True, bool),
        graph=_get(qs, "engine/graph", True, bool),
        l2_state=_get(qs, "engine/l2_state", True, bool),
        context_ranges=_get(qs, "engine/context_ranges", True, bool),
        launch_cache=_get(qs, "engine/launch_cache", True, bool),
        theme=t if (t := _get(qs, "ui/theme", "system", str)) in ("system", "light", "dark") else "system",
    )


def save_settings(qs: QSettings, s: ChatSettings, model_defaults: SamplingParams | None = None) -> None:
    base = model_defaults or SamplingParams()
    for name in SAMPLING_FIELDS:
        value = getattr(s.sampling, name)
        if value == getattr(base, name):
            qs.remove(f"sampling/{name}")         # follows the model's default from now on
        else:
            qs.setValue(f"sampling/{name}", value)
    qs.setValue("chat/system_prompt", s.system_prompt)
    qs.setValue("generation/max_new_tokens", int(s.max_new_tokens))
    qs.setValue("generation/seed", "" if s.seed is None else str(int(s.seed)))
    qs.setValue("generation/thinking", bool(s.thinking))
    qs.setValue("engine/context_length", int(s.context_length))
    qs.setValue("engine/split_k", bool(s.split_k))
    qs.setValue("engine/graph", bool(s.graph))
    qs.setValue("engine/l2_state", bool(s.l2_state))
    qs.setValue("engine/context_ranges", bool(s.context_ranges))
    qs.setValue("engine/launch_cache", bool(s.launch_cache))
    qs.setValue("ui/theme", s.theme)
    qs.sync()
