"""Time one GDN layer's prefill kernels (issue #60, lever 3): the old form, main's causal_conv1d
kernel + its three-launch gdn_prefill on the conv output (and, for the padded prefill-graph
form, the torch ops main's _prefill_chunk ran around them: masked_fill_ of b/a, a clone of the
conv state, two index_selects and a where), against today's kernels.gdn_chunk.gdn_prefill with
the conv inside (three launches, pads inert from a device row count). One process, the true
Qwen3.5-0.8B GDN shape (16 key / 16 value heads, dk = dv = 128, conv_dim 6144, Kc = 4, bf16),
each T in --T, plus the launch-config alternatives of the new kernels (the batched
diagonal-block solve, 8 prepare warps, the prepare in two launches, the state pass on two K
halves with the next chunk's tiles loaded ahead, and both; each with its launch split and, from the device's compile, registers and spills);
checks new == old numerically (real rows' outputs,
both states) and, at T <= --ref-max-T, new against the PyTorch reference
(kernels/reference.gdn_prefill_ref).

The old kernels are main's files before the conv moved in (OLD_REV): read from --old-dir (a
folder holding conv1d.py and gdn_chunk.py) or from git (--old-rev); loaded as modules of
tritonchat.kernels under other names. --old none times the new kernels alone.

Times: GPU time of the launches replayed in a CUDA graph (no host launch cost, as the prefill
graphs run) and triton.testing.do_bench (eager, as longer prompts run), median ms; the
launch split (prepare / state / output, and the old conv) from runs with the later launches
removed. A human table, then ONE final JSON line.

    python benchmarks/gdn_prefill.py --old-dir .gdn_old --T 2048 8192          (GPU)
    TRITON_INTERPRET=1 python benchmarks/gdn_prefill.py --device cpu --tiny    (CPU smoke run)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# main before the conv moved into the GDN chunk kernels (kernels/conv1d.py still there)
OLD_REV = "59222f6"
OLD_FILES = ("conv1d.py", "gdn_chunk.py")
# main's tuned conv tiles at T = 2048 and 8192 on the H200 (its table entry went with the kernel)
OLD_CONV_CONFIG = dict(BLOCK_C=128, BLOCK_T=32, ROW_TILES=1, num_warps=4)
TRUE = dict(num_k_heads=16, num_v_heads=16, head_k_dim=128, head_v_dim=128, kc=4)
TINY = dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=24, kc=4)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=None, help="prompt lengths (default 2048 8192; tiny: 70)")
    ap.add_argument("--pad", type=int, default=37, help="padded form: the last PAD rows are padding")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small heads, fp32 (the interpreter)")
    ap.add_argument("--old-dir", default=None, help="folder with main's conv1d.py and gdn_chunk.py")
    ap.add_argument("--old-rev", default=OLD_REV, help="git revision of the old kernels ('none': new only)")
    ap.add_argument("--ref-max-T", type=int, default=2048, help="check against the reference up to this T")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    return ap.parse_args(argv)


def _load_module(name: str, path: Path):
    import tritonchat.kernels  # noqa: F401  (the package the old modules import from)
    spec = importlib.util.spec_from_file_location(f"tritonchat.kernels.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_old(old_dir, old_rev):
    """(old conv1d module, old gdn_chunk module), or None for --old-rev none."""
    if old_dir is None:
        if old_rev in (None, "", "none"):
            return None
        old_dir = Path(tempfile.mkdtemp(prefix="gdn_old_"))
        for f in OLD_FILES:
            src = subprocess.run(["git", "-C", str(ROOT), "show", f"{old_rev}:kernels/{f}"],
                                 capture_output=True, text=True, check=True).stdout
            (old_dir / f).write_text(src)
    old_dir = Path(old_dir)
    return (_load_module("_old_conv1d", old_dir / "conv1d.py"),
            _load_module("_old_gdn_chunk", old_dir / "gdn_chunk.py"))


class Layer:
    """One GDN layer's prefill inputs in the engine's layout: proj = [qkv | b | a | z] (the
    merged projection GEMM's output), conv and recurrent states, out."""

    def __init__(self, T: int, dims: dict, dtype, device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        hk, hv, dk, dv, kc = (dims[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "kc"))
        self.dims = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)
        self.T, self.hv, self.cd, self.kc = T, hv, 2 * hk * dk + hv * dv, kc
        r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(device)  # noqa: E731
        self.proj = r(T, self.cd + 2 * hv + hv * dv).to(dtype)
        self.conv_w = r(self.cd, kc, scale=0.5).to(dtype)
        self.conv_state0 = r(self.cd, kc - 1).to(dtype)
        self.rec0 = r(hv, dk, dv, scale=0.1)
        self.A_log = torch.log(torch.empty(hv).uniform_(1, 16, generator=g)).to(device)
        self.dt_bias = r(hv, scale=0.5).to(dtype)
        self.norm_w = (torch.rand(dv, generator=g) + 0.5).to(device)
        self.conv_state, self.rec = self.conv_state0.clone(), self.rec0.clone()
        self.out = torch.empty(T, hv * dv, device=device, dtype=dtype)
        self.conv_out = torch.empty(T, self.cd, device=device, dtype=dtype)
        self.eps = 1e-6

    def reset(self):
        self.conv_state.copy_(self.conv_state0)
        self.rec.copy_(self.rec0)

    def views(self):
        cd, hv = self.cd, self.hv
        p = self.proj
        return p[:, :cd], p[:, cd + 2 * hv:], p[:, cd:cd + hv], p[:, cd + hv:cd + 2 * hv]   # qkv, z, b, a


def new_fn(mod, L: Layer, t_dev=None, config=None):
    qkv, z, b, a = L.views()
    return lambda: mod.gdn_prefill(qkv, z, b, a, L.conv_w, L.conv_state, L.A_log, L.dt_bias, L.rec,
                                   L.norm_w, L.out, eps=L.eps, t_dev=t_dev, config=config, **L.dims)


def new_variants(mod, L: Layer) -> dict:
    """The launch config gdn_prefill picks at this T (table or built-in) and the alternatives
    to time against it: the other diagonal-block solve, the other prepare / output warp
    counts, and both."""
    d = L.dims
    cfg = mod.gdn_config(d["num_v_heads"], d["head_k_dim"], d["head_v_dim"], L.T)
    other = lambda w: 4 if w == 8 else 8
    return {"picked": cfg, "solve": dict(cfg, solve=3 - cfg["solve"]),
            "prep_warps": dict(cfg, prep_warps=other(cfg["prep_warps"])),
            "out_warps": dict(cfg, out_warps=other(cfg["out_warps"])),
            "solve_prep_warps": dict(cfg, solve=3 - cfg["solve"], prep_warps=other(cfg["prep_warps"]))}


def old_fn(conv_mod, gdn_mod, L: Layer, t_dev=None):
    """main's GDN layer between its two GEMMs (engine/triton_prefill.py at OLD_REV)."""
    qkv, z, b, a = L.views()
    cd, hv, kc1 = L.cd, L.hv, L.kc - 1
    conv_cfg = OLD_CONV_CONFIG if L.proj.is_cuda and L.dims["head_k_dim"] == 128 else None
    if t_dev is not None:
        dev = L.proj.device
        pad = torch.arange(L.T, device=dev) >= t_dev
        conv_idx = t_dev.long() + torch.arange(kc1, device=dev)
        in_old = (conv_idx < kc1)[None, :]

    def run():
        if t_dev is not None:
            L.proj[:, cd:cd + 2 * hv].masked_fill_(pad[:, None], float("-inf"))
            old_conv = L.conv_state.clone()
        conv_mod.causal_conv1d(qkv, L.conv_w, L.conv_state, L.conv_out, config=conv_cfg)
        if t_dev is not None:
            from_rows = qkv.index_select(0, (conv_idx - kc1).clamp(min=0)).t()
            from_old = old_conv.index_select(1, conv_idx.clamp(max=kc1 - 1))
            torch.where(in_old, from_old, from_rows, out=L.conv_state)
        gdn_mod.gdn_prefill(L.conv_out, z, b, a, L.A_log, L.dt_bias, L.rec, L.norm_w, L.out,
                            eps=L.eps, **L.dims)
    return run


def _graph_ms(fn, rep_ms: float) -> float:
    """GPU ms per call: n calls captured in one CUDA graph (n ~ rep_ms of work), replayed 10
    times, the median replay / n."""
    def capture(n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
        return g

    def replay(g):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    g = capture(1)
    replay(g)
    n = max(1, min(2000, int(rep_ms / max(replay(g), 1e-3))))
    g = capture(n)
    replay(g)
    times = sorted(replay(g) / n for _ in range(10))
    return times[len(times) // 2]


def _ms(fn, args, graph: bool) -> float:
    """Median ms per call: CUDA-graph replay (graph) or eager do_bench; CPU: one timed call."""
    if args.device == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench
    fn()
    torch.cuda.synchronize()
    if graph:
        return _graph_ms(fn, args.rep)
    return do_bench(fn, warmup=25, rep=args.rep, return_mode="median")


def _split(kernels, make, args) -> list[float]:
    """Each launch's own ms: the tuner's cumulative prefixes, timed as this script times."""
    from tritonchat.engine.tuning.prefill import launch_split
    return launch_split(kernels, lambda: _ms(make(), args, graph=True))


def _regs_spills(mod, cfg: dict, fn) -> dict:
    """{launch: (registers, spilled bytes)} of the kernels one call of fn compiles or reuses
    with cfg, on the device's own Triton (a launch returns its compiled kernel)."""
    stats = {}
    launches = mod.gdn_launches()
    saved = [k.run for _, k in launches]

    def capture(name, run):
        def wrapped(*a, **kw):
            ck = run(*a, **kw)
            try:
                ck._init_handles()
                stats[name] = (int(ck.n_regs), int(ck.n_spills))
            except (AttributeError, TypeError, ValueError):    # not a compiled kernel: no numbers
                pass
            return ck
        return wrapped
    try:
        for (name, k), run in zip(launches, saved):
            k.run = capture(name, run)
        fn()
    finally:
        for (_, k), run in zip(launches, saved):
            k.run = run
    return stats


def _rel(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _result(L: Layer, t: int):
    return L.out[:t].clone(), L.rec.clone(), L.conv_state.clone()


def _compare(a, b) -> dict:
    return dict(out_rel=_rel(a[0], b[0]), rec_rel=_rel(a[1], b[1]), conv_equal=bool(torch.equal(a[2], b[2])),
                bitwise=bool(all(torch.equal(x, y) for x, y in zip(a, b))))


def run_T(T: int, args, old, new_mod, dims, dtype) -> dict:
    res = dict(T=T)
    for form in ("plain", "padded"):
        t = T if form == "plain" else max(1, T - args.pad)
        L = Layer(T, dims, dtype, args.device, seed=T)
        t_dev = None if form == "plain" else torch.tensor([t], dtype=torch.int32, device=args.device)
        r = res[form] = dict(t=t)
        L.reset()
        new_fn(new_mod, L, t_dev)()
        got = _result(L, t)
        assert torch.isfinite(L.out).all() and bool(torch.all(L.out[t:] == 0)), "pad rows must be 0"
        if old is not None:
            L.reset()
            old_fn(*old, L, t_dev)()
            r["new_vs_old"] = _compare(got, _result(L, t))
        if T <= args.ref_max_T:
            from tritonchat.kernels.reference import gdn_prefill_ref
            L.reset()
            qkv, z, b, a = L.views()
            ref_out = torch.empty_like(L.out)
            gdn_prefill_ref(qkv, z, b, a, L.conv_w, L.conv_state, L.A_log, L.dt_bias, L.rec, L.norm_w,
                            ref_out, eps=L.eps, t_dev=t_dev, **L.dims)
            r["new_vs_ref"] = _compare(got, (ref_out[:t], L.rec.clone(), L.conv_state.clone()))
        L.reset()
        r["new_ms"] = _ms(new_fn(new_mod, L, t_dev), args, graph=True)
        r["new_eager_ms"] = _ms(new_fn(new_mod, L, t_dev), args, graph=False)
        if old is not None:
            r["old_ms"] = _ms(old_fn(*old, L, t_dev), args, graph=True)
            r["old_eager_ms"] = _ms(old_fn(*old, L, t_dev), args, graph=False)
        if form == "plain":
            r["variants"] = {}
            for name, cfg in new_variants(new_mod, L).items():
                L.reset()
                new_fn(new_mod, L, None, cfg)()
                v = r["variants"][name] = dict(config=cfg, vs_picked=_compare(_result(L, t), got))
                v["ms"] = _ms(new_fn(new_mod, L, None, cfg), args, graph=True)
                if args.device != "cpu":
                    names, k = zip(*new_mod.gdn_launches())
                    v["split_ms"] = dict(zip(names, _split(k, lambda: new_fn(new_mod, L, None, cfg), args)))
                    v["regs_spills"] = _regs_spills(new_mod, cfg, new_fn(new_mod, L, None, cfg))
        if args.device != "cpu" and form == "plain":
            names, k = zip(*new_mod.gdn_launches())
            r["new_split_ms"] = dict(zip(names, _split(k, lambda: new_fn(new_mod, L), args)))
            if old is not None:
                conv_mod, gdn_mod = old
                k = [conv_mod._causal_conv1d_kernel, gdn_mod._gdn_chunk_prepare_kernel,
                     gdn_mod._gdn_chunk_state_kernel, gdn_mod._gdn_chunk_output_kernel]
                r["old_split_ms"] = dict(zip(("conv", "prepare", "state", "output"),
                                             _split(k, lambda: old_fn(*old, L), args)))
        del L
    return res


def _print(res: dict, n_layers: int) -> None:
    T = res["T"]
    for form in ("plain", "padded"):
        r = res[form]
        line = f"T={T:5d} {form:6s} (t={r['t']}): new {r['new_ms'] * 1e3:8.1f} us (eager {r['new_eager_ms'] * 1e3:8.1f})"
        if "old_ms" in r:
            line += (f" | old {r['old_ms'] * 1e3:8.1f} us (eager {r['old_eager_ms'] * 1e3:8.1f})"
                     f" | x{n_layers} layers: {r['old_ms'] * n_layers:.3f} -> {r['new_ms'] * n_layers:.3f} ms")
        print(line)
        for key in ("new_split_ms", "old_split_ms"):
            if key in r:
                print(f"    {key[:3]} split: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in r[key].items()))
        for name, v in r.get("variants", {}).items():
            split = ("  [" + ", ".join(f"{k} {x * 1e3:.1f}" for k, x in v["split_ms"].items()) + " us]"
                     if "split_ms" in v else "")
            print(f"    new {name:16s} {v['ms'] * 1e3:8.1f} us  (out rel to the picked config "
                  f"{v['vs_picked']['out_rel']:.1e}){split}  {v['config']}")
            if "regs_spills" in v:
                print("        regs / spilled bytes: " + ", ".join(
                    f"{k} {r} / {sp}" for k, (r, sp) in v["regs_spills"].items()))
        for key in ("new_vs_old", "new_vs_ref"):
            if key in r:
                c = r[key]
                print(f"    {key}: out rel {c['out_rel']:.2e}, state rel {c['rec_rel']:.2e}, "
                      f"conv state equal {c['conv_equal']}, bitwise {c['bitwise']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gdn_prefill bench needs a CUDA GPU (or --device cpu under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    from tritonchat.kernels import gdn_chunk as new_mod
    dims = TINY if args.tiny else TRUE
    dtype = torch.float32 if args.tiny else torch.bfloat16
    Ts = args.T or ([70] if args.tiny else [2048, 8192])
    old = load_old(args.old_dir, args.old_rev)
    tol = 2e-4 if dtype == torch.float32 else 2e-2      # bf16: a value may round one ulp apart
    results, ok = [], True
    for T in Ts:
        res = run_T(T, args, old, new_mod, dims, dtype)
        _print(res, 18)
        for form in ("plain", "padded"):
            for key in ("new_vs_old", "new_vs_ref"):
                c = res[form].get(key)
                lim = tol if key == "new_vs_old" else max(tol, 1e-2)
                if c and not (c["out_rel"] < lim and c["rec_rel"] < lim and c["conv_equal"]):
                    ok = False
            for v in res[form].get("variants", {}).values():
                c = v["vs_picked"]
                if not (c["out_rel"] < tol and c["rec_rel"] < tol and c["conv_equal"]):
                    ok = False
        results.append(res)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(json.dumps(dict(ok=ok, device=torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
                          dims=dims, old=None if old is None else (args.old_dir or args.old_rev),
                          results=results)))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
