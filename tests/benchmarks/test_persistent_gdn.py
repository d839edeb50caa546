"""benchmarks/persistent_gdn.py (issue #59's premise test over whole Gated DeltaNet layers)
without a GPU: the chain kernel's phase mode (one launch per operator, the same kernel code, no
spinning) and its persistent path as one program, under the Triton interpreter, against the
PyTorch reference of the chain (kernels/reference.py) at tiny shapes; the script's CPU smoke run
(the engine's DecodeStep as the baseline); an offline sm_90 compile. On the device: the
persistent kernel on its real grid against the engine's kernels at the true shape."""
import pytest
import torch

from tests.benchmarks.util import ON_CPU, compile_only, last_json, load_script

P = load_script("persistent_gdn")

TOL = {torch.float32: 2e-5, torch.float16: 6e-3}


def _args(**kw):
    argv = ["--device", "cpu", "--tiny", "--dtype", "float32"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    args = P.parse_args(argv)
    P.resolve_tiles(args, args.shape)
    return args


def _check(chain, s, tol):
    ref = chain.reference(s)
    got = chain.result(s)
    for name, a, b in zip(("h", "conv", "rec"), got, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=name)


# tiles that leave ragged last tasks everywhere (in_proj 100 rows / 8, gate_up 96 / 32 ...), a
# grouped-query shape (1 key head for 2 value heads), non-power-of-two hidden / dk / intermediate
# (masked tiles), more programs than tasks
CASES = [
    dict(programs=3, tiles=dict(bn_in=8, bn_z=8, bv=8, bn_out=8, bn_gu=8, bn_d=4)),
    dict(programs=5, tiles=dict(bn_in=16, bn_z=4, bv=16, bn_out=4, bn_gu=32, bn_d=8)),
    dict(programs=40, tiles=dict(bn_in=4, bn_z=2, bv=4, bn_out=2, bn_gu=4, bn_d=2)),
    dict(programs=4, tiles=dict(bn_in=8, bn_z=8, bv=8, bn_out=8, bn_gu=8, bn_d=4),
         shape=dict(hidden=48, inter=80, k_heads=1, dk=12)),
]


@pytest.mark.skipif(not ON_CPU, reason="the interpreter phase mode runs on CPU tensors")
@pytest.mark.parametrize("case", range(len(CASES)))
def test_phase_mode_matches_reference(case):
    c = CASES[case]
    args = _args(cpu_programs=c["programs"], **c["tiles"], **c.get("shape", {}))
    chain = P.GdnChain(args.shape, 2, 2, torch.float32, "cpu", seed=case)
    r = P.Runner(chain, P.BY_NAME["phase"], args)
    assert r.G == c["programs"] and not r.pdl
    for s in (1, 0):                  # both weight sets (layer0 offset)
        chain.reset()
        r.run(s)
        _check(chain, s, TOL[torch.float32])
    assert int(r.err.item()) == 0


@pytest.mark.skipif(not ON_CPU, reason="the interpreter phase mode runs on CPU tensors")
def test_phase_mode_fp16_matches_reference():
    args = _args(cpu_programs=3, dtype="float16", bn_in=8, bn_z=8, bv=8, bn_out=8, bn_gu=8,
                 bn_d=4)
    chain = P.GdnChain(args.shape, 2, 1, torch.float16, "cpu", seed=7)
    r = P.Runner(chain, P.BY_NAME["phase"], args)
    chain.reset()
    r.run(0)
    _check(chain, 0, TOL[torch.float16])


@pytest.mark.skipif(not ON_CPU, reason="the interpreter runs programs one at a time")
def test_persistent_one_program_matches_reference():
    """The persistent path (PHASE -1: counters, epochs, waits, the z rows before the core's
    wait, tiles loaded ahead across operators) as a single program, the only grid the
    sequential interpreter can run without deadlock: chains back to back on both weight sets
    (the counters carry over: targets grow with the epoch)."""
    args = _args(bn_in=8, bn_z=8, bv=8, bn_out=8, bn_gu=8, bn_d=4)
    chain = P.GdnChain(args.shape, 2, 2, torch.float32, "cpu", seed=11)
    r = P.Runner(chain, P.BY_NAME["persist"], args)
    assert r.G == 1
    for s in (0, 1, 0):
        chain.reset()
        r.run(s)
        _check(chain, s, TOL[torch.float32])
    # every program counts once per operator per chain: 3 chains of one program
    assert r.epoch.tolist() == [3]
    assert r.cnt.tolist() == [3] * (P.N_OPS * 2) + [0]
    assert int(r.err.item()) == 0


@pytest.mark.skipif(not ON_CPU, reason="the script's CPU smoke run")
def test_script_cpu_smoke(capsys):
    rc = P.main(["--device", "cpu", "--tiny", "--phase", "--dtype", "float32",
                 "--deadline-s", "0"])
    assert rc == 0
    res = last_json(capsys.readouterr().out)
    assert set(res["variants"]) == {"baseline", "phase", "persist"}
    for name, r in res["variants"].items():
        assert "error" not in r, (name, r.get("error"))
        assert r["correct"] and r["repeatable"], name
        assert max(r["err_vs_ref"].values()) < 1e-4, name
    # the engine's kernels agree with the same reference
    assert "err_vs_baseline" in res["variants"]["persist"]


def test_kernel_compiles_for_sm90():
    """Offline sm_90 compile (no GPU) of the persistent kernel (spin waits, stamps) and the
    five PDL phase kernels; registers from ptxas when it is around."""
    res = compile_only("persistent_gdn", "--variant", "phase,persist")
    assert set(res) == {"persist"} | {f"phase/{op}" for op in P.OPS}
    assert res["persist"]["acquire"] > 0 and res["persist"]["pdl"] == 0
    assert all(res[f"phase/{op}"]["pdl"] > 0 and res[f"phase/{op}"]["acquire"] == 0
               for op in P.OPS)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["phase", "persist", "persist_x1"])
def test_gpu_chain_matches_engine(name):
    """On the device: the chain (3 layers, true shape, bf16) by this kernel against the
    engine's kernels and the fp32 reference, bit-repeatable over chains (the counters carry
    over), no spin timeout."""
    args = P.parse_args([])
    P.resolve_tiles(args, args.shape)
    chain = P.GdnChain(args.shape, 3, 2, torch.bfloat16, "cuda", seed=1)
    base = P.Runner(chain, P.BY_NAME["baseline"], args)
    r = P.Runner(chain, P.BY_NAME[name], args)
    r.check_occupancy()
    for s in (0, 1):
        chain.reset()
        base.run(s)
        torch.cuda.synchronize()
        want = chain.result(s)
        outs = []
        for _ in range(2):
            chain.reset()
            r.run(s)
            torch.cuda.synchronize()
            outs.append(chain.result(s))
        for k, e in P.chain_errors(outs[0], want).items():
            assert e < 3e-2, (k, e)
        for k, e in P.chain_errors(outs[0], chain.reference(s)).items():
            assert e < 3e-2, (k, e)
        assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert int(r.err.item()) == 0
