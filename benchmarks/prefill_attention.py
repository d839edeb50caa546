"""Prefill attention (issue #60, lever 4): today's kernel against the new configs, one process.

The full-attention pass of a prompt chunk at the true Qwen3.5-0.8B shape (8 query heads, 2 KV
heads, head_dim 256, 64 rotated dims, bf16), as the engine launches it
(kernels/flash_attention.attention_prefill: the K/V pass plus the attention pass), at

    T = 2048 and 8192 from position 0, and T = 8192 from 24576 (the last chunk of a 32K prompt,
    attending over the whole cached history)

For each shape it times (triton.testing.do_bench, median) the baseline kernel - a copy of main's
kernels/flash_attention.py loaded into this process (--baseline-file, default `git show
main:kernels/flash_attention.py`) at main's built-in and tuned tiles - and the new kernel at each
config of the sweep, printing ms and causal TFLOP/s (4 * head_dim * heads * causal pairs, both
passes in the time), the best of each, and the largest relative error of every output against
the first baseline's (bf16 tolerance). The cache rows past the chunk hold NaN: a kernel that
reads them without masking fails the check. A human table, then ONE final JSON line.

    git show main:kernels/flash_attention.py > .bench_main_attn.py
    PYTHONUNBUFFERED=1 python benchmarks/prefill_attention.py --baseline-file .bench_main_attn.py
    TRITON_INTERPRET=1 python benchmarks/prefill_attention.py --device cpu --tiny   (CPU smoke)
    python benchmarks/prefill_attention.py --compile-only [--all]    (offline sm_90a compile of
                          each config: registers, spills, shared memory, wgmma / TMA in the PTX)

--all widens the sweep; --configs picks entries by name (see CONFIGS).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import ROOT, interpret_if_cpu, ptxas_regs, shim_checkout  # noqa: E402

interpret_if_cpu()      # before triton.jit decorates anything

import torch  # noqa: E402


def _import_checkout():
    """tritonchat.kernels of THIS checkout (an install may point at another one): through a
    symlink shim when the imported one lives elsewhere (the device runs the repo uninstalled)."""
    try:
        import tritonchat.kernels.flash_attention as fa
        if Path(fa.__file__).resolve().is_relative_to(ROOT):
            return
    except ImportError:
        pass
    shim_checkout()


_import_checkout()

from tritonchat.kernels import flash_attention as new_mod  # noqa: E402
from tritonchat.kernels.flash_attention import (KV_POINTERS, KV_TMA, LOOP_PLAIN,  # noqa: E402
                                                LOOP_WARP_SPEC)

TRUE = dict(num_heads=8, num_kv_heads=2, head_dim=256, rotary_dim=64, rope_theta=1e7, eps=1e-6)
TINY = dict(num_heads=8, num_kv_heads=2, head_dim=48, rotary_dim=12, rope_theta=1e4, eps=1e-6)
SHAPES = ((2048, 0), (8192, 0), (8192, 24576))          # (T, start)
TINY_SHAPES = ((70, 0), (33, 40))


def _cfg(bm, bn, warps, stages, load=KV_TMA, loop=LOOP_PLAIN):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, KV_LOAD=load, LOOP=loop)


# main's built-in tile and its tuned H200 entries (kernels/prefill_tuning.json on main)
BASELINE = {"main built-in 64x32": dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2),
            "main table 64x64": dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2),
            "main table 128x32": dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2)}
# the new kernel's sweep: name -> config (None: the built-in choice)
CONFIGS = {
    "built-in": None,
    "tma 128x64 s2": _cfg(128, 64, 8, 2),
    "tma 128x64 s3": _cfg(128, 64, 8, 3),
    "tma 128x32 s2": _cfg(128, 32, 8, 2),
    "tma 128x128 s2": _cfg(128, 128, 8, 2),
    "ptr 128x64 s2": _cfg(128, 64, 8, 2, KV_POINTERS),
    "ptr 128x32 s2": _cfg(128, 32, 8, 2, KV_POINTERS),
    "tma 64x64 w4 s2": _cfg(64, 64, 4, 2),
    # 96 KB of shared memory and 4 warps: two programs a multiprocessor (one's softmax under
    # the other's matrix products)
    "tma 64x32 w4 s2": _cfg(64, 32, 4, 2),
    "tma 64x64 w4 s1": _cfg(64, 64, 4, 1),
    "tma ws 128x64 s2": _cfg(128, 64, 8, 2, loop=LOOP_WARP_SPEC),
}
MORE = {
    "tma 128x32 s3": _cfg(128, 32, 8, 3),
    "tma 128x64 s4": _cfg(128, 64, 8, 4),
    "tma 64x32 w4 s3": _cfg(64, 32, 4, 3),
    "tma 64x128 w4 s2": _cfg(64, 128, 4, 2),
    "tma 64x64 w8 s2": _cfg(64, 64, 8, 2),
    "tma ws 128x32 s2": _cfg(128, 32, 8, 2, loop=LOOP_WARP_SPEC),
    "tma ws 128x64 s3": _cfg(128, 64, 8, 3, loop=LOOP_WARP_SPEC),
    "tma ws 128x128 s2": _cfg(128, 128, 8, 2, loop=LOOP_WARP_SPEC),
}
TINY_CONFIGS = {"built-in": None,
                "tma 32x16 s2": _cfg(32, 16, 4, 2),
                "ptr 64x32 s1": _cfg(64, 32, 4, 1, KV_POINTERS),
                "tma ws 16x32 s2": _cfg(16, 32, 2, 2, loop=LOOP_WARP_SPEC)}
TINY_BASELINE = {"main built-in": None, "main 16x16": dict(BLOCK_M=16, BLOCK_N=16, num_warps=2,
                                                            num_stages=1)}


def load_baseline(path):
    """main's flash_attention module as tritonchat.kernels._flash_attention_main (its relative
    imports resolve inside the package): from `path`, else from git, else None."""
    if path is None:
        try:
            src = subprocess.run(["git", "-C", str(ROOT), "show", "main:kernels/flash_attention.py"],
                                 capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
        fd, path = tempfile.mkstemp(suffix="_flash_attention_main.py")
        with os.fdopen(fd, "w") as f:
            f.write(src)
    name = "tritonchat.kernels._flash_attention_main"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "tritonchat.kernels"
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def causal_flops(T, start, dims):
    pairs = T * start + T * (T + 1) // 2
    return 4 * dims["head_dim"] * dims["num_heads"] * pairs


class Case:
    """Inputs of one (T, start): random projections, a random cached history before `start`,
    NaN after the chunk (so unmasked reads past the written cache poison the output)."""

    def __init__(self, T, start, dims, dtype, device, seed):
        H, Hkv, hd = dims["num_heads"], dims["num_kv_heads"], dims["head_dim"]
        g = torch.Generator(device="cpu").manual_seed(seed)
        rnd = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
        self.T, self.start, self.dims = T, start, dims
        self.qg, self.k, self.v = rnd(T, H * 2 * hd) * 2, rnd(T, Hkv * hd) * 2, rnd(T, Hkv * hd)
        self.qw, self.kw = rnd(hd) * 0.3, rnd(hd) * 0.3
        max_ctx = start + T + 64
        self.k_cache = torch.full((Hkv, max_ctx, hd), float("nan"), device=device, dtype=dtype)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        if start:
            self.k_cache[:, :start] = rnd(Hkv, start, hd) * 2
            self.v_cache[:, :start] = rnd(Hkv, start, hd)
        self.out = torch.full((T, H * hd), float("nan"), device=device, dtype=dtype)

    def fn(self, mod, config):
        def run():
            mod.attention_prefill(self.qg, self.k, self.v, self.qw, self.kw, self.k_cache,
                                  self.v_cache, self.start, self.out, config=config, table=None,
                                  **self.dims)
        return run


def _time(fn, args):
    if args.device == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")


def _compiled(mod) -> dict:
    """{cache key: CompiledKernel} of the module's attention kernel (GPU), to report the
    registers / spills / shared memory of each config's compile."""
    try:
        return {k: v for cache in mod._attention_prefill_kernel.device_caches.values()
                for k, v in cache[0].items()}
    except (AttributeError, IndexError, TypeError):
        return {}


def _stats(kernels) -> str:
    out = []
    for k in kernels:
        try:
            out.append(f"{k.n_regs} regs, {k.n_spills} spills, {k.metadata.shared // 1024} KB smem")
        except AttributeError:
            pass
    return "; ".join(out)


def measure(case, mod, config, args, ref):
    """(ms, relative error against ref or None, the output) for one kernel + config; an error
    string instead when it fails to compile or run."""
    fn = case.fn(mod, config)
    seen = _compiled(mod)
    try:
        case.out.fill_(float("nan"))
        fn()
        out = case.out.clone()
        ms = _time(fn, args)
        new = [v for k, v in _compiled(mod).items() if k not in seen]
    except Exception as e:  # out of shared memory / registers / an unsupported knob
        if args.device != "cpu":
            torch.cuda.synchronize()
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
    err = None
    if ref is not None:
        diff = (out.float() - ref.float()).norm() / ref.float().norm()
        err = float(diff) if torch.isfinite(out).all() else float("inf")
    return ms, err, out, _stats(new)


def run_shape(T, start, args, base_mod, dims, baseline, configs):
    case = Case(T, start, dims, args.dtype, args.device, seed=T + start)
    fl = causal_flops(T, start, dims)
    print(f"T = {T}, start = {start}: {fl / 1e9:.1f} GFLOP causal", flush=True)
    rows, ref = [], None
    entries = ([("base", n, c) for n, c in baseline.items()] if base_mod else []) + \
        [("new", n, c) for n, c in configs.items()]
    for kind, name, cfg in entries:
        r = measure(case, base_mod if kind == "base" else new_mod, cfg, args, ref)
        if isinstance(r, str):
            print(f"  {kind:4s} {name:22s} failed: {r}", flush=True)
            rows.append(dict(kind=kind, name=name, error=r))
            continue
        ms, err, out, stats = r
        if ref is None:
            ref, err = out, 0.0
        ok = err is not None and err < args.tol
        tf = fl / (ms * 1e-3) / 1e12
        print(f"  {kind:4s} {name:22s} {ms:9.3f} ms  {tf:7.1f} TFLOP/s  rel err {err:.2e}"
              f"{'' if ok else '  MISMATCH'}{'  [' + stats + ']' if stats else ''}", flush=True)
        rows.append(dict(kind=kind, name=name, ms=ms, tflops=tf, rel_err=err, ok=ok,
                         compiled=stats))
    del case
    best = {}
    for kind in ("base", "new"):
        cand = [r for r in rows if r["kind"] == kind and r.get("ok")]
        if cand:
            best[kind] = min(cand, key=lambda r: r["ms"])
    if "base" in best and "new" in best:
        b, n = best["base"], best["new"]
        print(f"  best: main {b['name']} {b['ms']:.3f} ms -> new {n['name']} {n['ms']:.3f} ms "
              f"({b['ms'] / n['ms']:.2f}x, {n['tflops']:.0f} TFLOP/s)", flush=True)
    return dict(T=T, start=start, gflop=fl / 1e9, rows=rows,
                best={k: v["name"] for k, v in best.items()})


def compile_only(configs, dims) -> int:
    """Compile the new attention kernel for sm_90a without a GPU, one entry per config, as the
    launcher would at T >= 2048: the register / spill / shared-memory report of ptxas, and the
    PTX's wgmma and bulk-tensor-copy counts (did the tiles reach the tensor cores and TMA?)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    hd, group = dims["head_dim"], dims["num_heads"] // dims["num_kv_heads"]
    hdp, gp = max(16, 1 << (hd - 1).bit_length()), 1 << (group - 1).bit_length()
    out, ok = {}, True
    for name, cfg in configs.items():
        cfg = dict(new_mod._attention_config(8192, hdp, gp), **(cfg or {}))
        desc = cfg["KV_LOAD"] == KV_TMA
        kv = f"tensordesc<bf16[{cfg['BLOCK_N']}, {hdp}]>" if desc else "*bf16"
        sig = dict(qg_ptr="*bf16", q_norm_w_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16",
                   k_src=kv, v_src=kv, out_ptr="*bf16", T="i32", start_pos="i32", max_ctx="i32",
                   stride_qg="i32", stride_o="i32", qk_scale="fp32", eps="fp32")
        const = dict(GROUP=group, GROUP_P=gp, TOK=cfg["BLOCK_M"] // gp, HD=hd, HDP=hdp,
                     ROT=dims["rotary_dim"], BLOCK_N=cfg["BLOCK_N"],
                     PRO_ROWS=min(cfg["BLOCK_M"], new_mod._PROLOGUE_ROWS), KV_DESC=desc,
                     WARP_SPEC=cfg["LOOP"] == LOOP_WARP_SPEC, DOT_PREC="tf32", START_PTR=False,
                     PDL=0)
        sig.update({k: "constexpr" for k in const})
        # pointers 16-byte aligned and the strides multiples of 16, as a real launch specialises
        attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
                 if t.startswith("*") or n in ("max_ctx", "stride_qg", "stride_o")}
        t0 = time.time()
        try:
            k = triton.compile(ASTSource(fn=new_mod._attention_prefill_kernel, signature=sig,
                                         constexprs=const, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=cfg["num_warps"],
                                            num_stages=cfg["num_stages"]))
            ptx = k.asm["ptx"]
            info = dict(ok=True, s=round(time.time() - t0, 1), shared_kb=k.metadata.shared // 1024,
                        wgmma=ptx.count("wgmma.mma_async"),
                        tma=ptx.count("cp.async.bulk.tensor"), **ptxas_regs(ptx))
        except Exception as e:
            info = dict(ok=False, error=f"{type(e).__name__}: {e}"[-1500:])
            ok = False
        out[name] = dict(info, config=cfg)
        print(f"{name:22s} {json.dumps(info)}", flush=True)
    print(json.dumps({"compile_only": out}))
    return 0 if ok else 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="small heads and lengths (CPU smoke run)")
    p.add_argument("--compile-only", action="store_true", help="offline sm_90a compile report")
    p.add_argument("--all", action="store_true", help="sweep the wider config list too")
    p.add_argument("--configs", default=None, help="comma-separated names of the new configs")
    p.add_argument("--shapes", default=None, help="T:start,... (default the three chunk shapes)")
    p.add_argument("--baseline-file", default=None, help="a copy of main's flash_attention.py")
    p.add_argument("--baselines", default=None, help="comma-separated names of BASELINE entries")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default) / float32 (CPU default)")
    p.add_argument("--tol", type=float, default=None, help="relative error allowed vs baseline")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    a = p.parse_args(argv)
    a.dtype = getattr(torch, a.dtype or ("float32" if a.device == "cpu" else "bfloat16"))
    if a.tol is None:
        a.tol = 1e-4 if a.dtype == torch.float32 else 1e-2
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_only:
        configs = {**CONFIGS, **(MORE if args.all else {})}
        if args.configs:
            configs = {n: {**CONFIGS, **MORE}[n] for n in args.configs.split(",")}
        return compile_only(configs, TRUE)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("prefill_attention needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    t0 = time.time()
    dims = TINY if args.tiny else TRUE
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    configs = dict(TINY_CONFIGS if args.tiny else CONFIGS)
    if args.all and not args.tiny:
        configs.update(MORE)
    if args.configs:
        pool = {**CONFIGS, **MORE, **TINY_CONFIGS}
        configs = {n: pool[n] for n in args.configs.split(",")}
    baseline = TINY_BASELINE if args.tiny else BASELINE
    if args.baselines:
        baseline = {n: baseline[n] for n in args.baselines.split(",")}
    base_mod = None if args.no_baseline else load_baseline(args.baseline_file)
    if base_mod is None and not args.no_baseline:
        print("no baseline: pass --baseline-file (git show main:kernels/flash_attention.py)")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    import triton
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, {dims}", flush=True)
    results = [run_shape(T, s, args, base_mod, dims, baseline, configs) for T, s in shapes]
    ok = all(r.get("ok", True) for res in results for r in res["rows"] if "error" not in r)
    print(json.dumps(dict(gpu=gpu, triton=triton.__version__, dims=dims, shapes=results,
                          all_match=ok, seconds=round(time.time() - t0, 1))))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
