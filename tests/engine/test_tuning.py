"""The tuners (engine/tuning/ and engine/tune_step.py): their candidate grids are launchable
plans and a failing candidate is skipped; the GPU runs themselves happen on the device."""
import pytest
import torch


def test_tune_decode_quick_grid_is_small_and_valid():
    from tritonchat.engine.tuning import decode as td
    total = 0
    for _key, n_out, k, pro, _epi, _what in td.GEMVS:
        for p in td._gemv_grid(n_out, k, pro, True):
            total += 1
            assert p["block_n"] * p["block_k"] <= 8192
            assert pro != "gated" or p["block_k"] <= td.DV
    assert 0 < total <= 80                       # ~2 s a config on the device: < 4 minutes


def test_tuner_keeps_the_fastest_plan_that_runs(monkeypatch):
    """tune_decode._fastest (the LM head's and the GDN core's sweeps): the fastest plan of
    those that compile and launch, the others logged and skipped; an error when none ran."""
    from tritonchat.engine.tuning import decode as td
    cost = {1: 5.0, 2: 3.0, 3: None, 4: 4.0}          # plan 3 does not compile

    def launch(p):
        if cost[p["n"]] is None:
            raise RuntimeError("compile error")
        return p["n"]
    monkeypatch.setattr(td, "_bench_us", lambda fn, rep: cost[fn])
    logs = []
    us, plan = td._fastest([dict(n=i) for i in (1, 2, 3, 4)], launch, 10, "x", logs.append)
    assert (us, plan) == (3.0, dict(n=2)) and len(logs) == 1 and "skip x" in logs[0]
    with pytest.raises(RuntimeError, match="no x plan ran"):
        td._fastest([dict(n=3)], launch, 10, "x", logs.append)


def test_in_step_tuner_candidates_are_valid_plans():
    """engine/tune_step.py's candidates: the persistent form only where the kernel has it
    (direct form; a gated prologue of power-of-two heads), tiles gemv accepts,
    persistent ones first."""
    from tritonchat.engine import tune_step as ts
    from tritonchat.kernels import gemv as G
    from tritonchat.engine.tuning import decode as td
    for _key, n_out, k, pro, epi, _what in td.GEMVS:
        cands = list(ts._gemv_candidates(n_out, k, pro, td.DV if pro == "gated" else 0,
                                         epi == "silu_mul"))
        assert cands and len(cands) <= 48
        flags = [bool(c["persistent"]) for c in cands]
        assert flags == sorted(flags, reverse=True)      # the structural candidates first
        for c in cands:
            assert c["block_n"] & (c["block_n"] - 1) == 0 and c["block_k"] >= 16
            assert c["block_k"] & (c["block_k"] - 1) == 0 and 1 <= c["split_k"] <= 8
            if c["persistent"]:
                assert c["split_k"] == 1
                assert pro != "gated" or G.gated_persistent_ok(k, td.DV)
            if pro == "gated" and not c["persistent"]:
                assert c["block_k"] <= td.DV


def test_in_step_tuner_needs_a_gpu(capsys):
    from tritonchat.engine import tune_step as ts
    if torch.cuda.is_available():
        pytest.skip("runs the real tuner on a GPU")
    assert ts.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_tuner_grids_are_launchable_configs():
    """Every config the tuner may write carries exactly the keys its launcher reads."""
    from tritonchat.kernels import flash_attention, gdn_chunk, gemm as gemm_mod
    from tritonchat.engine.tuning import prefill as tp
    for quick in (True, False):
        for T in (128, 2048, 8192):
            for silu in (False, True):
                g = tp.gemm_grid(quick, T, silu)
                assert g and all(set(c) == set(gemm_mod.GEMM_KEYS) for c in g)
                assert not silu or all(c["BLOCK_N"] <= 128 for c in g)
            assert all(set(c) == set(flash_attention.ATTN_KEYS) for c in tp.attn_grid(quick, T))
        assert all(set(c) == set(gdn_chunk.GDN_KEYS) for c in tp.gdn_grid(quick))
        assert len(tp.gemm_grid(True, 2048, False)) < len(tp.gemm_grid(False, 2048, False))
