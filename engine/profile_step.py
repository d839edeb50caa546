"""Profile the captured decode step kernel by kernel (GPU only).

    python -m tritonchat.engine.profile_step [--pos 640] [--steps 50] [--json FILE]
    python -m tritonchat.engine.profile_step --prefill 2048 [--steps 20] [--json FILE]

The kernel panel times each kernel with CUDA events between launches, which adds the launch gaps
back in; this tool instead records the real graph replays with the CUDA profiler (CUPTI through
torch.profiler) at the true 0.8B shape on random weights, and reports for one step: each kernel's
count, mean duration and summed time, the time the GPU had at least one kernel running (the
union: overlap from programmatic dependent launch counts once), the step's wall time, and the
idle gaps between kernels - the fixed cost that fusion or a persistent kernel would remove.

`--prefill T` records instead what a chat's time to first token runs on the GPU: a prefill of T
tokens (replayed from its captured prefill graph up to 2,048 tokens, as the app runs it) and the
first token, per prefill: each kernel's count and time, the busy time. Timing each prefill
kernel alone overstates its share (cold caches, no overlap); this is the split inside the real
TTFT.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Optional

import torch


def _kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every GPU kernel the profiler recorded, in start order."""
    out = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name
        if name.startswith("Memcpy") or name.startswith("Memset"):
            continue
        start = ev.time_range.start
        out.append((name, float(start), float(ev.time_range.end)))
    out.sort(key=lambda e: e[1])
    return out


def summarize(events: list[tuple[str, float, float]], steps: int) -> dict:
    """Per-step statistics from `steps` replays' kernel events (pure arithmetic, testable)."""
    if not events:
        return {"kernels": [], "kernels_per_step": 0}
    per = defaultdict(lambda: [0, 0.0])
    for name, s, e in events:
        per[name][0] += 1
        per[name][1] += e - s
    busy = 0.0
    cur_s, cur_e = events[0][1], events[0][2]
    gaps = []
    for _, s, e in events[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = events[-1][2] - events[0][1]
    rows = sorted(({"name": n, "per_step": c / steps, "mean_us": t / c, "us_per_step": t / steps}
                   for n, (c, t) in per.items()), key=lambda r: -r["us_per_step"])
    return {
        "kernels": rows,
        "kernels_per_step": len(events) / steps,
        "sum_kernel_us_per_step": sum(r["us_per_step"] for r in rows),
        "busy_us_per_step": busy / steps,
        "span_us_per_step": span / steps,
        "idle_gaps_per_step": len(gaps) / steps,
        "idle_us_per_step": sum(gaps) / steps,
    }


def attribute_sites(sites: list[str], kernels: list[str]) -> Optional[list[str]]:
    """The engine call site of each kernel of one step, in order: `sites` are the engine's
    launch names in call order, `kernels` the GPU kernels of one step in order. A site launches
    one kernel, except the LM head site, which also takes the sampling kernels after it. None
    when the two sequences do not line up."""
    out: list[str] = []
    i = 0
    for j, site in enumerate(sites):
        if i >= len(kernels):
            return None
        out.append(site)
        i += 1
        nxt = sites[j + 1] if j + 1 < len(sites) else None
        if site.startswith("lm_head") and nxt is None:
            while i < len(kernels):
                out.append(site)
                i += 1
    return out if i == len(kernels) else None


def per_site(events: list[tuple[str, float, float]], sites: list[str], steps: int) -> Optional[list[dict]]:
    """Per call site (the engine's names: gemv_mlp_down, gdn_decode, ...), from `steps`
    steps of kernel events: its kernels' summed durations per step (overlap under programmatic
    dependent launch counted in each kernel) and its share of the critical path (each kernel's
    end minus the later of its start and the previous kernel's end: these shares sum to the
    step's span less its idle gaps). None if the events do not line up with the sites."""
    if not events or len(events) % steps:
        return None
    n = len(events) // steps
    names = [e[0] for e in events[:n]]
    owner = attribute_sites(sites, names)
    if owner is None:
        return None
    tot: dict = defaultdict(lambda: [0, 0.0, 0.0])
    prev_end = None
    for k, (_, s, e) in enumerate(events):
        site = owner[k % n]
        tot[site][0] += 1
        tot[site][1] += e - s
        # critical path: how much later the step ends because of this kernel (kernels of a step
        # finish in launch order, each waiting for the one before); a step's first kernel counts
        # from its own start, so the gap between graph replays is nobody's
        start = s if k % n == 0 or prev_end is None else max(s, prev_end)
        tot[site][2] += max(0.0, e - start)
        prev_end = e if prev_end is None else max(prev_end, e)
    rows = [{"site": site, "kernels_per_step": c / steps, "us_per_step": t / steps,
             "critical_us_per_step": m / steps}
            for site, (c, t, m) in tot.items()]
    return sorted(rows, key=lambda r: -r["critical_us_per_step"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pos", type=int, default=640, help="position the profiled steps decode at")
    ap.add_argument("--steps", type=int, default=50, help="graph replays to record")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--json", default=None, help="also write the summary here")
    ap.add_argument("--host", action="store_true", help="profile the host side of eager decode "
                    "steps and a prefill instead (cProfile)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt length for --host")
    ap.add_argument("--prefill", type=int, default=0,
                    help="profile prefills of this many tokens (+ the first token) instead")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_step needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile

    from .tuning.decode import replay_ms

    from .options import EngineOptions, SamplingParams
    from .config import qwen35_08b_config
    from .loader import random_backend

    cfg = qwen35_08b_config()
    be = random_backend(cfg, EngineOptions(backend="triton", device="cuda", dtype="bfloat16",
                                           max_context=max(args.context, args.pos + args.steps + 8),
                                           split_k=True, graph=True))
    be.prefill(list(range(1000, 1128)))
    be.begin_sampling(SamplingParams(greedy=True), [])
    be.sample()
    if args.host:
        return _host_profile(be, args)
    if args.prefill:
        return _prefill_profile(be, args)
    graph = be.graph_for(args.pos)             # the step of that position's context range
    for _ in range(3):
        replay_ms(graph, 20, before=lambda: be.pos_buf.fill_(args.pos))
    wall = replay_ms(graph, args.steps, before=lambda: be.pos_buf.fill_(args.pos))
    be.pos_buf.fill_(args.pos)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            graph.replay()
        torch.cuda.synchronize()
    events = _kernel_events(prof)
    summary = summarize(events, args.steps)
    # the engine's call site of each kernel: one eager step with the launches named
    sites: list[str] = []
    be.launcher.trace = lambda name, kw: sites.append(name)
    try:
        be.pos_buf.fill_(args.pos)
        with torch.inference_mode():
            be.decode_step()
        torch.cuda.synchronize()
    finally:
        be.launcher.trace = None
    summary["sites"] = per_site(events, sites, args.steps)
    summary["step_ms_unprofiled"] = wall
    summary["pos"] = args.pos
    summary["gpu"] = torch.cuda.get_device_name()
    print(f"step {wall * 1e3:.1f} us unprofiled; profiled span {summary.get('span_us_per_step', 0):.1f}"
          f" us, busy {summary.get('busy_us_per_step', 0):.1f} us, kernels summed "
          f"{summary.get('sum_kernel_us_per_step', 0):.1f} us, {summary['kernels_per_step']:.0f} "
          f"kernels, {summary.get('idle_gaps_per_step', 0):.0f} idle gaps = "
          f"{summary.get('idle_us_per_step', 0):.1f} us")
    print(f"{'kernel':60s} {'n/step':>6s} {'mean us':>8s} {'us/step':>8s}")
    for r in summary["kernels"]:
        print(f"{r['name'][:60]:60s} {r['per_step']:6.1f} {r['mean_us']:8.2f} {r['us_per_step']:8.1f}")
    if summary["sites"]:
        print(f"{'engine call site':40s} {'kernels':>7s} {'us/step':>8s} {'critical':>8s}")
        for r in summary["sites"]:
            print(f"{r['site'][:40]:40s} {r['kernels_per_step']:7.1f} {r['us_per_step']:8.1f} "
                  f"{r['critical_us_per_step']:8.1f}")
    else:
        print("(the engine's call sites did not line up with the recorded kernels)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def _prefill_profile(be, args) -> int:
    import time

    from torch.profiler import ProfilerActivity, profile

    ids = list(range(3000, 3000 + args.prefill))

    def ttft():
        be.reset()
        be.prefill(ids)
        be.sample()                                   # the first token, on the host

    for _ in range(3):
        ttft()                                        # compiled, prefill graph captured
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        ttft()
    wall = (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            ttft()
        torch.cuda.synchronize()
    # per prefill: the gaps between prefills (host work of reset/sample) count as idle
    summary = summarize(_kernel_events(prof), args.steps)
    summary.update(prefill_tokens=args.prefill, ttft_ms_unprofiled=wall * 1e3,
                   prefill_graph=bool(getattr(be, "prefill_graph", False)),
                   gpu=torch.cuda.get_device_name())
    print(f"prefill of {args.prefill} tokens + first token: {wall * 1e3:.2f} ms unprofiled; GPU busy "
          f"{summary.get('busy_us_per_step', 0) / 1e3:.2f} ms, {summary['kernels_per_step']:.0f} kernels")
    print(f"{'kernel':60s} {'n':>5s} {'mean us':>8s} {'ms':>7s}")
    for r in summary["kernels"]:
        print(f"{r['name'][:60]:60s} {r['per_step']:5.0f} {r['mean_us']:8.1f} {r['us_per_step'] / 1e3:7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def _host_profile(be, args) -> int:
    import cProfile
    import io
    import pstats
    import time

    be.configure(graph=False)
    tok = be.sample()

    def decode_steps(n):
        t = tok
        for _ in range(n):
            t = be.step(t)
        torch.cuda.synchronize()

    def prefill():
        be.reset()
        be.prefill(list(range(2000, 2000 + args.prompt)))
        be.sample()
        torch.cuda.synchronize()

    for name, fn, n in (("eager decode step", lambda: decode_steps(args.steps), args.steps),
                        (f"prefill of {args.prompt} tokens + first token", prefill, 1)):
        fn()
        fn()                                            # warm: compiled, caches filled
        t0 = time.perf_counter()
        fn()
        wall = (time.perf_counter() - t0) / n
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
        print(f"== {name}: {wall * 1e3:.3f} ms wall (unprofiled)")
        print("\n".join(line for line in buf.getvalue().splitlines()[6:] if line.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
