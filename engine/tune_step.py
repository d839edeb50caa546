"""Tune the decode launch plans inside the real decode step (GPU only).

    python -m tritonchat.engine.tune_step --out kernels/decode_tuning.json [--budget-s 300]
        [--margin 0.01] [--only 6176x1024,gdn_core,lm_head] [--no-split-k] [--max-context 4096]

`tritonchat.engine.tuning.decode` times every kernel alone; inside the step a kernel overlaps its
neighbours (programmatic dependent launch lets the next kernel's programs prefetch weights while
this one runs), so the fastest kernel alone is not always the fastest in the step. This tool
builds the Triton engine at the true 0.8B shape on random weights, captures the decode step into
a CUDA graph and measures whole steps (graph replays back to back, the position reset to the
same value before every measurement so the attention work is identical). Then, one kernel at a
time, it swaps that kernel's plan for each candidate, re-captures, and keeps a candidate only
when the whole step gets faster by more than the noise margin (coordinate descent, two passes
when the time budget allows). The PDL trigger point (the pdl_early option) is measured both ways
first. The winners are written into the decode table (the launchers read it by key), each entry
keeping its isolated `us` and the best direct (split_k = 1) form for "split-K off", and the file
records the step time before and after.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

KEEP_MARGIN = 0.99      # a candidate must cut the step by > 1% (then confirmed) to replace the plan
                        # (--margin sets it: re-measured replays of one step agree within ~0.2%)


def _step_ms(be, pos: int, reps: int = 5, n: int = 40) -> float:
    """Median ms of one decode step: graph replays back to back from position `pos`."""
    from .tuning.decode import replay_ms

    g = be.graph_for(pos)                       # captures (JIT first) if needed
    return statistics.median(replay_ms(g, n, before=lambda: be.pos_buf.fill_(pos))
                             for _ in range(reps))


def _gemv_candidates(n_out: int, k: int, prologue: str, head_dim: int, silu_mul: bool = False):
    """Plans to try for one GEMV: the persistent direct form first (the structural candidate),
    then tiles x warps x split-K of the grid form."""
    from tritonchat.kernels.gemv import gated_persistent_ok
    small = n_out <= 2048
    if prologue != "gated" or gated_persistent_ok(k, head_dim):
        kp = max(16, 1 << (k - 1).bit_length())
        for per_sm in (1, 2):
            for bn in (2, 4, 8, 16):
                if not 2048 <= bn * kp * (2 if silu_mul else 1) <= 16384:
                    continue
                for nw in (4, 8):
                    yield dict(block_n=bn, block_k=min(kp, 1024), num_warps=nw, split_k=1,
                               persistent=per_sm)
    if prologue == "gated":
        bks = [64, 128]
    else:
        bks = [256, 512, 1024] if k <= 1024 else [256, 512]
    bns = [2, 4, 8, 16, 32] if small else [4, 8, 16, 32]
    splits = [1, 2, 4, 8] if small else [1]
    for bk in bks:
        if prologue == "gated" and bk > head_dim:
            continue
        for bn in bns:
            if not 1024 <= bn * bk <= 16384:
                continue
            for nw in ([4, 8] if bn * bk >= 8192 else [4]):
                for s in splits:
                    if s > 1 and (k // (head_dim if prologue == "gated" else bk)) < 2 * s:
                        continue
                    yield dict(block_n=bn, block_k=bk, num_warps=nw, split_k=s, persistent=0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="decode table to update (default: the packaged one)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop trying candidates after this")
    ap.add_argument("--pos", type=int, default=640, help="position the measured steps decode at")
    ap.add_argument("--margin", type=float, default=1 - KEEP_MARGIN,
                    help="fraction a candidate must cut the step by, twice, to be kept (default 0.01)")
    ap.add_argument("--only", default="",
                    help="comma-separated parts of plan names to tune (e.g. 6176x1024,gdn_core,lm_head); "
                         "default all")
    ap.add_argument("--no-split-k", action="store_true", help="skip the split-K candidates")
    ap.add_argument("--model", default=None, help="tune for this model folder's shapes (random weights; "
                                              "default: the 0.8B)")
    ap.add_argument("--max-context", type=int, default=4096, help="the engine's context while tuning")
    args = ap.parse_args(argv)
    if not 0.0 <= args.margin < 0.5:
        print("tune_step: --margin must be a fraction in [0, 0.5)", file=sys.stderr)
        return 2
    keep = 1.0 - args.margin
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    wanted = lambda name: not only or any(x in name for x in only)  # noqa: E731
    if not torch.cuda.is_available():
        print("tune_step needs a CUDA GPU", file=sys.stderr)
        return 2
    from tritonchat.kernels import _common
    from tritonchat.kernels import gemv as G
    from .tuning.decode import lm_head_persistent_candidates

    from .options import EngineOptions, SamplingParams
    from .loader import random_backend

    log = lambda s: print(s, flush=True)  # noqa: E731
    out_path = args.out or _common.DECODE_TABLE_PATH
    t_start = time.time()
    from .tuning import model_config
    cfg = model_config(args.model)
    be = random_backend(cfg, EngineOptions(backend="triton", device="cuda", dtype="bfloat16",
                                           max_context=args.max_context, split_k=True, graph=True))
    be.set_context_ranges(False)                 # the base plans, at every position
    be.prefill(list(range(1000, 1128)))
    be.begin_sampling(SamplingParams(greedy=True), [])     # the greedy step: LM head + argmax
    be.sample()
    table = _common.decode_table()                     # the launchers' dict: edited in place

    def measure() -> float:
        be.set_plans(be.plan_overrides)           # a new step: captured again, table re-read
        return _step_ms(be, args.pos)

    # 1. where a kernel lets the next one launch
    res = {}
    for early in (False, True):
        be.configure(pdl_early=early)
        res[early] = measure()
        log(f"PDL trigger {'at start' if early else 'after wait'}: {res[early]:.4f} ms/step")
    be.configure(pdl_early=res[True] < res[False])
    base = start_ms = min(res.values())
    log(f"start: {base:.4f} ms/step ({1e3 / base:.0f} tok/s), pdl_early={be.options.pdl_early}")

    def trial(label: str, apply, restore) -> bool:
        """Measure the step with `apply()`'s plan; keep it only if it beats the current one by
        the margin, confirmed by measuring both again (clocks drift); else `restore()`."""
        nonlocal base
        apply()
        try:
            ms = measure()
        except Exception as e:  # noqa: BLE001 - a plan that does not compile/launch
            log(f"  skip {label}: {type(e).__name__}: {str(e)[:80]}")
            restore()
            return False
        if ms < base * keep:
            restore()
            base = min(base, measure())
            apply()
            ms = min(ms, measure())
        if ms < base * keep:
            log(f"  {label}: {base:.4f} -> {ms:.4f} ms")
            base = ms
            return True
        restore()
        return False

    def set_plan(key, plan: dict) -> None:
        """The step with `plan` for `key` (a GEMV's key or "lm_head"); it sizes its scratch."""
        be.set_plans(dict(be.plan_overrides, **{key: plan}))

    # 2. coordinate descent over the GEMV plans, the GDN core and the LM head
    keys = [k for k in be.decode_step.base_plans if k[0][0] != cfg.vocab_size]   # the sampled LM head: not in the greedy step
    core_key = f"gdn_core:{cfg.linear_num_value_heads}x{cfg.linear_key_head_dim}x{cfg.linear_value_head_dim}"
    lm_key = f"lm_head:{cfg.vocab_size}x{cfg.hidden_size}:rms"
    deadline = t_start + args.budget_s
    changed = {}
    for _sweep in range(2):
        improved = False
        # every key's persistent candidates first (the structural change), then the tile grid
        queue = []
        for persistent_pass in (True, False):
            for key in keys:
                (rows, k), pro, epi = key
                n_out = rows // 2 if epi == "silu_mul" else rows
                hd = cfg.linear_value_head_dim if pro == "gated" else 0
                name = G.plan_key(n_out, k, pro, epi)
                if not wanted(name):
                    continue
                for cand in _gemv_candidates(n_out, k, pro, hd, epi == "silu_mul"):
                    if args.no_split_k and cand["split_k"] > 1:
                        continue
                    if bool(cand["persistent"]) == persistent_pass:
                        queue.append((key, name, cand))
        for key, name, cand in queue:
            if time.time() > t_start + 0.8 * args.budget_s:     # leave time for core / LM head
                break
            cur = dict(be.decode_step.base_plans[key])
            if all(cand.get(x, 0) == cur.get(x, 0) for x in cand):
                continue
            if trial(f"{name} {cur} -> {cand}", lambda: set_plan(key, cand), lambda: set_plan(key, cur)):
                improved, changed[name] = True, dict(cand)
        # GDN core (the launcher reads the table at capture): the recurrence's tile and warps,
        # then the in_proj's z rows in its launch (rows per program, before or after the tiles)
        core_cands = ([dict(block_v=bv, num_warps=nw) for bv in (8, 16, 32, 64) for nw in (1, 2, 4, 8)]
                      + [dict(z_block_n=zbn, z_first=zf) for zbn in (1, 2, 4, 8) for zf in (True, False)])
        for cand in core_cands if wanted(core_key) else ():
            cur_e = dict(table.get(core_key, {}))
            cur_v = dict(cur_e, z_first=cur_e.get("z_first", True))
            if time.time() > deadline or all(cur_v.get(f) == v for f, v in cand.items()):
                continue
            cand_e = dict(cur_e, key=core_key, **cand)
            if trial(f"{core_key} -> {cand}", lambda: table.__setitem__(core_key, cand_e),
                     lambda: table.__setitem__(core_key, cur_e)):
                improved = True
                changed[core_key] = dict(changed.get(core_key, {}), **cand)
        # LM head (greedy, fused norm + argmax): the grid form's tiles, then the persistent form
        lm_cands = [dict(block_n=bn, block_k=bk, num_warps=nw, persistent=0, num_stages=1, evict=True)
                    for bn in (4, 8, 16, 32) for bk in (256, 512, 1024) for nw in (4, 8)
                    if 2048 <= bn * bk <= 16384]
        lm_cands += lm_head_persistent_candidates()
        for cand in lm_cands:
            cur = dict(be.decode_step.lm_plan)
            if time.time() > deadline or not wanted(lm_key) or all(cur.get(f) == v for f, v in cand.items()):
                continue
            if trial(f"lm_head {cur} -> {cand}", lambda: set_plan("lm_head", cand), lambda: set_plan("lm_head", cur)):
                improved, changed[lm_key] = True, dict(cand)
        if not improved or time.time() > deadline:
            break
    final = measure()
    log(f"final: {final:.4f} ms/step ({1e3 / final:.0f} tok/s) from {start_ms:.4f} ms "
        f"({time.time() - t_start:.0f} s)")

    # 3. write the winners into the table file
    gpu = _common.gpu_identity()
    data, _ = _common.select_table(_common.read_tables(out_path), gpu)
    data = dict(data or {}, **gpu)                # this GPU's table (a copy of the one it used)
    by_key = {e["key"]: e for e in data.get("entries", [])}
    for key, plan in changed.items():
        e = by_key.get(key)
        if e is None:
            e = {"key": key}
            data.setdefault("entries", []).append(e)
            by_key[key] = e
        e.update(plan)
        e.pop("us", None)           # isolated timings of the plan this one replaced
        e.pop("gb_s", None)
        e["chosen_in_step"] = True
    data["in_step"] = {"pdl_early": bool(be.options.pdl_early), "step_ms_before": round(start_ms, 4),
                       "step_ms_after": round(final, 4), "pos": args.pos, "margin": args.margin,
                       "only": only, "max_context": args.max_context,
                       "pdl_trigger_ms": {"after_wait": round(res[False], 4), "at_start": round(res[True], 4)},
                       "seconds": round(time.time() - t_start, 1)}
    _common.store_table(out_path, data)
    log(f"wrote {out_path} ({len(changed)} plans changed)")
    be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
