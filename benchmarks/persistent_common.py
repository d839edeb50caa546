"""What the persistent decode-step premise tests (issue #59) share: benchmarks/persistent_mlp.py
(the MLP chain) and benchmarks/persistent_gdn.py (whole Gated DeltaNet layers).

    device helpers (inline PTX, GPU only)   globaltimer, stall, wait_counter, signal
    weight tiles                            rows_load
    host                                    the tritonchat import, CUDA-graph timing,
                                            rel_err, the co-residency check of a persistent
                                            grid, the watchdog, rounding of the JSON

The scripts choose the interpreter (TRITON_INTERPRET=1 for --device cpu) before importing this
module: triton.jit reads it when it decorates the functions below.
"""
from __future__ import annotations

import json
import os
import time

import torch
import triton
import triton.language as tl

from _bench_util import shim_checkout

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


def cdiv(a, b):
    return -(-a // b)


def next_pow2(n):
    return 1 << max(0, int(n - 1).bit_length())


# ------------------------------------------------------------------------------------------
# device helpers (GPU only: inline PTX is not available in the interpreter)
# ------------------------------------------------------------------------------------------

@triton.jit
def globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def stall(ns, stamp_ptr):
    """Spin `ns` nanoseconds on %globaltimer; the time actually spent goes to stamp_ptr[0]."""
    t0 = globaltimer()
    t = t0
    while t - t0 < ns:
        t = globaltimer()
    tl.store(stamp_ptr, t - t0)


@triton.jit
def wait_counter(cnt_ptr, target, err_ptr, timeout_ns, SPIN: tl.constexpr):
    """Block the program until cnt_ptr[0] >= target (acquire). Spins on an acquire atomic
    (SPIN 0: one thread reads, the value is broadcast, so the loop is uniform) or on a volatile
    load followed by one acquire atomic (SPIN 1). After `timeout_ns` it gives up and sets
    err_ptr[0] = 1 instead of hanging (a grid that is not co-resident would deadlock)."""
    c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    if c < target:
        t0 = globaltimer()
        while c < target:
            if SPIN == 0:
                c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
            else:
                c = tl.load(cnt_ptr, volatile=True)
            if globaltimer() - t0 > timeout_ns:
                tl.atomic_xchg(err_ptr, 1)
                c = target
        if SPIN == 1:
            c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    # every thread's later activation loads after the acquiring thread's read
    tl.debug_barrier()


@triton.jit
def signal(cnt_ptr, n):
    """cnt_ptr[0] += n after all of this program's stores (barrier, then a release atomic)."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, n, sem="release", scope="gpu")


@triton.jit
def rows_load(base, rows, ok, offs, K: tl.constexpr, KP: tl.constexpr):
    """W[rows, :K] of a row-major [*, K] matrix as a [len(rows), KP] tile (rows with ok False and
    columns >= K read as 0 and cost no memory traffic); weights stream once: evict_first."""
    ptrs = base + rows.to(tl.int64)[:, None] * K + offs[None, :]
    if KP == K:
        m = ok[:, None]
    else:
        m = ok[:, None] & (offs < K)[None, :]
    return tl.load(ptrs, mask=m, other=0.0, eviction_policy="evict_first")


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
# host: the persistent grid must be co-resident
# ------------------------------------------------------------------------------------------

def programs_per_sm(compiled, num_warps, device):
    """How many programs of a compiled kernel (JITFunction.warmup's result) one SM holds at once,
    from its registers, threads and shared memory: dict(regs, spills, shared,
    programs_per_sm_max). A persistent grid larger than SMs x that would deadlock."""
    compiled._init_handles()
    regs, spills = int(compiled.n_regs), int(compiled.n_spills)
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    props = torch.cuda.get_device_properties(device)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    thr_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    per_warp = cdiv(max(regs, 1) * 32, 256) * 256
    by_regs = (regs_sm // per_warp) // num_warps
    by_thr = thr_sm // (32 * num_warps)
    by_smem = smem_sm // (shared + 1024) if shared else 32
    return dict(regs=regs, spills=spills, shared=shared,
                programs_per_sm_max=min(by_regs, by_thr, by_smem, 32))


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
