"""Sweep the fused decode kernels on the GPU and write decode_tuning.json.

    python -m tritonchat.engine.tuning.decode --out kernels/decode_tuning.json [--quick]
    python -m tritonchat.engine.tuning.decode --bench [--table kernels/decode_tuning.json]

The sweep times every fused GEMV of the 0.8B decode step at its true shape and epilogue over
(block_n, block_k, num_warps, split_k), and BLOCK_V / num_warps of gdn_decode, each
config replayed in a CUDA graph (`do_bench_cudagraph`: the engine replays the step in a graph,
so host launch cost must not count). The launchers read the winners by key (gemv.plan,
gdn_decode._plan, sampling.lm_head_plan) and fall back to heuristics for missing keys.
--quick (< 4 minutes, compiles included) sweeps a narrower grid.

--bench prints µs and GB/s of every fused kernel at the true shapes with the plans the
launchers pick now, then captures a whole synthetic decode step (24 layers with their own
random weights, the fused call sequence, the LM head with greedy argmax) into one CUDA graph
and reports ms/token, tok/s and the fraction of the measured HBM read roofline.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import triton

from tritonchat.engine.config import FULL_ATTENTION
from tritonchat.kernels import _common
from tritonchat.kernels import gemv as G
from tritonchat.kernels._common import pdl_mode
from tritonchat.kernels.gdn_decode import gdn_decode
from tritonchat.kernels.sampling import lm_head_argmax, lm_head_partials_numel, lm_head_plan

DT = torch.bfloat16


def use_config(cfg) -> None:
    """The shapes this tuner measures: the model's (set from its config in main; the defaults
    below are Qwen3.5-0.8B's, docs/qwen35-text-model.md section 1)."""
    global D, I, V, HK, HV, DK, DV, KW, H, KV, HD, ROT, CONV_DIM, N_PROJ, N_QKV, LAYER_TYPES, EPS
    global GEMVS, LM_KEY, CORE_KEY
    D, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    HK, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    DK, DV, KW = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    H, KV, HD, ROT = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
    CONV_DIM = 2 * HK * DK + HV * DV
    N_PROJ = CONV_DIM + 2 * HV                      # q|k|v|b|a (z: the core's launch)
    N_QKV = 2 * H * HD + 2 * KV * HD
    LAYER_TYPES = ["attn" if t == FULL_ATTENTION else "gdn" for t in cfg.layer_types]
    EPS = cfg.rms_norm_eps
    GEMVS = _gemvs()
    LM_KEY = f"lm_head:{V}x{D}:rms"
    CORE_KEY = f"gdn_core:{HV}x{DK}x{DV}"


def _gemvs() -> list:
    # (key, n_out, k, prologue, epilogue, what)
    return [
    (G.plan_key(N_PROJ, D, "rms", "conv"), N_PROJ, D, "rms", "conv",
     "GDN in_proj qkv|b|a + input norm + causal conv"),
    (G.plan_key(N_QKV, D, "rms", "plain"), N_QKV, D, "rms", "plain",
     "attention q|k|v + input norm"),
    (G.plan_key(I, D, "rms", "silu_mul"), I, D, "rms", "silu_mul",
     "MLP gate|up + post norm + SiLU*mul"),
    (G.plan_key(D, HV * DV, "gated", "residual"), D, HV * DV, "gated", "residual",
     "GDN out_proj + gated norm + residual"),
    (G.plan_key(D, H * HD, "none", "residual"), D, H * HD, "none", "residual",
     "attention o_proj + residual"),
    (G.plan_key(D, I, "none", "residual"), D, I, "none", "residual",
     "MLP down + residual"),
    ]


def _default_config():
    from tritonchat.engine.config import qwen35_08b_config
    return qwen35_08b_config()


use_config(_default_config())


SPLIT_GAIN = 0.97   # keep split-K only when it beats the best direct form by > 3%


def _bench_us(fn, rep: int = 20) -> float:
    """Median µs of fn replayed in a CUDA graph (falls back to stream timing)."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e3
    except Exception:      # noqa: BLE001 - e.g. a kernel that cannot be captured
        return triton.testing.do_bench(fn, warmup=5, rep=rep) * 1e3


def _rand(*shape, scale=1.0, dtype=DT):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


class _Gemv:
    """Buffers and a launch closure for one fused GEMV shape."""

    def __init__(self, n_out, k, prologue, epilogue):
        self.n_out, self.k, self.pro, self.epi = n_out, k, prologue, epilogue
        n_rows = 2 * n_out if epilogue == "silu_mul" else n_out
        self.W = _rand(n_rows, k, scale=k ** -0.5)
        self.x = _rand(k)
        self.kw = {}
        if prologue == "rms":
            self.kw.update(norm_w=_rand(k, scale=0.1), eps=EPS)
        elif prologue == "gated":
            self.kw.update(norm_w=1 + 0.1 * torch.randn(DV, device="cuda"),
                           gate=_rand(k), head_dim=DV, eps=EPS)
        self.out = torch.zeros(n_out, device="cuda", dtype=DT)
        if epilogue == "residual":
            self.kw["residual"] = self.out
        elif epilogue == "silu_mul":
            self.kw["silu_mul"] = True
        elif epilogue == "conv":
            self.kw.update(conv_state=_rand(CONV_DIM, KW - 1), conv_w=_rand(CONV_DIM, KW, scale=0.5))
        self.partials = torch.zeros(64 * n_rows, device="cuda")
        self.counters = torch.zeros(n_rows, device="cuda", dtype=torch.int32)
        self.nbytes = self.W.numel() * 2 + k * 2 + n_out * 2 * (2 if epilogue == "residual" else 1)

    def fn(self, p=None):
        p = p or {}
        return lambda: G.gemv(self.x, self.W, self.out, partials=self.partials,
                                    counters=self.counters, **p, **self.kw)


def _gemv_grid(n_out, k, prologue, quick):
    small = n_out <= 2048                        # the 1024-row outputs: grid short of the SMs
    bks = [256, 512] if quick else [128, 256, 512, 1024]
    if prologue == "gated":
        bks = [64, 128] if quick else [32, 64, 128]
    if quick:
        bns = [2, 4, 8] if small else [4, 8, 16]
    else:
        bns = [1, 2, 4, 8, 16, 32]
    warps = [4] if quick else [4, 8]
    splits = ([1, 2, 4] if quick else [1, 2, 3, 4, 8]) if small else [1]
    for bk in bks:
        if bk > max(128, triton.next_power_of_2(k)):
            continue
        for bn in bns:
            if not 512 <= bn * bk <= 8192:
                continue
            for nw in warps:
                for s in splits:
                    yield dict(block_n=bn, block_k=bk, num_warps=nw, split_k=s)


def tune_gemvs(quick: bool, log, deadline: float) -> list[dict]:
    """Best config per fused GEMV; past `deadline` (time.time()) each shape keeps the best of
    the configs already timed (the heuristic plan first, so there is always one)."""
    entries = []
    for key, n_out, k, pro, epi, what in GEMVS:
        g = _Gemv(n_out, k, pro, epi)
        best = None
        best_direct = None                       # split_k = 1: what "split-K off" runs
        t0 = time.time()
        first = G.heuristic_plan(n_out, k, pro, DV if pro == "gated" else 0,
                                       epi == "silu_mul")
        for p in [first, *_gemv_grid(n_out, k, pro, quick)]:
            if best is not None and time.time() > deadline:
                log(f"  {key}: time budget reached, keeping the best so far")
                break
            try:
                us = _bench_us(g.fn(p), rep=10 if quick else 25)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                log(f"  skip {p}: {type(e).__name__}: {str(e)[:80]}")
                continue
            if best is None or us < best[0]:
                best = (us, p)
            if int(p["split_k"]) == 1 and (best_direct is None or us < best_direct[0]):
                best_direct = (us, p)
        if best is None:
            log(f"{key}: no config ran")
            continue
        us, p = best
        if int(p["split_k"]) > 1 and best_direct is not None and us > SPLIT_GAIN * best_direct[0]:
            us, p = best_direct                  # split-K only where it clearly wins
        entry = dict(key=key, **p, us=round(us, 2), gb_s=round(g.nbytes / (us * 1e-6) / 1e9, 1), what=what)
        if best_direct is not None:
            du, dp = best_direct
            entry.update(direct_block_n=dp["block_n"], direct_block_k=dp["block_k"],
                         direct_num_warps=dp["num_warps"], us_direct=round(du, 2))
        entries.append(entry)
        log(f"{key:38s} {us:8.2f} us {g.nbytes / (us * 1e-6) / 1e9:7.0f} GB/s  {p}  "
            f"direct {entry.get('us_direct', float('nan')):.2f} us  ({time.time() - t0:.0f} s)")
        del g
    return entries


def _lm_head_setup():
    E = _rand(V, D, scale=0.05)
    h, nw = _rand(D), _rand(D, scale=0.1)
    logits = torch.empty(V, device="cuda")
    tok = torch.empty(1, device="cuda", dtype=torch.int64)
    part = torch.empty(V, device="cuda", dtype=torch.int64)
    return E, h, nw, logits, tok, part


def _fastest(plans, launch, rep: int, name: str, log):
    """(us, plan) of the fastest plan: launch(plan) is the call to time; a plan that does not
    compile or launch is logged and skipped (RuntimeError when none ran)."""
    best = None
    for plan in plans:
        try:
            us = _bench_us(launch(plan), rep=rep)
        except Exception as e:  # noqa: BLE001
            log(f"  skip {name} {plan}: {type(e).__name__}")
            continue
        if best is None or us < best[0]:
            best = (us, plan)
    if best is None:
        raise RuntimeError(f"tune_decode: no {name} plan ran")
    return best


def lm_head_persistent_candidates(quick: bool = False) -> list[dict]:
    """The LM head's persistent plans (whole rows, programs per SM, pipeline stages, warps)
    that the tuners try besides the grid form."""
    shapes = ((16, 2, 3, 8), (8, 4, 3, 4), (16, 2, 2, 8)) if quick else \
        tuple((bn, per, st, w) for bn in (8, 16, 32) for per in (1, 2, 4) for st in (2, 3, 4)
              for w in (4, 8) if bn * per <= 64)
    return [dict(block_n=bn, block_k=1024, num_warps=w, persistent=per, num_stages=st, evict=False)
            for bn, per, st, w in shapes]


def tune_lm_head(quick: bool, log) -> list[dict]:
    E, h, nw, logits, tok, part = _lm_head_setup()
    plans = [dict(block_n=bn, block_k=bk, num_warps=w, persistent=0)
             for bk in ([512] if quick else [256, 512, 1024])
             for bn in ([4, 8, 16] if quick else [2, 4, 8, 16, 32])
             for w in (4, 8) if bn * bk <= 16384]
    plans += lm_head_persistent_candidates(quick)
    us, p = _fastest(plans, lambda p: (lambda: lm_head_argmax(h, E, V, logits, tok, part,
                                                               norm_w=nw, eps=EPS, **p)),
                     20, "lm_head", log)
    nbytes = E.numel() * 2
    log(f"{LM_KEY:38s} {us:8.2f} us {nbytes / (us * 1e-6) / 1e9:7.0f} GB/s  {p}")
    return [dict(key=LM_KEY, **p, us=round(us, 2), gb_s=round(nbytes / (us * 1e-6) / 1e9, 1),
                 what="LM head (tied embedding) + final norm + greedy argmax")]


def _core_setup():
    """The core's operands as the engine passes them: proj = [q|k|v | b | a], and the z rows'
    weight, input, norm weight and output (the z GEMV runs in the same launch)."""
    proj = _rand(N_PROJ)
    A_log = torch.randn(HV, device="cuda") * 0.5
    dt_bias = _rand(HV)
    state = torch.randn(HV, DK, DV, device="cuda") * 0.01
    o = torch.empty(HV * DV, device="cuda", dtype=DT)
    z = dict(z_weight=_rand(HV * DV, D, scale=D ** -0.5), z_x=_rand(D), z_norm_w=_rand(D, scale=0.1),
             z_out=torch.empty(HV * DV, device="cuda", dtype=DT), z_eps=EPS)
    return proj, A_log, dt_bias, state, o, z


def tune_core(quick: bool, log) -> list[dict]:
    proj, A_log, dt_bias, state, o, z = _core_setup()
    plans = [dict(block_v=bv, num_warps=w, z_block_n=zbn)
             for bv in ([8, 16, 32] if quick else [4, 8, 16, 32, 64])
             for w in ([2, 4] if quick else [1, 2, 4, 8])
             for zbn in ([2, 4, 8] if quick else [1, 2, 4, 8, 16])]
    us, p = _fastest(plans, lambda p: (lambda: gdn_decode(
        proj, A_log, dt_bias, state, o, num_k_heads=HK, num_v_heads=HV, head_k_dim=DK,
        head_v_dim=DV, **p, **z)), 10, "gdn_core", log)
    nbytes = state.numel() * 4 * 2 + z["z_weight"].numel() * 2
    log(f"{CORE_KEY:38s} {us:8.2f} us {nbytes / (us * 1e-6) / 1e9:7.0f} GB/s  {p}")
    return [dict(key=CORE_KEY, **p, us=round(us, 2), gb_s=round(nbytes / (us * 1e-6) / 1e9, 1),
                 what="GDN recurrence (state read + write) + the z rows of the in_proj")]


def replay_ms(graph, n: int, before=None) -> float:
    """ms per replay of a captured CUDA graph over n replays back to back (`before` runs first,
    e.g. to reset a device-side position)."""
    if before is not None:
        before()
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(n):
        graph.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / n


def hbm_read_gb_s(nbytes: int = 1_505_000_000) -> float:
    """Measured HBM read bandwidth over a weights-sized buffer: the faster of a torch sum and
    our whole-row streaming read, as the bench's roofline (bandwidth.read_rates_gb_s)."""
    from tritonchat.kernels.bandwidth import read_rates_gb_s
    return max(read_rates_gb_s(nbytes, "cuda", reps=6).values())


# ------------------------------------------------------------------------------------------
# --bench
# ------------------------------------------------------------------------------------------

def bench_kernels(log) -> None:
    log("per-kernel, plans as the launchers pick them now:")
    for key, n_out, k, pro, epi, what in GEMVS:
        g = _Gemv(n_out, k, pro, epi)
        us = _bench_us(g.fn(), rep=50)
        p = G.plan(n_out, k, pro, epi, DV if pro == "gated" else 0)
        log(f"  {key:38s} {us:8.2f} us {g.nbytes / (us * 1e-6) / 1e9:7.0f} GB/s  {p}  {what}")
        del g
    proj, A_log, dt_bias, state, o, z = _core_setup()
    us = _bench_us(lambda: gdn_decode(proj, A_log, dt_bias, state, o, num_k_heads=HK,
                                           num_v_heads=HV, head_k_dim=DK, head_v_dim=DV, **z),
                   rep=50)
    nbytes = state.numel() * 8 + z["z_weight"].numel() * 2
    log(f"  {CORE_KEY:38s} {us:8.2f} us {nbytes / (us * 1e-6) / 1e9:7.0f} GB/s  (+ the z rows)")
    E, h, nw, logits, tok, part = _lm_head_setup()
    us = _bench_us(lambda: lm_head_argmax(h, E, V, logits, tok, part, norm_w=nw, eps=EPS), rep=50)
    log(f"  {LM_KEY:38s} {us:8.2f} us {E.numel() * 2 / (us * 1e-6) / 1e9:7.0f} GB/s  "
        f"{lm_head_plan(V, D, True)}")
    del E


def bench_step(log, context: int = 256) -> int:
    """A whole synthetic decode step (fused sequence, 24 layers, own weights) in one graph;
    returns the weight bytes one step streams."""
    from tritonchat.kernels.attention_decode import (attention_decode, counters_numel, partials_numel,
                                                     plan_num_splits, tile_positions)
    torch.manual_seed(0)
    layers = []
    for kind in LAYER_TYPES:
        L = dict(kind=kind, in_norm=_rand(D, scale=0.1), post_norm=_rand(D, scale=0.1),
                 gate_up=_rand(2 * I, D, scale=D ** -0.5), down=_rand(D, I, scale=I ** -0.5))
        if kind == "gdn":
            L.update(qkvba=_rand(N_PROJ, D, scale=D ** -0.5), z_w=_rand(HV * DV, D, scale=D ** -0.5),
                     conv_w=_rand(CONV_DIM, KW, scale=0.5), A_log=torch.randn(HV, device="cuda"),
                     dt_bias=_rand(HV), norm_w=1 + 0.1 * torch.randn(DV, device="cuda"),
                     out_proj=_rand(D, HV * DV, scale=(HV * DV) ** -0.5),
                     conv_state=torch.zeros(CONV_DIM, KW - 1, device="cuda", dtype=DT),
                     state=torch.zeros(HV, DK, DV, device="cuda"))
        else:
            L.update(qkv=_rand(N_QKV, D, scale=D ** -0.5), q_norm=_rand(HD, scale=0.1),
                     k_norm=_rand(HD, scale=0.1), o_proj=_rand(D, H * HD, scale=(H * HD) ** -0.5),
                     kc=_rand(KV, context + 8, HD), vc=_rand(KV, context + 8, HD))
        layers.append(L)
    E = _rand(V, D, scale=0.05)
    final_norm = _rand(D, scale=0.1)
    mats = ("gate_up", "down", "qkvba", "z_w", "out_proj", "qkv", "o_proj")
    weight_bytes = E.numel() * 2 + sum(L[m].numel() * 2 for L in layers for m in mats if m in L)
    h = _rand(D)
    proj = torch.empty(N_PROJ, device="cuda", dtype=DT)
    o = torch.empty(HV * DV, device="cuda", dtype=DT)
    zbuf = torch.empty(HV * DV, device="cuda", dtype=DT)
    aproj = torch.empty(N_QKV, device="cuda", dtype=DT)
    aout = torch.empty(H * HD, device="cuda", dtype=DT)
    act = torch.empty(I, device="cuda", dtype=DT)
    part = torch.zeros(64 * 2 * I, device="cuda")
    cnt = torch.zeros(2 * N_PROJ, device="cuda", dtype=torch.int32)
    splits = plan_num_splits(context + 8, KV, block_n=tile_positions(H, KV, HD))
    apart = torch.zeros(partials_numel(H, HD, splits), device="cuda")
    acnt = torch.zeros(counters_numel(KV, splits), device="cuda", dtype=torch.int32)  # stay zero
    pos = torch.tensor([context], device="cuda", dtype=torch.int32)
    lp = lm_head_plan(V, D, True)
    logits = torch.empty(V, device="cuda")
    tok = torch.empty(1, device="cuda", dtype=torch.int64)
    lpart = torch.empty(lm_head_partials_numel(V, lp["block_n"]), device="cuda", dtype=torch.int64)
    sc = dict(partials=part, counters=cnt)

    def step(pm: int):
        for L in layers:
            if L["kind"] == "gdn":
                G.gemv(h, L["qkvba"], proj, norm_w=L["in_norm"], eps=EPS, conv_state=L["conv_state"],
                               conv_w=L["conv_w"], pdl=pm, **sc)
                gdn_decode(proj, L["A_log"], L["dt_bias"], L["state"], o, num_k_heads=HK,
                                num_v_heads=HV, head_k_dim=DK, head_v_dim=DV, z_weight=L["z_w"],
                                z_x=h, z_norm_w=L["in_norm"], z_out=zbuf, z_eps=EPS, pdl=pm)
                G.gemv(o, L["out_proj"], h, norm_w=L["norm_w"], gate=zbuf, head_dim=DV,
                             eps=EPS, residual=h, pdl=pm, **sc)
            else:
                G.gemv(h, L["qkv"], aproj, norm_w=L["in_norm"], eps=EPS, pdl=pm, **sc)
                q_n, kv_n = 2 * H * HD, KV * HD
                attention_decode(aproj[:q_n], aproj[q_n:q_n + kv_n], aproj[q_n + kv_n:],
                                 L["q_norm"], L["k_norm"], L["kc"], L["vc"], pos, aout, apart, acnt,
                                 num_heads=H, num_kv_heads=KV, head_dim=HD, rotary_dim=ROT,
                                 rope_theta=1e7, eps=EPS, num_splits=splits, pdl=pm)
                G.gemv(aout, L["o_proj"], h, residual=h, pdl=pm, **sc)
            G.gemv(h, L["gate_up"], act, norm_w=L["post_norm"], eps=EPS, silu_mul=True, pdl=pm, **sc)
            G.gemv(act, L["down"], h, residual=h, pdl=pm, **sc)
        lm_head_argmax(h, E, V, logits, tok, lpart, norm_w=final_norm, eps=EPS, pdl=pm)

    for pdl in ([False, True] if torch.cuda.get_device_capability()[0] >= 9 else [False]):
        pm = pdl_mode(pdl, False, "cuda")
        step(pm)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(pm)
        for _ in range(3):
            graph.replay()
        ms = replay_ms(graph, 50)
        log(f"  step (graph, PDL {'on' if pdl else 'off'}, context {context}): {ms:.3f} ms/token = "
            f"{1e3 / ms:.0f} tok/s; weights {weight_bytes / 1e9:.3f} GB -> "
            f"{weight_bytes / (ms * 1e-3) / 1e9:.0f} GB/s")
        del graph
    return weight_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=_common.DECODE_TABLE_PATH)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default=None, help="tune for this model folder's shapes (default: the 0.8B)")
    ap.add_argument("--bench", action="store_true", help="time the fused kernels, no sweep")
    ap.add_argument("--table", default=None, help="read this table instead of the packaged one")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop sweeping GEMVs after this many seconds (default: 170 with "
                         "--quick, none otherwise)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    log = lambda s: print(s, flush=True)  # noqa: E731
    from . import model_config
    use_config(model_config(args.model))
    if args.table:
        _common.DECODE_TABLE_PATH = args.table
        _common.clear_table_cache()
    t0 = time.time()
    if args.bench:
        bw = hbm_read_gb_s()
        log(f"HBM read roofline: {bw:.0f} GB/s ({torch.cuda.get_device_name()})")
        bench_kernels(log)
        wb = bench_step(log)
        log(f"roofline step (weights only): {wb / (bw * 1e9) * 1e3:.3f} ms = "
            f"{bw * 1e9 / wb:.0f} tok/s  ({time.time() - t0:.0f} s)")
        return 0
    budget = args.budget_s if args.budget_s is not None else (170.0 if args.quick else 1e9)
    entries = (tune_gemvs(args.quick, log, t0 + budget) + tune_core(args.quick, log)
               + tune_lm_head(args.quick, log))
    bw = hbm_read_gb_s()
    data = dict(_common.gpu_identity(), triton=triton.__version__, torch=torch.__version__,
                quick=bool(args.quick), hbm_read_gb_s=round(bw, 1), seconds=round(time.time() - t0, 1),
                entries=entries)
    _common.store_table(args.out, data)           # this GPU's table; the other GPUs' kept
    log(f"wrote {args.out} ({len(entries)} entries, {time.time() - t0:.0f} s; HBM {bw:.0f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
