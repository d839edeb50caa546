"""What the persistent decode-step premise tests (issue #59) share: benchmarks/persistent_mlp.py
(the MLP chain) and benchmarks/persistent_gdn.py (whole Gated DeltaNet layers).

    device helpers, co-residency check      re-exported from tritonchat.kernels._persistent
    host                                    the tritonchat import, CUDA-graph timing,
                                            rel_err, the watchdog, rounding of the JSON
    driver                                  the arguments both take, device and L2, the
                                            offline sm_90 compile, the HBM read rate and
                                            roofline, the variant loop, the best variant

The scripts choose the interpreter (TRITON_INTERPRET=1 for --device cpu) before importing this
module: triton.jit reads it when it decorates the kernels this module imports.
"""
from __future__ import annotations

import json
import os
import statistics
import time
import traceback

import torch
import triton

from _bench_util import ptxas_regs, shim_checkout

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def import_tritonchat():
    """tritonchat.kernels from an install, else from this checkout through a symlink shim (the
    device runs the repo without installing it)."""
    try:
        import tritonchat.kernels.gemv  # noqa: F401
        return
    except ImportError:
        pass
    shim_checkout()


import_tritonchat()

# the persistent kernels' device helpers and the co-residency check live with the engine's
# persistent decode step (kernels/_persistent.py); re-exported for the scripts
from tritonchat.kernels._common import cdiv, next_pow2  # noqa: E402,F401
from tritonchat.kernels._persistent import (check_co_resident, globaltimer,  # noqa: E402,F401
                                            programs_per_sm, rows_load, signal, stall,
                                            wait_counter)


# ------------------------------------------------------------------------------------------
# host: timing
# ------------------------------------------------------------------------------------------

def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def make_timed(runner, n_sets, reps, graph):
    """A callable that enqueues `reps` chains of runner.run(s) (weight sets in turn), CUDA-graph
    captured when `graph` (eager if the capture fails); (fn, chains per call, graphed)."""
    dev = runner.c.device

    def eager():
        for k in range(reps):
            runner.run(k % n_sets)
    for _ in range(2):
        eager()
    sync(dev)
    if not graph or dev.type != "cuda":
        return eager, reps, False
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            eager()
        g.replay()
        sync(dev)
    except Exception as e:
        print(f"#   graph capture failed ({type(e).__name__}: {e}); timing eagerly", flush=True)
        sync(dev)
        return eager, reps, False
    runner._graphs = getattr(runner, "_graphs", []) + [g]       # keep it alive
    return g.replay, reps, True


def time_us(fn, per_call, iters, dev):
    """us per chain over `iters` calls (CUDA events on the GPU, wall clock on the CPU)."""
    if dev.type == "cuda":
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        fn()
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3 / (iters * per_call)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1e6 / (iters * per_call)


def rel_err(out, ref):
    out, ref = out.float(), ref.float()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------
# host: reporting
# ------------------------------------------------------------------------------------------

def start_watchdog(res, seconds, t_start):
    """A daemon thread that prints the results so far as the final JSON line (partial: true)
    and ends the process if the run outlasts `seconds` (a kernel that never returns would
    otherwise hang it: a CUDA launch cannot be interrupted from Python)."""
    import threading

    def fire():
        try:
            res["partial"] = True
            res["seconds"] = round(time.time() - t_start, 1)
            busy = [n for n, r in res.get("variants", {}).items() if "seconds" not in r]
            res["hung_in"] = busy[-1] if busy else None
            print(f"# watchdog: deadline reached while running {res['hung_in']}", flush=True)
            print(json.dumps(round_floats(res), default=str), flush=True)
        finally:
            os._exit(3)
    t = threading.Timer(max(1.0, seconds), fire)
    t.daemon = True
    t.start()
    return t


def round_floats(o):
    if isinstance(o, float):
        return round(o, 5)
    if isinstance(o, dict):
        return {k: round_floats(v) for k, v in o.items()}
    if isinstance(o, list):
        return [round_floats(v) for v in o]
    return o


# ------------------------------------------------------------------------------------------
# host: the driver (arguments, device, watchdog, HBM rate, variant loop, verdict)
# ------------------------------------------------------------------------------------------

def add_driver_args(p, by_name, default_variants, layers, iters, reps):
    """The arguments both premise tests take, ahead of each script's own."""
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--iters", type=int, default=iters, help="graph replays per timing round")
    p.add_argument("--reps", type=int, default=reps, help="chains per graph (per replay)")
    p.add_argument("--rounds", type=int, default=5, help="timing rounds (median reported)")
    p.add_argument("--variant", default=default_variants,
                   help=f"comma list from: {', '.join(by_name)}")
    p.add_argument("--all", action="store_true", help="every variant")


def add_run_args(p, deadline_s, cpu_programs_help, compile_only_help):
    """The arguments both premise tests take after each script's own: spin guard, HBM rate,
    interpreter grid, watchdog, offline compile."""
    p.add_argument("--spin-timeout-ms", type=float, default=50.0)
    p.add_argument("--bw-bytes", type=float, default=1e9, help="buffer read for the HBM rate")
    p.add_argument("--cpu-programs", type=int, default=3, help=cpu_programs_help)
    p.add_argument("--deadline-s", type=float, default=deadline_s,
                   help="watchdog: past this, print what was measured (JSON, partial) and "
                        "exit 3 (a hung kernel cannot be interrupted otherwise); 0: off")
    p.add_argument("--compile-only", action="store_true", help=compile_only_help)


def selected(args, by_name):
    """The variants --all or --variant names, in order."""
    names = list(by_name) if args.all else [n.strip() for n in args.variant.split(",") if n.strip()]
    bad = [n for n in names if n not in by_name]
    if bad:
        raise SystemExit(f"unknown variants {bad}; choose from {list(by_name)}")
    return [by_name[n] for n in names]


def compile_sm90(fn, sig, constexprs, num_warps, ptx_counts):
    """Offline sm_90 compile of `fn` (no GPU): dict(ok, s, cubin, **ptx_counts(ptx), shared,
    **ptxas registers), or dict(ok=False, error)."""
    from triton.backends.compiler import GPUTarget
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    else:
        from triton.compiler import ASTSource
    s = dict(sig)
    s.update({k: "constexpr" for k in constexprs})
    t0 = time.time()
    try:
        # pointers 16-byte aligned, as a real launch specialises them (vector loads)
        attrs = {(i,): [["tt.divisibility", 16]]
                 for i, (n, t) in enumerate(sig.items()) if t.startswith("*")}
        k = triton.compile(ASTSource(fn=fn, signature=s, constexprs=constexprs, attrs=attrs),
                           target=GPUTarget("cuda", 90, 64), options=dict(num_warps=num_warps))
        ptx = k.asm["ptx"]
        info = dict(ok=True, s=round(time.time() - t0, 1), cubin=len(k.asm["cubin"]),
                    **ptx_counts(ptx), shared=int(k.metadata.shared))
        info.update(ptxas_regs(ptx))
    except Exception as e:
        info = dict(ok=False, error=f"{type(e).__name__}: {e}"[-2000:])
    return info


def compile_only_result(out):
    """The final JSON line of --compile-only; exit status 0 when every compile succeeded."""
    print(json.dumps({"compile_only": out}))
    return 0 if all(i.get("ok") for i in out.values()) else 1


def open_device(args, cpu_hint):
    """The torch device of --device, refused without CUDA or (on CPU) without the interpreter."""
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"no CUDA device; use {cpu_hint} under TRITON_INTERPRET=1")
    if dev.type == "cpu" and not INTERPRET:
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1")
    return dev


def device_l2(dev, res):
    """L2 bytes of the GPU (50 MiB off CUDA); on CUDA its name, SMs and L2 go into res, and
    TF32 is off for the references."""
    l2 = 50 << 20
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        l2 = int(getattr(props, "L2_cache_size", l2) or l2)
        res.update(gpu=props.name, sms=props.multi_processor_count, l2_bytes=l2)
        torch.backends.cuda.matmul.allow_tf32 = False
    return l2


def under_watchdog(args, res, t_start, run):
    """run() with the --deadline-s watchdog armed over it (res["variants"] is what it prints)."""
    watchdog = None
    if args.deadline_s > 0:
        watchdog = start_watchdog(res, args.deadline_s - (time.time() - t_start), t_start)
    try:
        return run()
    finally:
        if watchdog is not None:
            watchdog.cancel()


def hbm_roofline(args, dev, res, nbytes):
    """The HBM read rate measured in this run (kernels/bandwidth.py; None off CUDA or when it
    fails) and the roofline of reading `nbytes` at it, in us; both go into res."""
    bw = None
    if dev.type == "cuda":
        try:
            from tritonchat.kernels.bandwidth import read_rates_gb_s
            rates = read_rates_gb_s(int(args.bw_bytes), dev)
            bw = max(rates.values())
            res["hbm_read_gb_s"] = {k: round(v, 1) for k, v in rates.items()}
        except Exception as e:
            print(f"# bandwidth measurement failed: {e}", flush=True)
    roof_us = nbytes / (bw * 1e3) if bw else None
    res["hbm_gb_s"] = round(bw, 1) if bw else None
    res["roofline_us"] = round(roof_us, 3) if roof_us else None
    return bw, roof_us


def run_variants(variants, measure, out, dev, row):
    """measure(v) for each variant into out[v.name] (what, mode, its results, seconds); a
    failure is recorded and the loop goes on, unless it took the CUDA context down."""
    for v in variants:
        r = dict(what=v.what, mode=v.mode)
        out[v.name] = r
        t_v = time.time()
        try:
            measure(v)
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {e}"[:1500]
            r["traceback"] = traceback.format_exc()[-1500:]
            print(f"# {v.name} FAILED: {r['error']}", flush=True)
            if dev.type == "cuda":
                try:
                    torch.cuda.synchronize()
                except Exception as e2:       # a dead context: later variants cannot run
                    print(f"# CUDA context lost ({e2}); stopping", flush=True)
                    r["seconds"] = round(time.time() - t_v, 1)
                    break
        r["seconds"] = round(time.time() - t_v, 1)
        print("# " + row(v.name, r), flush=True)


def time_chains(runner, n_sets, args, graph, dev, r):
    """r["graphed"], r["us_per_chain"] (the median of --rounds rounds) and r["us_min"]: the
    runner's chain cycled over `n_sets` weight sets, in a CUDA graph where `graph`; raises when a
    spin timed out meanwhile."""
    fn, per, graphed = make_timed(runner, n_sets, args.reps, graph)
    r["graphed"] = graphed
    ts = [time_us(fn, per, args.iters, dev) for _ in range(args.rounds)]
    r["us_per_chain"] = statistics.median(ts)
    r["us_min"] = min(ts)
    if runner.errored():
        raise RuntimeError("spin timeout during timing")


def stall_cost(runner, stall_op, injected_ns, n_sets, args, graph, dev, r):
    """What one task stalling --stall-ns costs the chain: the same compiled kernel with stall 0
    and --stall-ns in one task of operator `stall_op`, alternated over --rounds, into r;
    injected_ns() reads the stall the kernel actually spent."""
    fns = []
    for ns in (0, args.stall_ns):
        runner.stall_op, runner.stall_ns = stall_op, ns
        fns.append(make_timed(runner, n_sets, args.reps, graph))
    runner.stall_op, runner.stall_ns = -1, 0
    t0s, t1s = [], []
    for _ in range(args.rounds):
        t0s.append(time_us(fns[0][0], fns[0][1], args.iters, dev))
        t1s.append(time_us(fns[1][0], fns[1][1], args.iters, dev))
    r["stall_us_injected"] = injected_ns() / 1e3
    r["stall_base_us"] = statistics.median(t0s)
    r["stall_cost_us"] = statistics.median(t1s) - statistics.median(t0s)
    r["stall_cost_spread_us"] = [min(t1s) - max(t0s), max(t1s) - min(t0s)]
    if runner.errored():
        raise RuntimeError("spin timeout during the stall runs")


def best_persistent(out):
    """The correct persistent variant nearest the roofline, or None."""
    best = None
    for name, r in out.items():
        if r.get("mode") in ("persist", "ring") and r.get("correct") and "frac_roofline" in r:
            if best is None or r["frac_roofline"] > out[best]["frac_roofline"]:
                best = name
    return best
