"""Sweep the decode GEMV launch parameters on the GPU and write gemv_splitk_table.json.

    python -m tritonchat.kernels.tune_gemv --out kernels/gemv_splitk_table.json [--quick]
        [--shapes 8192x1024,32x1024]     # tune a subset, keep the file's other entries
    python -m tritonchat.kernels.tune_gemv --bench        # time every decode kernel, no sweep

The full sweep takes ~2-3 minutes per shape (compiles included), --quick well under one.

For each 0.8B weight shape (with the epilogue the engine uses on it) the sweep times the direct
form over (block_n, block_k, num_warps) and the split-K form over the same grid times split_k,
with CUDA-graph replay timing (the engine replays the decode step in a graph, so launch cost
on the host must not count). split_k = 1 is kept unless split-K is faster by more than 3%.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton

from . import gemv as gemv_mod
from .gemv import gemv

# (n, k, epilogue, what) -- the 0.8B decode projections, merged the way the engine merges them
SHAPES = [
    (8224, 1024, "plain", "GDN in_proj qkv|z|b|a merged (the engine's single GDN projection)"),
    (5120, 1024, "plain", "attention q|k|v merged (the engine's single attention projection)"),
    (8192, 1024, "plain", "GDN in_proj qkv|z merged"),
    (32, 1024, "plain", "GDN in_proj b|a merged"),
    (1024, 2048, "residual", "GDN out_proj / attention o_proj (into the residual)"),
    (4096, 1024, "plain", "attention q_proj (query|gate)"),
    (512, 1024, "plain", "attention k_proj / v_proj"),
    (1024, 1024, "plain", "attention k|v merged"),
    (7168, 1024, "silu_mul", "MLP gate|up merged, SiLU*mul epilogue"),
    (1024, 3584, "residual", "MLP down_proj (into the residual)"),
    (248320, 1024, "lm_head", "LM head = tied embedding, fused argmax"),
]
SPLIT_GAIN = 0.97     # keep split-K only when it beats the direct form by > 3%


def _bench_us(fn) -> float:
    """Median µs of fn replayed in a CUDA graph (falls back to stream timing)."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3
    except Exception:      # noqa: BLE001 - e.g. a kernel that cannot be captured
        return triton.testing.do_bench(fn, warmup=10, rep=30) * 1e3


def _grid(n: int, k: int, quick: bool):
    bks = [256, 512] if quick else [128, 256, 512, 1024]
    bns = [2, 4, 8, 16] if quick else [1, 2, 4, 8, 16, 32]
    warps = [4] if quick else [4, 8]
    for bk in bks:
        if bk > max(128, triton.next_power_of_2(k)):
            continue
        for bn in bns:
            if not 512 <= bn * bk <= 16384 or bn > triton.next_power_of_2(n):
                continue
            for w in warps:
                yield bn, bk, w


def _tensors(n, k, epilogue):
    x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    n_out = n // 2 if epilogue == "silu_mul" else n
    out = torch.zeros(n_out, device="cuda", dtype=torch.bfloat16)
    part = torch.empty(gemv_mod.MAX_SPLIT_K * n, device="cuda", dtype=torch.float32)
    return x, W, out, part


def tune_shape(n: int, k: int, epilogue: str, quick: bool, splits) -> dict:
    x, W, out, part = _tensors(n, k, epilogue)
    res = out if epilogue == "residual" else None
    best_direct, best_split = None, None
    if epilogue == "lm_head":
        from .sampling import lm_head_argmax
        logits = torch.empty(n, device="cuda", dtype=torch.float32)
        tok = torch.zeros(1, device="cuda", dtype=torch.int32)
        keys = torch.empty(n, device="cuda", dtype=torch.int64)
    for bn, bk, w in _grid(n, k, quick):
        for s in splits:
            if s > 1 and (epilogue == "lm_head" or triton.cdiv(k, bk) < s):
                continue
            if epilogue == "lm_head":
                fn = lambda: lm_head_argmax(x, W, n, logits, tok, keys, block_n=bn,  # noqa: E731
                                            block_k=bk, num_warps=w)
            else:
                fn = lambda: gemv(x, W, out, split_k=s, partials=part, residual=res,  # noqa: E731
                                  silu_mul=epilogue == "silu_mul", block_n=bn, block_k=bk,
                                  num_warps=w)
            try:
                fn()
                us = _bench_us(fn)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"  skip bn={bn} bk={bk} w={w} s={s}: {type(e).__name__}", file=sys.stderr)
                continue
            cand = dict(split_k=s, block_n=bn, block_k=bk, num_warps=w, us=us)
            if s == 1 and (best_direct is None or us < best_direct["us"]):
                best_direct = cand
            if s > 1 and (best_split is None or us < best_split["us"]):
                best_split = cand
    if best_direct is None:
        raise RuntimeError(f"no direct config ran for {n}x{k}")
    use_split = best_split is not None and best_split["us"] < SPLIT_GAIN * best_direct["us"]
    chosen = best_split if use_split else best_direct
    gb = n * k * 2 / 1e9
    return dict(n=n, k=k, epilogue=epilogue, split_k=chosen["split_k"],
                block_n=chosen["block_n"], block_k=chosen["block_k"],
                num_warps=chosen["num_warps"],
                direct_block_n=best_direct["block_n"], direct_block_k=best_direct["block_k"],
                direct_num_warps=best_direct["num_warps"],
                us_direct=round(best_direct["us"], 2),
                us_split=round(best_split["us"], 2) if best_split else None,
                gb_s=round(gb / (min(best_direct["us"], chosen["us"]) * 1e-6), 1))


def hbm_gb_s() -> float:
    """Read bandwidth of one pass over a buffer the size of the model's weights."""
    buf = torch.empty(752_393_024, device="cuda", dtype=torch.bfloat16)
    buf.uniform_()
    ms = triton.testing.do_bench(lambda: buf.sum(dtype=torch.float32), warmup=3, rep=20)
    return buf.numel() * 2 / (ms * 1e-3) / 1e9


def _existing_entries(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return {(e["n"], e["k"]): e for e in json.load(f).get("entries", [])}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def tune(out_path: str, quick: bool, only=None) -> dict:
    """Tune SHAPES (or the (n, k) pairs in `only`), keeping the file's other entries, so a
    long sweep can be split over several runs."""
    splits = [1, 2, 4] if quick else [1, 2, 3, 4, 6, 8]
    kept = _existing_entries(out_path)
    entries = []
    for n, k, epi, what in SHAPES:
        if only and (n, k) not in only:
            if (n, k) in kept:
                entries.append(kept[(n, k)])
            continue
        t0 = time.time()
        e = tune_shape(n, k, epi, quick, splits)
        e["what"] = what
        entries.append(e)
        print(f"{n:>7} x {k:<5} {epi:<9} split={e['split_k']} bn={e['block_n']} "
              f"bk={e['block_k']} w={e['num_warps']}  direct {e['us_direct']} us  "
              f"split {e['us_split']} us  {e['gb_s']} GB/s  ({time.time() - t0:.0f} s)",
              flush=True)
    table = dict(gpu=torch.cuda.get_device_name(),
                 measured_with=(f"tune_gemv.py{' --quick' if quick else ''}, triton "
                                f"{triton.__version__}, torch {torch.__version__}, CUDA-graph "
                                f"replay timing, bf16 weights"),
                 hbm_read_gb_s=round(hbm_gb_s(), 1), entries=entries)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    return table


def bench_decode_kernels() -> list[dict]:
    """Time each decode kernel at the 0.8B shapes (bf16) and print µs and GB/s."""
    from .attention_decode import attention_decode, partials_numel, plan_num_splits
    from .embedding import embedding_gather
    from .gdn_decode import gdn_decode
    from .rms_norm import add_rms_norm
    from .sampling import (lm_head_argmax, lm_head_partials_numel, params_list,
                           sample_from_logits, sample_scratch_numel)
    dev, bf = "cuda", torch.bfloat16
    rows = []

    def row(name, fn, nbytes):
        us = _bench_us(fn)
        rows.append(dict(name=name, us=round(us, 2), gb_s=round(nbytes / (us * 1e-6) / 1e9, 1)))
        print(f"{name:<44} {us:8.2f} us  {rows[-1]['gb_s']:8.1f} GB/s", flush=True)

    D, V = 1024, 248320
    table = torch.randn(V, D, device=dev, dtype=bf)
    ids = torch.tensor([123], device=dev, dtype=torch.int32)
    h = torch.empty(1, D, device=dev, dtype=bf)
    row("embedding_gather", lambda: embedding_gather(ids, table, h), 2 * D * 2)
    x, r, o = (torch.randn(1, D, device=dev, dtype=bf) for _ in range(3))
    w = torch.randn(D, device=dev, dtype=bf)
    row("add_rms_norm D=1024", lambda: add_rms_norm(x, r, w, 1e-6, o), 5 * D * 2)

    hk = hv = 16
    dk = dv = 128
    conv_dim = 2 * hk * dk + hv * dv
    qkvz = torch.randn(conv_dim + hv * dv, device=dev, dtype=bf)
    ba = torch.randn(2 * hv, device=dev, dtype=bf)
    cs = torch.randn(conv_dim, 3, device=dev, dtype=bf)
    cw = torch.randn(conv_dim, 4, device=dev, dtype=bf) * 0.3
    A_log = torch.randn(hv, device=dev)
    dt_bias = torch.randn(hv, device=dev, dtype=bf)
    st = torch.randn(hv, dk, dv, device=dev) * 0.01
    nw = torch.ones(dv, device=dev)
    go = torch.empty(hv * dv, device=dev, dtype=bf)
    for warps in (4, 8, 16):
        row(f"gdn_decode 16x128x128 (warps={warps})",
            lambda: gdn_decode(qkvz, ba, cs, cw, A_log, dt_bias, st, nw, go, num_k_heads=hk,
                               num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, eps=1e-6,
                               num_warps=warps),
            2 * st.numel() * 4 + conv_dim * 4 * 2 * 3)

    H, Hkv, hd = 8, 2, 256
    for ctx in (1024, 4096, 32768):
        kc = torch.randn(Hkv, ctx + 1, hd, device=dev, dtype=bf)
        vc = torch.randn_like(kc)
        qg = torch.randn(H * 2 * hd, device=dev, dtype=bf)
        kk, vv = (torch.randn(Hkv * hd, device=dev, dtype=bf) for _ in range(2))
        qw, kw = (torch.zeros(hd, device=dev, dtype=bf) for _ in range(2))
        pos = torch.tensor([ctx], device=dev, dtype=torch.int32)
        ao = torch.empty(H * hd, device=dev, dtype=bf)
        for splits in sorted({plan_num_splits(32768, Hkv), 16, 32}):
            part = torch.empty(partials_numel(H, hd, splits), device=dev)
            row(f"attention_decode ctx={ctx} splits={splits}",
                lambda: attention_decode(qg, kk, vv, qw, kw, kc, vc, pos, ao, part,
                                         num_heads=H, num_kv_heads=Hkv, head_dim=hd,
                                         rotary_dim=64, rope_theta=1e7, eps=1e-6,
                                         num_splits=splits),
                2 * Hkv * ctx * hd * 2)

    logits = torch.empty(V, device=dev)
    tok = torch.zeros(1, device=dev, dtype=torch.int32)
    keys = torch.empty(lm_head_partials_numel(V, 1), device=dev, dtype=torch.int64)
    hh = torch.randn(D, device=dev, dtype=bf)
    row("lm_head_argmax (plan)", lambda: lm_head_argmax(hh, table, 248077, logits, tok, keys),
        V * D * 2)
    counts = torch.zeros(2, V, device=dev, dtype=torch.int32)
    so = torch.tensor([1, 0], device=dev, dtype=torch.int64)
    for kmax in (64, 256, 1024):
        scratch = torch.empty(sample_scratch_numel(V, kmax), device=dev, dtype=torch.int64)
        for label, ps in (("top_k=20", params_list(1.0, 20, 0.95, 0.0, 1.5, 1.0)),
                          ("temperature only", params_list(0.8, 0, 1.0, 0.0, 0.0, 1.0)),
                          ("greedy", params_list(greedy=True))):
            params = torch.tensor(ps, device=dev)
            row(f"sample_from_logits kmax={kmax} {label}",
                lambda: sample_from_logits(logits, params, counts, so, tok, scratch,
                                           valid_vocab=248077, top_k_max=kmax),
                V * 4 + 2 * V * 4)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=gemv_mod.TABLE_PATH, help="where to write the table")
    ap.add_argument("--quick", action="store_true", help="a smaller sweep (a few minutes)")
    ap.add_argument("--bench", action="store_true", help="time the decode kernels, no sweep")
    ap.add_argument("--shapes", default="", help="only these shapes, e.g. 8192x1024,32x1024 "
                    "(the file's other entries are kept)")
    args = ap.parse_args(argv)
    only = {tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s}
    if not torch.cuda.is_available():
        print("tune_gemv needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.bench:
        bench_decode_kernels()
        return 0
    tune(args.out, args.quick, only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
