"""benchmarks/gdn_prefill.py (issue #60, the GDN layer's prefill kernels old vs new) without a
GPU: the script's tiny run under the interpreter, plain and padded, new against the old kernels
(main's files at OLD_REV, from git) where the history is there, and against the reference."""
import subprocess

import pytest
import torch

from tests.benchmarks.util import ROOT, last_json, load_script

B = load_script("gdn_prefill")


def _have_old_rev() -> bool:
    r = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{B.OLD_REV}:kernels/conv1d.py"],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter smoke run is for the CPU")
@pytest.mark.parametrize("old", [True, False], ids=["old_vs_new", "new_only"])
def test_script_tiny_run(capsys, old):
    if old and not _have_old_rev():
        pytest.skip(f"no git history with {B.OLD_REV} here")
    argv = ["--device", "cpu", "--tiny", "--T", "70", "--pad", "40"]
    rc = B.main(argv + ([] if old else ["--old-rev", "none"]))
    res = last_json(capsys.readouterr().out)
    assert rc == 0 and res["ok"]
    for form, t in (("plain", 70), ("padded", 30)):
        r = res["results"][0][form]
        assert r["t"] == t and r["new_vs_ref"]["conv_equal"] and r["new_vs_ref"]["out_rel"] < 1e-4
        assert ("new_vs_old" in r) == old
        if old:     # the same fp32 math (the conv moved; the chunk-end decay is the stored one)
            c = r["new_vs_old"]
            assert c["conv_equal"] and c["out_rel"] < 1e-5 and c["rec_rel"] < 1e-5, c
    v = res["results"][0]["plain"]["variants"]
    for name in ("solve", "prep_warps", "out_warps", "solve_prep_warps"):
        assert v[name]["vs_picked"]["out_rel"] < 1e-4 and v[name]["vs_picked"]["conv_equal"], name
        assert v[name]["config"] != v["picked"]["config"], name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is for the CPU")
def test_gdn_launches_are_the_launches_in_order():
    """The launch splits (this script's, the tuner's) time the kernels gdn_launches names:
    exactly those gdn_prefill runs, with each variant's config, in that order."""
    from tritonchat.kernels import gdn_chunk as mod
    L = B.Layer(20, B.TINY, torch.float32, "cpu")
    kernels = [getattr(mod, n) for n in dir(mod) if n.startswith("_gdn_chunk_") and n.endswith("_kernel")]
    launched = []
    saved = [k.run for k in kernels]
    try:
        for k, run in zip(kernels, saved):
            k.run = (lambda k, run: lambda *a, **kw: (launched.append(k), run(*a, **kw))[1])(k, run)
        for name, cfg in B.new_variants(mod, L).items():
            launched.clear()
            L.reset()
            B.new_fn(mod, L, None, cfg)()
            assert launched == [k for _, k in mod.gdn_launches()], name
    finally:
        for k, run in zip(kernels, saved):
            k.run = run


def test_launch_split_gives_each_launch_its_own_time():
    """The per-launch split the script (and the prefill tuner) reports: with the later launches
    made no-ops, the cumulative prefixes' differences are each launch's own cost; the launchers
    are restored afterwards, also when a timing fails."""
    from tritonchat.engine.tuning.prefill import launch_split

    class Kernel:
        def __init__(self, cost):
            self.cost = cost
            self.run = self.launch

        def launch(self, *a, **kw):
            return self.cost

    kernels = [Kernel(3.0), Kernel(0.5), Kernel(7.25)]
    chain = lambda: sum(k.run() or 0.0 for k in kernels)      # noqa: E731
    assert launch_split(kernels, chain) == [3.0, 0.5, 7.25]
    assert all(k.run == k.launch for k in kernels)

    def failing():
        raise RuntimeError("timing failed")
    with pytest.raises(RuntimeError):
        launch_split(kernels, failing)
    assert all(k.run == k.launch for k in kernels)
