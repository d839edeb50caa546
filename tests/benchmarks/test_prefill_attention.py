"""benchmarks/prefill_attention.py (issue #60, lever 4) without a GPU: the script's CPU smoke
run under the Triton interpreter at a tiny shape (baseline module loading, every config's
output checked against the baseline's), and an offline sm_90a compile of the configs it sweeps
on the device."""
import pytest

from tests.benchmarks.util import ON_CPU, ROOT, compile_only, last_json, load_script

P = load_script("prefill_attention")


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
    res = last_json(capsys.readouterr().out)
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
    res = compile_only("prefill_attention", "--configs", "built-in,ptr 128x32 s2")
    built_in, ptr = res["built-in"], res["ptr 128x32 s2"]
    assert built_in["wgmma"] > 0 and ptr["wgmma"] > 0
    assert built_in["tma"] > 0 and ptr["tma"] == 0
    assert built_in["shared_kb"] <= 227               # one program fits a multiprocessor
    if built_in.get("spill_stores") is not None:
        assert built_in["spill_stores"] == 0
