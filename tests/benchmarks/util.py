"""What the tests of the benchmark scripts share: a script imported as a module, its offline
sm_90 compile in a process of its own, the JSON line it ends with."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ON_CPU = not torch.cuda.is_available()


def script(name: str) -> Path:
    return ROOT / "benchmarks" / f"{name}.py"


def load_script(name: str):
    """benchmarks/<name>.py imported as the module <name>_under_test."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", script(name))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod            # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def last_json(out: str):
    """The JSON of a script's last printed line (its result)."""
    return json.loads(out.strip().splitlines()[-1])


def compile_only(name: str, *argv: str, timeout: int = 600) -> dict:
    """`benchmarks/<name>.py --compile-only *argv` without the interpreter (an offline sm_90
    compile needs no GPU): its compile_only result; skips where there is no ptxas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p])
    r = subprocess.run([sys.executable, str(script(name)), "--compile-only", *argv],
                       capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("no ptxas for an offline sm_90 compile")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return last_json(r.stdout)["compile_only"]
