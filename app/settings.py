"""The user's preferences, kept in QSettings (organization "tritonchat").

Sampling values the user never touched follow the checkpoint's generation defaults: only the
fields that differ from the model's recommendation are stored, so "Reset to model defaults"
just forgets them.
"""
from __future__ import annotations

from . import refcount_guard  # noqa: F401  (first: PySide6 refcount bug on Python 3.11)

import logging
from dataclasses import dataclass, field, replace

from PySide6.QtCore import QSettings

from tritonchat.engine.options import (EngineOptions, OptionError, SamplingParams, choice_fields,
                                       switch_fields)

log = logging.getLogger("tritonchat.settings")

ORGANIZATION = "tritonchat"
APPLICATION = "tritonchat"

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "repetition_penalty")
_FLOAT_FIELDS = {"temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"}

DEFAULT_MAX_NEW_TOKENS = 4096
DEFAULT_CONTEXT = EngineOptions().max_context
CONTEXT_CHOICES = (2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
MAX_RECENT_MODELS = 8
# the timing switch follows the timing panel (open = on), it is no preference of its own
PANEL_SWITCHES = ("timing",)


def engine_switch_fields() -> list:
    """The EngineOptions switches the settings keep and the dialog shows, in their order."""
    return [f for f in switch_fields() if f.name not in PANEL_SWITCHES]


def default_switches() -> dict[str, bool]:
    return {f.name: bool(f.default) for f in engine_switch_fields()}


def engine_choice_fields() -> list:
    """The EngineOptions settings of named values (decode_mode) the settings keep and the
    dialog shows as drop-downs."""
    return choice_fields()


def default_choices() -> dict[str, str]:
    return {f.name: str(f.default) for f in engine_choice_fields()}


@dataclass
class ChatSettings:
    system_prompt: str = ""
    sampling: SamplingParams = field(default_factory=SamplingParams)   # effective values
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    seed: int | None = None             # None: a fresh random seed per answer
    context_length: int = DEFAULT_CONTEXT
    thinking: bool = False              # Qwen3.5-0.8B answers without thinking by default
    # the engine switches by EngineOptions field name (options.switch_fields), timing excluded
    engine: dict[str, bool] = field(default_factory=default_switches)
    # the engine's named-value settings by field name (options.choice_fields: decode_mode)
    engine_choices: dict[str, str] = field(default_factory=default_choices)
    theme: str = "system"
    model: str = ""                     # "" = the default hub model, else a model folder
    recent_models: list[str] = field(default_factory=list)    # folders used before, newest first

    def sampling_params(self) -> SamplingParams:
        """The SamplingParams for the next answer (seed included)."""
        return replace(self.sampling, seed=self.seed)

    def switch(self, name: str) -> bool:
        return bool(self.engine.get(name, default_switches().get(name, False)))

    def choice(self, name: str) -> str:
        return str(self.engine_choices.get(name, default_choices()[name]))

    def engine_settings(self) -> dict:
        """Every engine switch and named-value setting by field name: what the engine is asked
        for at load and by configure."""
        return {**self.engine, **{f.name: self.choice(f.name) for f in engine_choice_fields()}}


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


def _engine_switches(qs: QSettings) -> dict[str, bool]:
    """engine/switches/<field> for each switch; the old flat keys (engine/split_k, ...) are
    read when the new one is absent, so an older settings file keeps its choices."""
    out = {}
    for f in engine_switch_fields():
        new, old = f"engine/switches/{f.name}", f"engine/{f.name}"
        key = new if qs.contains(new) else old
        out[f.name] = _get(qs, key, bool(f.default), bool)
    return out


def _engine_choices(qs: QSettings) -> dict[str, str]:
    """engine/choices/<field> for each named-value setting; a value the field does not offer
    is dropped for its default with one logged sentence."""
    out = {}
    for f in engine_choice_fields():
        key = f"engine/choices/{f.name}"
        value = str(_get(qs, key, f.default, str))
        if value not in f.metadata["choices"]:
            log.warning("The settings file holds %s = %r, which is not one of %s; %r is used.",
                        key, value, ", ".join(f.metadata["choices"]), f.default)
            value = f.default
        out[f.name] = value
    return out


def _sampling(qs: QSettings, base: SamplingParams) -> tuple[SamplingParams, set[str]]:
    """The stored sampling values over the model's; a value SamplingParams.validate() refuses
    is dropped for the model's default with one logged sentence."""
    sampling = replace(base, seed=None)
    stored: set[str] = set()
    for name in SAMPLING_FIELDS:
        kind = float if name in _FLOAT_FIELDS else int
        key = f"sampling/{name}"
        value = _get(qs, key, None, kind)
        if value is None:
            if qs.contains(key):
                log.warning("The settings file holds %s = %r, which is not a number; the model's "
                            "default %r is used.", key, qs.value(key), getattr(base, name))
            continue
        trial = replace(sampling, **{name: value})
        try:
            trial.validate()
        except OptionError as e:
            log.warning("The settings file holds %s = %r (%s); the model's default %r is used.",
                        key, value, str(e).rstrip("."), getattr(base, name))
            continue
        sampling = trial
        stored.add(name)
    return sampling, stored


def load_model_choice(qs: QSettings) -> str:
    """The model chosen in Settings: "" for the default hub model, else a folder."""
    return str(_get(qs, "model/path", "", str) or "").strip()


def _recent(qs: QSettings) -> list[str]:
    value = qs.value("model/recent") if qs.contains("model/recent") else []
    if isinstance(value, str):
        value = [value] if value else []
    return [str(v) for v in (value or []) if str(v).strip()][:MAX_RECENT_MODELS]


def remember_model(qs: QSettings, folder: str) -> None:
    """Use this folder from the next launch on and put it first among the recent ones."""
    folder = str(folder)
    qs.setValue("model/path", folder)
    qs.setValue("model/recent", [folder] + [r for r in _recent(qs) if r != folder][: MAX_RECENT_MODELS - 1])
    qs.sync()


def load_settings(qs: QSettings, model_defaults: SamplingParams | None = None) -> ChatSettings:
    base = model_defaults or SamplingParams()
    sampling, stored = _sampling(qs, base)
    # a temperature the user set above zero means sampling even if the model default was greedy
    if "temperature" in stored:
        sampling.greedy = sampling.temperature <= 0.0
    seed_text = str(_get(qs, "generation/seed", "", str)).strip()
    return ChatSettings(
        system_prompt=_get(qs, "chat/system_prompt", "", str),
        sampling=sampling,
        max_new_tokens=max(1, _get(qs, "generation/max_new_tokens", DEFAULT_MAX_NEW_TOKENS, int)),
        seed=int(seed_text) if seed_text.lstrip("-").isdigit() else None,
        context_length=max(256, _get(qs, "engine/context_length", DEFAULT_CONTEXT, int)),
        thinking=_get(qs, "generation/thinking", False, bool),
        engine=_engine_switches(qs),
        engine_choices=_engine_choices(qs),
        theme=t if (t := _get(qs, "ui/theme", "system", str)) in ("system", "light", "dark") else "system",
        model=load_model_choice(qs),
        recent_models=_recent(qs),
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
    for f in engine_switch_fields():
        qs.setValue(f"engine/switches/{f.name}", bool(s.switch(f.name)))
        qs.remove(f"engine/{f.name}")             # the pre-dict key, migrated
    for f in engine_choice_fields():
        qs.setValue(f"engine/choices/{f.name}", s.choice(f.name))
    qs.setValue("ui/theme", s.theme)
    qs.setValue("model/path", s.model or "")
    recent = list(dict.fromkeys(([s.model] if s.model else []) + list(s.recent_models)))
    qs.setValue("model/recent", recent[:MAX_RECENT_MODELS])
    qs.sync()
