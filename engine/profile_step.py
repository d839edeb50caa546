"""Profile the captured decode step kernel by kernel (GPU only).

    python -m tritonchat.engine.profile_step [--pos 640] [--steps 50] [--json FILE]
    python -m tritonchat.engine.profile_step --prefill 128,2048,8192,32768 [--steps 20] [--json FILE]

The kernel panel times each kernel with CUDA events between launches, which adds the launch gaps
back in; this tool instead records the real graph replays with the CUDA profiler (CUPTI through
torch.profiler) at the true 0.8B shape on random weights, and reports for one step: each kernel's
count, mean duration and summed time, the time the GPU had at least one kernel running (the
union: overlap from programmatic dependent launch counts once), the step's wall time, and the
idle gaps between kernels - the fixed cost that fusion or a persistent kernel would remove.

`--prefill T[,T...]` records instead what a chat's time to first token runs on the GPU: a prefill
of T tokens (replayed from its captured prefill graph up to 2,048 tokens, as the app runs it) and
the first token, per prefill: each kernel's count and time, the busy time, and per operator
family (GEMMs, chunked GDN, attention, ...) its time and achieved TFLOP/s against the FLOPs the
model does (`prefill_flops`), beside the cuBLAS bf16 GEMM rate measured in the same run (the
ceiling a GEMM family can be held to). Timing each prefill kernel alone overstates its share
(cold caches, no overlap); this is the split inside the real TTFT.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Optional

import torch


# operator families of the prefill kernels, by a substring of the kernel's name (first match)
FAMILIES = (("gemm", "gemm"), ("gdn_chunk", "gdn_chunk"), ("attention_prefill", "attention"),
            ("kv_cache_write", "kv_cache"), ("conv1d", "conv1d"), ("rms_norm", "rms_norm"),
            ("embedding", "embedding"), ("lm_head", "lm_head"))


def operator_family(kernel_name: str) -> str:
    """The family a prefill kernel belongs to ("other": sampling, copies, torch's own)."""
    for key, family in FAMILIES:
        if key in kernel_name:
            return family
    return "other"


def prefill_flops(cfg, T: int, start: int = 0) -> dict:
    """FLOPs (multiply-add = 2) of a T-token prefill at positions start.. and its first token,
    per family: the projections (every layer's GEMMs, x @ W^T over the T rows), causal
    attention (q.k and p.v over the pairs s <= t of every head), the chunked gated delta rule
    (per chunk of C = 64 rows and head: K K^T, the W / U solves, W S0, Q S0, Q K^T, its
    product with the deltas, the state update), and the LM head on the last row."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    Hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    n_attn, n_gdn = len(cfg.full_attention_layers), len(cfg.linear_attention_layers)
    attn_proj = D * (2 * H * hd + 2 * KV * hd) + H * hd * D
    gdn_proj = D * (cfg.conv_dim + 2 * Hv + cfg.linear_value_dim) + cfg.linear_value_dim * D
    mlp = 3 * D * I
    gemm = 2 * T * (n_attn * attn_proj + n_gdn * gdn_proj + (n_attn + n_gdn) * mlp)
    pairs = T * start + T * (T + 1) // 2
    attention = n_attn * H * 4 * hd * pairs
    C = 64
    per_chunk = 2 * C * C * dk * 3 + 2 * C * C * dv * 2 + 2 * C * dk * dv * 3
    gdn = n_gdn * Hv * per_chunk * -(-T // C)
    return {"gemm": gemm, "attention": attention, "gdn_chunk": gdn, "lm_head": 2 * D * cfg.vocab_size}


def gemm_rate_tflops(n: int = 8192, reps: int = 20) -> float:
    """cuBLAS bf16 rate on an n x n x n GEMM (TFLOP/s): the tensor-core ceiling of this GPU."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        a @ b
    e1.record()
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (e0.elapsed_time(e1) * 1e-3) / 1e12


def family_table(summary: dict, flops: dict) -> list[dict]:
    """Per operator family of one prefill: kernels, ms, share of the kernels' summed time,
    TFLOP and TFLOP/s where the family has a FLOP count."""
    fam: dict = defaultdict(lambda: [0.0, 0.0])
    for r in summary["kernels"]:
        f = fam[operator_family(r["name"])]
        f[0] += r["per_step"]
        f[1] += r["us_per_step"]
    total = sum(us for _, us in fam.values()) or 1.0
    rows = []
    for name, (n, us) in sorted(fam.items(), key=lambda kv: -kv[1][1]):
        row = {"family": name, "kernels": n, "ms": us / 1e3, "share": us / total}
        if flops.get(name):
            row["tflop"] = flops[name] / 1e12
            row["tflop_s"] = flops[name] / (us * 1e-6) / 1e12
        rows.append(row)
    return rows


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
    ap.add_argument("--prefill", default="",
                    help="profile prefills of these many tokens (comma-separated; + the first token) instead")
    args = ap.parse_args(argv)
    args.prefill = [int(x) for x in str(args.prefill).split(",") if x]
    if args.prefill:
        args.context = max(args.context, max(args.prefill) + 64)
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
    out = {"gpu": torch.cuda.get_device_name(), "cublas_bf16_tflop_s": gemm_rate_tflops(),
           "prefill_graph": bool(getattr(be, "prefill_graph", False)), "prefills": []}
    print(f"{out['gpu']}: cuBLAS bf16 GEMM {out['cublas_bf16_tflop_s']:.0f} TFLOP/s (8192^3)")
    for T in args.prefill:
        out["prefills"].append(_prefill_one(be, T, args.steps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({"prefill_profile": [{k: p[k] for k in ("prefill_tokens", "ttft_ms_unprofiled",
                                                             "busy_ms", "tflop_s", "families")}
                                          for p in out["prefills"]],
                      "gpu": out["gpu"], "cublas_bf16_tflop_s": out["cublas_bf16_tflop_s"]}))
    return 0


def _prefill_one(be, T: int, steps: int) -> dict:
    import time

    from torch.profiler import ProfilerActivity, profile

    ids = list(range(3000, 3000 + T))
    steps = max(1, steps if T <= 2048 else steps // 4)

    def ttft():
        be.reset()
        be.prefill(ids)
        be.sample()                                   # the first token, on the host

    for _ in range(3):
        ttft()                                        # compiled, prefill graph captured
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        ttft()
    wall = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            ttft()
        torch.cuda.synchronize()
    # per prefill: the gaps between prefills (host work of reset/sample) count as idle
    summary = summarize(_kernel_events(prof), steps)
    flops = prefill_flops(be.cfg, T)
    busy_ms = summary.get("busy_us_per_step", 0) / 1e3
    summary.update(prefill_tokens=T, ttft_ms_unprofiled=wall * 1e3, busy_ms=busy_ms,
                   tflop=sum(flops.values()) / 1e12,
                   tflop_s=sum(flops.values()) / wall / 1e12 if wall else 0.0,
                   families=family_table(summary, flops))
    print(f"\nprefill of {T} tokens + first token: {wall * 1e3:.2f} ms unprofiled "
          f"({summary['tflop']:.2f} TFLOP, {summary['tflop_s']:.0f} TFLOP/s); GPU busy {busy_ms:.2f} ms, "
          f"{summary['kernels_per_step']:.0f} kernels")
    print(f"{'family':12s} {'kernels':>7s} {'ms':>8s} {'share':>6s} {'TFLOP':>7s} {'TFLOP/s':>8s}")
    for r in summary["families"]:
        extra = f" {r['tflop']:7.3f} {r['tflop_s']:8.0f}" if "tflop" in r else ""
        print(f"{r['family']:12s} {r['kernels']:7.0f} {r['ms']:8.3f} {100 * r['share']:5.1f}%{extra}")
    print(f"{'kernel':60s} {'n':>5s} {'mean us':>8s} {'ms':>7s}")
    for r in summary["kernels"]:
        print(f"{r['name'][:60]:60s} {r['per_step']:5.0f} {r['mean_us']:8.1f} {r['us_per_step'] / 1e3:7.3f}")
    return summary


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
