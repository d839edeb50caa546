"""benchmarks/prefill_attention.py (issue #60, lever 4) without a GPU: the script's CPU smoke
run under the Triton interpreter at a tiny shape (baseline module loading, every config's
output checked against the baseline's), and an offline sm_90a compile of the configs it sweeps
on the device."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "prefill_attention.py"
ON_CPU = not torch.cuda.is_available()


def _load():
    spec = importlib.util.spec_from_file_location("prefill_attention_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


P = _load()


def test_causal_flops_count_pairs():
    dims = dict(P.TRUE)
    # 3 new tokens after 2 cached ones see 3, 4, 5 keys
    assert P.causal_flops(3, 2, dims) == 4 * 256 * 8 * (3 + 4 + 5)
    assert P.causal_flops(1, 0, dims) == 4 * 256 * 8


@pytest.mark.skipif(not ON_CPU, reason="the interpreter smoke run uses CPU tensors")
def test_script_cpu_smoke(capsys):
    """Both tiny shapes (one with a cached history), the baseline loaded as its own module,
    every config of the tiny sweep agreeing with it."""
    rc = P.main(["--device", "cpu", "--tiny", "--baseline-file",
                 str(ROOT / "kernels" / "flash_attention.py")])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    res = json.loads(last)
    assert rc == 0 and res["all_match"]
    assert [(s["T"], s["start"]) for s in res["shapes"]] == list(P.TINY_SHAPES)
    for shape in res["shapes"]:
        rows = shape["rows"]
        assert {r["name"] for r in rows if r["kind"] == "new"} == set(P.TINY_CONFIGS)
        assert {r["name"] for r in rows if r["kind"] == "base"} == set(P.TINY_BASELINE)
        for r in rows:
            assert "error" not in r, r
            assert r["ok"] and r["rel_err"] < 1e-4 and r["ms"] > 0


def test_configs_compile_for_sm90():
    """Offline sm_90a compile (no GPU) of the built-in config and the two load paths: the
    matrix products reach wgmma, the descriptor path issues bulk tensor copies and the pointer
    path none, and the built-in tile of long prompts stays free of spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p])
    r = subprocess.run([sys.executable, str(SCRIPT), "--compile-only", "--configs",
                        "built-in,ptr 128x32 s2"], capture_output=True, text=True, env=env,
                       timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("no ptxas for an offline sm_90 compile")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    res = json.loads(r.stdout.strip().splitlines()[-1])["compile_only"]
    built_in, ptr = res["built-in"], res["ptr 128x32 s2"]
    assert built_in["wgmma"] > 0 and ptr["wgmma"] > 0
    assert built_in["tma"] > 0 and ptr["tma"] == 0
    assert built_in["shared_kb"] <= 227               # one program fits a multiprocessor
    if built_in.get("spill_stores") is not None:
        assert built_in["spill_stores"] == 0
