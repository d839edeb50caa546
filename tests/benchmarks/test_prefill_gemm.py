"""benchmarks/prefill_gemm.py (issue #60, lever 2) without a GPU: the script's CPU smoke run
under the Triton interpreter at the tiny model's shapes, every form checked against the grid
form, its form table against the launcher's keys, and an offline sm_90 compile of every form."""
import pytest
import torch

from tests.benchmarks.util import ON_CPU, compile_only, last_json, load_script

P = load_script("prefill_gemm")


def test_every_form_is_a_launchable_config():
    """Each form's config at the true shapes carries exactly the launcher's keys; split-K only
    on the narrow N shapes; the forms differ from each other where they should."""
    from tritonchat.engine.config import qwen35_08b_config
    from tritonchat.engine.tuning.prefill import gemm_shapes
    from tritonchat.kernels import gemm as G
    for M in (2048, 8192):
        for name, (n_w, K, res, silu, _) in gemm_shapes(qwen35_08b_config()).items():
            N = n_w // 2 if silu else n_w
            cfgs = {f: P.form_config(f, M, N, K, silu, res) for f in P.FORMS}
            for f, c in cfgs.items():
                assert c is None or set(c) == set(G.GEMM_KEYS), (f, c)
            assert (cfgs["splitk2"] is None) == (N > 2048)
            assert cfgs["grid"]["PERSISTENT"] == 0 and cfgs["default"]["PERSISTENT"] == 1
            assert cfgs["persistent"]["TMA"] == 0 and cfgs["tma"]["PERSISTENT"] == 0


@pytest.mark.skipif(not ON_CPU, reason="the interpreter smoke run is for CPU tensors")
def test_script_cpu_smoke(capsys):
    rc = P.main(["--device", "cpu", "--tiny", "--T", "17", "--shapes", "gdn out,gate",
                 "--forms", "default,persistent,tma,splitk2,ws,flatten"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    res = last_json(out)
    assert not res["mismatches"]
    assert {r["shape"] for r in res["rows"]} == {"gdn out gemm+res", "mlp gate|up silu"}
    for r in res["rows"]:
        assert list(r["forms"])[0] == "grid"              # the reference, first
        for form, e in r["forms"].items():
            assert "error" not in e, (r["shape"], form, e.get("error"))
            assert e["correct"] and e["repeatable"], (r["shape"], form)
    assert any("TFLOP/s" in line for line in res["summary"])


def test_agree_catches_a_wrong_result():
    """The script's bf16 check: order-of-sum noise passes, a systematic error does not."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(256, 256, generator=g).to(torch.bfloat16)
    assert P.agree(ref.clone(), ref)[0]
    nudged = (ref.float() * (1 + 2 ** -9)).to(torch.bfloat16)       # about an ulp
    assert P.agree(nudged, ref)[0]
    assert not P.agree((ref.float() + 0.05).to(torch.bfloat16), ref)[0]
    assert not P.agree(torch.zeros_like(ref), ref)[0]


def test_forms_compile_for_sm90():
    """Offline sm_90 compile (no GPU) of every form at the true shapes: the TMA forms move
    their tiles with the bulk tensor copy engine, the pointer forms with cp.async (both
    software-pipelined), all on wgmma, within a block's shared memory."""
    res = compile_only("prefill_gemm", timeout=900)
    assert len(res) >= 6 * 10
    for key, info in res.items():
        form = key.split("/")[1]
        assert info["ok"] and info["wgmma"] > 0 and info["shared"] <= 227 * 1024, (key, info)
        if form in ("grid", "persistent"):
            assert info["cp_async"] > 0 and info["tma"] == 0, (key, info)
        elif form not in ("table",):
            assert info["tma"] > 0, (key, info)
