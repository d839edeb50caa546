"""The two decode modes (options.decode_mode, issue #59) in one process, on one backend: decode
speed of the per-operator step and of the persistent step (kernels/persistent_step.py) against
the HBM roofline measured in the same run, their greedy tokens compared, and the per-operator
time of both (the per-operator step's kernels by CUDA events, the persistent kernel's operators
by its %globaltimer stamps).

Random weights at the true 0.8B shape unless --model; prompt --prompt tokens, --new tokens
decoded greedily (EOS ignored), the CUDA graph on unless --no-graph; --long P also decodes with P
positions in the KV cache (each position's own roofline). A human table, then ONE final JSON
line.

    PYTHONUNBUFFERED=1 python benchmarks/persistent_step.py [--new 512] [--long 32768]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from persistent_common import import_tritonchat, round_floats  # noqa: E402

import_tritonchat()

import torch  # noqa: E402

from tritonchat.engine import bench as B  # noqa: E402
from tritonchat.engine.options import EngineOptions  # noqa: E402

MODES = ("per_op", "persistent")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: random weights, true shape)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--context", type=int, default=0, help="max context (0: enough for --long)")
    p.add_argument("--long", type=int, default=0, help="also decode at this many cached positions")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--no-split-k", action="store_true")
    p.add_argument("--timing-steps", type=int, default=24, help="timed steps for the operator table")
    p.add_argument("--plan", default="", help='persistent plan overrides as JSON, e.g. '
                   '\'{"programs_per_sm": 1, "num_warps": 8}\' (kernels.persistent_step.step_plan)')
    return p.parse_args(argv)


def _build(args):
    from tritonchat.engine.config import qwen35_08b_config
    from tritonchat.engine.loader import load_backend, random_backend
    ctx = args.context or max(4096, args.long + args.new + 64, args.prompt + args.new + 64)
    opts = EngineOptions(backend="triton", device="cuda", dtype="bfloat16", max_context=ctx,
                         graph=not args.no_graph, split_k=not args.no_split_k)
    if args.model:
        return load_backend(args.model, opts)
    cfg = qwen35_08b_config()
    return cfg, random_backend(cfg, opts)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (the interpreter tests: tests/engine/test_persistent_step.py)")
    t_start = time.time()
    cfg, be = _build(args)
    if args.plan:
        be.set_plans({"persistent": json.loads(args.plan)})
    props = torch.cuda.get_device_properties(0)
    roof = be.measure_roofline()
    roof_tok_s = roof["gb_s"] * 1e9 / roof["bytes_per_token"]
    prompt = B._random_prompt(args.prompt, cfg.vocab_size)
    res = dict(gpu=props.name, sms=props.multi_processor_count, hbm_gb_s=roof["gb_s"],
               bytes_per_token=roof["bytes_per_token"], roofline_tok_s=roof_tok_s,
               prompt=args.prompt, new_tokens=args.new, graph=not args.no_graph,
               split_k=not args.no_split_k, plan_overrides=args.plan or None, modes={})
    print(f"# {props.name}: HBM {roof['gb_s']:.0f} GB/s, {roof['bytes_per_token'] / 1e9:.3f} GB a token, "
          f"roofline {roof_tok_s:.0f} tok/s", flush=True)
    for mode in MODES:
        be.configure(decode_mode=mode)
        r = dict(step=type(be.decode_step).__name__)
        res["modes"][mode] = r
        if be.options.decode_mode != mode:
            r["error"] = be.decode_mode_error
            print(f"# {mode}: {be.decode_mode_error}", flush=True)
            continue
        if mode == "persistent":
            r["plan"] = be.decode_step.plan
            r["occupancy"] = be.decode_step.occupancy
        run = B.decode_run(be, prompt, args.new)
        r.update({k: run[k] for k in ("decode_tok_s", "ms_per_token", "gpu_step_ms") if k in run})
        r["fraction_of_roofline"] = run["decode_tok_s"] / roof_tok_s
        r["token_ids"] = run["token_ids"]
        if mode == "persistent":
            r["spin_timeout"] = be.decode_step.errored()
        print(f"# {mode:<11} {run['decode_tok_s']:8.1f} tok/s  {run['ms_per_token']:.3f} ms/token  "
              f"{100 * r['fraction_of_roofline']:5.1f}% of the roofline  "
              f"(GPU step {run.get('gpu_step_ms', float('nan')):.3f} ms)", flush=True)
        if args.long:
            lr = B.long_context_run(be, cfg, args.long, min(args.new, 256), roof["gb_s"])
            r["long"] = lr
            print(f"#   at {args.long} positions: {lr['decode_tok_s']:.1f} tok/s, "
                  f"{100 * lr['fraction_of_roofline']:.1f}% of its roofline", flush=True)
        rows = B.kernel_table(be, prompt, args.timing_steps) or []
        r["ops"] = {row["name"]: dict(us=row["us_per_token"], gb_s=row["gb_s"],
                                      per_token=row["launches_per_token"]) for row in rows}
    _report(res)
    res["seconds"] = round(time.time() - t_start, 1)
    for r in res["modes"].values():
        r.pop("token_ids", None)
    print(json.dumps(round_floats(res), default=str))
    return 0


def _report(res):
    a, b = (res["modes"].get(m, {}) for m in MODES)
    ta, tb = a.get("token_ids"), b.get("token_ids")
    if ta and tb:
        diff = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        res["tokens_identical"] = diff is None
        res["first_difference"] = diff
        print(f"# greedy tokens: {'identical' if diff is None else f'first difference at token {diff}'}")
    if a.get("decode_tok_s") and b.get("decode_tok_s"):
        res["speedup"] = b["decode_tok_s"] / a["decode_tok_s"]
    names = sorted(set(a.get("ops", {})) | set(b.get("ops", {})),
                   key=lambda n: -max(a.get("ops", {}).get(n, {}).get("us", 0),
                                      b.get("ops", {}).get(n, {}).get("us", 0)))
    if names:
        print(f"\n{'operator':<30} {'per_op us':>10} {'GB/s':>6} {'persistent us':>14} {'GB/s':>6}")
        for n in names:
            x, y = a.get("ops", {}).get(n, {}), b.get("ops", {}).get(n, {})
            print(f"{n:<30} {x.get('us', float('nan')):10.1f} {x.get('gb_s', float('nan')):6.0f} "
                  f"{y.get('us', float('nan')):14.1f} {y.get('gb_s', float('nan')):6.0f}")


if __name__ == "__main__":
    sys.exit(main())
