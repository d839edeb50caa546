"""The stats line, its tooltip and the engine label: one formatter (Qt-free) for every place."""
from __future__ import annotations

import subprocess
import sys

from tritonchat.app.stats_text import engine_flags, engine_label, stats_line, stats_tooltip
from tritonchat.engine.options import EngineOptions

SEP = "  \u00b7  "


def run_stats(**engine) -> dict:
    """A stored answer's stats: the engine's options as the worker records them + the run's."""
    options = EngineOptions(**engine).to_dict()
    return {**options, "backend": options["backend"], "ttft_ms": 12.3, "prefill_tok_s": 2500.0,
            "decode_tok_s": 512.25, "new_tokens": 1, "stop_reason": "max_tokens",
            "prompt_tokens": 20, "thinking_seconds": 0.5}


def test_line_on_the_gpu_names_every_switch_that_applies():
    stats = run_stats(backend="triton", device="cuda", dtype="bfloat16", split_k=True, graph=False)
    parts = stats_line(stats).split(SEP)
    assert parts[:5] == ["TTFT 12 ms", "prefill 2,500 tok/s", "decode 512.2 tok/s", "1 token", "max tokens"]
    flags = parts[5]
    assert flags.startswith("triton bf16 decode per_op split-K on graph off")
    assert "launch cache on" in flags              # acts with the graph off...
    assert "L2 states" not in flags                # ...the L2 window only with it on
    assert "timing" not in flags
    on = stats_line(dict(stats, graph=True))
    assert "L2 states on" in on and "launch cache" not in on


def test_reference_and_cpu_runs_claim_no_triton_or_cuda_switch():
    """#58: on the CPU reference backend the stats line and the exports say nothing of
    split-K or the graph, whatever the (unused) options hold."""
    ref = run_stats(backend="reference", device="cpu", split_k=True, graph=True)
    assert stats_line(ref).endswith("max tokens" + SEP + "reference fp32")
    tip = stats_tooltip(ref)
    assert "Backend: reference" in tip and "Split-K" not in tip and "CUDA graph" not in tip
    # the Triton engine on the CPU (interpreter): split-K acts, the CUDA graph cannot
    interp = stats_line(run_stats(backend="triton", device="cpu", split_k=False, graph=True))
    assert "split-K off" in interp and "graph" not in interp and "PDL" not in interp
    assert "decode" not in stats_line(run_stats(backend="reference", decode_mode="persistent")).split(SEP)[-1]


def test_the_decode_mode_is_a_field_of_the_line():
    """issue #59: the mode the decode step ran in, on the GPU and under the interpreter alike, in
    the line, the tooltip (by its dialog label) and the status bar; rows from before it existed
    claim none."""
    for device in ("cuda", "cpu"):
        stats = run_stats(backend="triton", device=device, decode_mode="persistent")
        assert "triton fp32 decode persistent split-K on" in stats_line(stats)
        assert "Decode step: persistent" in stats_tooltip(stats)
    g = EngineOptions(backend="triton", device="cuda", decode_mode="persistent").to_dict()
    assert "decode persistent" in engine_label(g, "NVIDIA H100")
    old = {"new_tokens": 2, "engine": {"backend": "triton", "split_k": True}}
    assert "decode" not in engine_flags(old)[-1] and "Decode step" not in stats_tooltip(old)


def test_only_recorded_switches_are_named_and_nested_engine_dicts_read():
    old = {"new_tokens": 0, "stop_reason": "stopped", "engine": {"backend": "triton", "split_k": False}}
    assert stats_line(old) == "0 tokens" + SEP + "stopped" + SEP + "triton split-K off"
    assert stats_line(None) == "" and stats_line({}) == ""
    assert engine_flags({"new_tokens": 3}) == []


def test_interrupted_is_said_in_words():
    assert "interrupted" in stats_line({"stop_reason": "interrupted"})


def test_engine_label_uses_the_same_flags():
    o = EngineOptions(backend="reference", device="cpu", max_context=4096).to_dict()
    label = engine_label(o, "", "tiny")
    assert label == "tiny \u00b7 reference backend \u00b7 cpu \u00b7 fp32 \u00b7 context 4,096"
    g = EngineOptions(backend="triton", device="cuda", dtype="bfloat16", graph=True).to_dict()
    assert "split-K on" in engine_label(g, "NVIDIA H100") and "graph on" in engine_label(g, "X")


def test_chat_view_and_export_share_the_formatter():
    code = ("import sys; import tritonchat.app.stats_text; "
            "bad = [m for m in sys.modules if m.startswith('PySide6')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
    from tritonchat.app import chat_view, stats_text, store
    assert chat_view.format_stats is stats_text.stats_line
    assert store.stats_line is stats_text.stats_line
