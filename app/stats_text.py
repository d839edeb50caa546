"""The words for a run's numbers: the stats line under an answer, its tooltip, the engine label.

One place for all of them, Qt-free: the chat view, the Markdown export and the status bar read
the same functions, so they cannot drift apart. The engine switches and named-value settings
(the decode mode) come from `tritonchat.engine.options.stats_fields`, which names only those
that act on the engine the answer ran on: split-K, the CUDA graph and the decode mode are never
claimed for the CPU reference engine.
"""
from __future__ import annotations

from tritonchat.engine.options import (EngineOptions, choice_fields, fields_by_name, stats_fields,
                                       switch_fields)

SEP = "  \u00b7  "
STOP_REASONS = {"eos": "finished", "max_tokens": "max tokens", "context_full": "context full",
                "stopped": "stopped", "error": "error",
                "interrupted": "interrupted (the app closed before the answer ended)"}
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _flat(stats: dict) -> dict:
    """GenerationResult-style flat dicts and {"...stats", "engine": {...}} nests alike."""
    flat = dict(stats)
    if isinstance(flat.get("engine"), dict):
        flat = {**flat.pop("engine"), **flat}
    return flat


def _options(flat: dict) -> EngineOptions | None:
    """The engine options a run reports, or None when it names no backend (nothing to claim)."""
    backend = flat.get("backend")
    if backend not in ("reference", "triton"):
        return None
    names = fields_by_name()
    known = {k: v for k, v in flat.items() if k in names}
    # rows written before the device was recorded: the Triton engine ran on a GPU
    known.setdefault("device", "cuda" if backend == "triton" else "cpu")
    try:
        return EngineOptions.from_dict(known)
    except TypeError:
        return None


def engine_flags(stats: dict | None) -> list[str]:
    """["triton", "bf16", "decode persistent", "split-K on", "graph off", ...]: the settings that
    applied, as recorded (a row written before a setting existed does not claim it)."""
    if not stats:
        return []
    flat = _flat(stats)
    out = []
    if flat.get("backend"):
        out.append(str(flat["backend"]))
    if flat.get("dtype"):
        out.append(DTYPES.get(flat["dtype"], str(flat["dtype"])))
    options = _options(flat)
    if options is not None:
        recorded = {f.metadata["stats"] for f in switch_fields() + choice_fields() if f.name in flat}
        out += [f"{label} {value}" for label, value in stats_fields(options) if label in recorded]
    return out


def stats_line(stats: dict | None) -> str:
    """The line under an answer: speeds, tokens, why it stopped, the engine and its switches."""
    if not stats:
        return ""
    s = _flat(stats)
    parts = []
    if s.get("ttft_ms"):
        parts.append(f"TTFT {float(s['ttft_ms']):,.0f} ms")
    if s.get("prefill_tok_s"):
        parts.append(f"prefill {float(s['prefill_tok_s']):,.0f} tok/s")
    if s.get("decode_tok_s"):
        parts.append(f"decode {float(s['decode_tok_s']):,.1f} tok/s")
    if s.get("new_tokens") is not None:
        n = int(s["new_tokens"])
        parts.append(f"{n:,} token" + ("" if n == 1 else "s"))
    if s.get("stop_reason"):
        parts.append(STOP_REASONS.get(s["stop_reason"], str(s["stop_reason"])))
    flags = engine_flags(s)
    if flags:
        parts.append(" ".join(flags))
    return SEP.join(parts)


_TOOLTIP_ROWS = (("Prompt tokens", "prompt_tokens", "{:,}"), ("Reused from cache", "cached_tokens", "{:,}"),
                 ("New tokens", "new_tokens", "{:,}"), ("Time to first token", "ttft_ms", "{:,.1f} ms"),
                 ("Prefill", "prefill_tok_s", "{:,.1f} tok/s"), ("Decode", "decode_tok_s", "{:,.2f} tok/s"),
                 ("Per token", "decode_ms_per_token", "{:,.2f} ms"), ("Total", "total_ms", "{:,.0f} ms"),
                 ("Thinking", "thinking_seconds", "{:,.1f} s"), ("Stop reason", "stop_reason", "{}"),
                 ("Backend", "backend", "{}"), ("Device", "device", "{}"), ("Dtype", "dtype", "{}"))


def stats_tooltip(stats: dict | None) -> str:
    """Every number of the run, one per line; the switches that applied, by their dialog label."""
    if not stats:
        return ""
    s = _flat(stats)
    lines = []
    for label, key, fmt in _TOOLTIP_ROWS:
        if s.get(key) is not None and s.get(key) != "":
            try:
                lines.append(f"{label}: {fmt.format(s[key])}")
            except (ValueError, TypeError):
                lines.append(f"{label}: {s[key]}")
    options = _options(s)
    if options is not None:
        for f in choice_fields():
            if f.name in s and options.applies(f.name):
                lines.append(f"{f.metadata['label']}: {s[f.name]}")
        for f in switch_fields():
            if f.name in s and f.name != "timing" and options.applies(f.name):
                lines.append(f"{f.metadata['label']}: {'on' if s[f.name] else 'off'}")
    if s.get("max_context"):
        lines.append(f"Context: {int(s['max_context']):,} tokens")
    return "\n".join(lines)


def engine_label(options: dict, device_name: str = "", model_name: str = "") -> str:
    """The status bar's line: model, backend, device, dtype, context and the switches that apply."""
    if not options:
        return ""
    flags = engine_flags(options)
    backend, dtype, switches = flags[:1], flags[1:2], flags[2:]
    parts = [f"{backend[0]} backend" if backend else "", device_name or str(options.get("device", "")),
             dtype[0] if dtype else "", f"context {int(options.get('max_context') or 0):,}"]
    return " \u00b7 ".join(p for p in [model_name, *parts, *switches] if p)
