"""Stop 35: the two-launch attention (scores, then softmax and P V) against the one-launch
split-KV attention, in the captured decode step on the device, at long positions.

Each variant replaces the attention's context-range plans (kernels/attention_decode.py,
attention_range_plans) with its own from FROM on; `table` is the packaged table's. For each, the
graphs of every range are captured and each position's graph is replayed (best of ROUNDS
alternating rounds, 40 replays each). Sanity: the residual after one step from one seeded state
against the table's, and the argmax token.

The two-launch form was measured slower and is not on main: apply its patch (the kernels, the
engine's `scores` range plans and their tests) to a checkout first, then run on the device:
    git apply experiments/stop35/two_launch_attention.patch
    bash experiments/stop33/run.sh experiments/stop35/ab_two_launch.py [positions...]
"""
import sys
import time

import torch

from tritonchat.engine.api import EngineOptions
from tritonchat.engine.config import qwen35_08b_config
from tritonchat.engine.loader import random_backend
from tritonchat.kernels import attention_decode as ad
from tritonchat.kernels.tune_decode import replay_ms

POSITIONS = [int(p) for p in sys.argv[1:]] or [4096, 8192, 16384, 24576, 32704]
FROM = 2048
ROUNDS = 3
table_plans = ad.attention_range_plans


def long(pv, sc=None, frm=FROM):
    p = dict(pv)
    if sc is not None:
        p["scores"] = dict(sc)
    return [(frm, None, p)]


PV32 = dict(splits_per_sm=2, block_n=32, num_warps=4, num_stages=2, merge_splits=16)
VARIANTS = {
    "table": None,
    "one_launch_long_from_2048": long(PV32),
    "two_s2_b64_w4_st2": long(PV32, dict(splits_per_sm=2, block_n=64, num_warps=4, num_stages=2)),
    "two_s2_b32_w4_st3": long(PV32, dict(splits_per_sm=2, block_n=32, num_warps=4, num_stages=3)),
    "two_s1_b64_w8_st3": long(PV32, dict(splits_per_sm=1, block_n=64, num_warps=8, num_stages=3)),
    "two_s4_b32_w4_st2": long(PV32, dict(splits_per_sm=4, block_n=32, num_warps=4, num_stages=2)),
    "two_s2_b64_w4_st2_pv64": long(dict(PV32, block_n=64), dict(splits_per_sm=2, block_n=64,
                                                                num_warps=4, num_stages=2)),
    "two_s2_b64_w4_st2_pv_st3": long(dict(PV32, num_stages=3), dict(splits_per_sm=2, block_n=64,
                                                                    num_warps=4, num_stages=2)),
}


def seeded_state(be, pos):
    g = torch.Generator(device="cuda").manual_seed(pos)
    st = be.state
    for k, v in st.kv.values():
        k[:, :pos].normal_(generator=g)
        v[:, :pos].normal_(generator=g)
    for t in st.rec.values():
        t.normal_(generator=g).mul_(0.01)
    for t in st.conv.values():
        t.normal_(generator=g)
    st.length = pos
    be.pos_buf.fill_(pos)
    be.h.normal_(generator=g)
    be.tok_buf.fill_(1234)


def main():
    be = random_backend(qwen35_08b_config(), EngineOptions(
        backend="triton", device="cuda", dtype="bfloat16", max_context=33280, split_k=True,
        graph=True))
    graphs, sanity, keep = {}, {}, []
    for name, plans in VARIANTS.items():
        ad.attention_range_plans = table_plans if plans is None else (lambda *a, _p=plans: _p)
        t0 = time.perf_counter()
        be.set_context_ranges(False)
        be.set_context_ranges(True)
        graphs[name] = {p: be.graph_for(p) for p in POSITIONS}
        # the scratch each variant's graphs were captured over stays allocated (a later
        # variant's counters must not land where an earlier graph writes partials)
        keep.append((be._ranges, be.gemv_partials, be.gemv_counters, be.lm_head_partials))
        print(f"captured {name} ({time.perf_counter() - t0:.1f} s; bounds "
              f"{be.context_range_bounds})", flush=True)
        sanity[name] = {}
        for p in POSITIONS:
            seeded_state(be, p)
            graphs[name][p].replay()
            torch.cuda.synchronize()
            sanity[name][p] = (be.h.float().clone(), int(be.tok_buf.item()))
    for name in VARIANTS:
        for p in POSITIONS:
            h, tok = sanity[name][p]
            h0, tok0 = sanity["table"][p]
            err = (h - h0).abs().max().item() / max(h0.abs().max().item(), 1e-9)
            print(f"sanity {name} pos {p}: max |dh| / max |h| {err:.2e}, token {tok} "
                  f"({'=' if tok == tok0 else '!='} table)", flush=True)
    best = {n: {p: float("inf") for p in POSITIONS} for n in VARIANTS}
    for r in range(ROUNDS):
        for name in VARIANTS:
            for p in POSITIONS:
                g = graphs[name][p]
                best[name][p] = min(best[name][p],
                                    replay_ms(g, 40, before=lambda: be.pos_buf.fill_(p)))
    print("ms per step, best of %d rounds" % ROUNDS)
    print(f"{'variant':28s} " + " ".join(f"{p:>8d}" for p in POSITIONS))
    for name in VARIANTS:
        print(f"{name:28s} " + " ".join(f"{best[name][p]:8.4f}" for p in POSITIONS), flush=True)
    for name in VARIANTS:
        print(f"{name:28s} ratio to table " + " ".join(
            f"{best[name][p] / best['table'][p]:8.4f}" for p in POSITIONS), flush=True)


if __name__ == "__main__":
    main()
