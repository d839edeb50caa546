"""Measure the prefill kernels at the true Qwen3.5-0.8B shapes and write the tile table.

    python -m tritonchat.engine.tuning.prefill --out kernels/prefill_tuning.json [--quick]

For every kernel family (the five GEMM shapes of the engine's merged projections, the chunked
GDN with its conv, flash attention) and every prompt length in T_BUCKETS it times a small grid of
launch configs with `triton.testing.do_bench`, keeps the fastest, and writes them to the JSON
the launchers read (`gemm.tuned_config`). The GDN sweep also times its three launches alone
with the winning knobs, so the table shows which one dominates. At the end it prints the
per-kernel table for T = 2048, scaled by the number of layers each kernel runs in.

Only the configs of the grid are compiled; --quick shrinks the grid and the timing windows
so the whole run stays within about four minutes on an H200. GPU only.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

from tritonchat.engine.config import qwen35_08b_config
from tritonchat.kernels import _common
from tritonchat.kernels import flash_attention as attn_mod
from tritonchat.kernels import gdn_chunk as gdn_mod
from tritonchat.kernels import gemm as gemm_mod

REPORT_T = 2048


def _grid(**axes) -> list[dict]:
    keys = list(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(axes[k] for k in keys))]


def gemm_grid(quick: bool, T: int, silu_mul: bool, N: int = 0) -> list[dict]:
    """Candidate configs (every key of gemm.GEMM_KEYS) of one GEMM shape, N its output columns
    (0: unknown, no split-K candidates). Short prompts: the grid form's thin tiles, and split-K
    in 2 or 4 slices (the K slices fill the SMs that a few output tiles leave idle). Long ones:
    the grid form's 128-row tiles and the persistent TMA form (128 x 128 / 128 x 256 tiles,
    the tile loop flattened or not), plus split-K in 2 slices for the narrow N shapes, whose
    tiles do not fill the SMs. (Warp specialization measured no different on an H100 with
    Triton 3.6: benchmarks/prefill_gemm.py times it.)"""
    grid_form = {k: [v] for k, v in gemm_mod.GEMM_FORM_DEFAULTS.items()}
    if T <= 256:        # weight-bandwidth bound: thin M tiles, more CTAs
        g = _grid(BLOCK_M=[64], BLOCK_N=[64, 128], BLOCK_K=[64, 128], GROUP_M=[8],
                  num_warps=[4], num_stages=[3, 4], **grid_form)
        if N > 0:       # N = 1,024 at 64-wide tiles is 16-32 programs for 132 SMs: cut K too
            g += _grid(BLOCK_M=[64, 128], BLOCK_N=[64], BLOCK_K=[64, 128], GROUP_M=[8], num_warps=[4],
                       num_stages=[4], **dict(grid_form, PERSISTENT=[1], SPLIT_K=[2, 4]))
    else:
        g = _grid(BLOCK_M=[128], BLOCK_N=[64, 128, 256], BLOCK_K=[64], GROUP_M=[8],
                  num_warps=[4, 8], num_stages=[3, 4], **grid_form)
        ptma = dict(grid_form, PERSISTENT=[1], TMA=[1])
        g += _grid(BLOCK_M=[128], BLOCK_N=[128, 256], BLOCK_K=[64], GROUP_M=[8], num_warps=[8],
                   num_stages=[3, 4], **dict(ptma, FLATTEN=[0, 1]))
        if 0 < N <= 2048:
            g += _grid(BLOCK_M=[128], BLOCK_N=[128, 256], BLOCK_K=[64], GROUP_M=[8],
                       num_warps=[8], num_stages=[3], **dict(ptma, SPLIT_K=[2]))
    if silu_mul:        # two accumulators: keep BLOCK_N <= 128
        g = [c for c in g if c["BLOCK_N"] <= 128]
    g = [c for c in g if not (c["BLOCK_N"] == 256 and c["num_warps"] == 4)]
    # what does not fit a Hopper block's shared memory (bf16) would only fail to compile
    g = [c for c in g if gemm_mod.gemm_smem_bytes(c, 2, silu_mul) <= gemm_mod.SMEM_BUDGET]
    if quick:           # the candidates most likely to win; every compile costs seconds
        if T <= 256:
            g = [c for c in g if (c["num_stages"], c["BLOCK_K"]) == (4, 64)]
        else:
            g = [c for c in g if (c["num_stages"], c["num_warps"]) == (3, 8)]
    return g


def gdn_grid(quick: bool) -> list[dict]:
    g = _grid(BV=[16, 32], prep_warps=[4, 8], state_warps=[4], state_stages=[2, 3],
              out_warps=[4, 8], solve=[1, 2])
    if quick:       # the prepare and output warps apart: 4 / 8 won at 2,048 and 8,192 (H100)
        g = [c for c in g if c["state_stages"] == 2 or c["BV"] == 16]
    return g


def attn_grid(quick: bool, T: int) -> list[dict]:
    """BLOCK_M counts stacked rows (tokens x the 4 query heads of a KV head). At head_dim 256
    (sm_90a compile): K/V tiles through tensor descriptors (KV_TMA) keep 128 x 64 tiles on 8
    warps at ~230 registers without spills, pointer loads only 128 x 32; shared memory caps
    the pipeline (128 x 64 takes 192 KB at 2 stages, 3 do not fit; 128 x 128 never fits).
    64-row tiles on 4 warps with <= 96 KB of shared memory run two programs a multiprocessor.
    LOOP_WARP_SPEC compiles to the same code as plain on sm_90 with Triton 3.6-3.9 (kept in
    the full grid for a Triton that specialises Hopper loops)."""
    A = attn_mod

    def cfg(bm, bn, warps, stages, load=A.KV_TMA, loop=A.LOOP_PLAIN):
        return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, KV_LOAD=load,
                    LOOP=loop)

    if T <= 256:        # few tokens: short tiles, more programs
        g = [cfg(16, 64, 4, 2), cfg(32, 32, 4, 2), cfg(32, 64, 4, 2), cfg(64, 32, 8, 2),
             cfg(64, 64, 8, 2), cfg(64, 32, 8, 2, A.KV_POINTERS)]
        return g[:4] if quick else g
    g = [cfg(128, 64, 8, 2), cfg(128, 32, 8, 2), cfg(128, 32, 8, 3), cfg(64, 32, 4, 2),
         cfg(64, 64, 4, 1), cfg(128, 32, 8, 2, A.KV_POINTERS)]
    if quick:           # 5 configs
        return g[:5]
    return g + [cfg(64, 64, 4, 2), cfg(64, 32, 4, 1), cfg(128, 32, 8, 3, A.KV_POINTERS),
                cfg(128, 64, 8, 2, loop=A.LOOP_WARP_SPEC)]


def gemm_shapes(c) -> dict[str, tuple[int, int, bool, bool, int]]:
    """The prefill's projection GEMMs of config `c`, merged exactly as engine/triton_prefill.py
    launches them: name -> (rows of W, K, residual epilogue?, silu_mul?, layers it runs in)."""
    D, I = c.hidden_size, c.intermediate_size
    H, KV, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    Hv, vd, cd = c.linear_num_value_heads, c.linear_value_dim, c.conv_dim
    n_gdn, n_attn = len(c.linear_attention_layers), len(c.full_attention_layers)
    return {
        "gdn qkvzba gemm": (cd + vd + 2 * Hv, D, False, False, n_gdn),
        "gdn out gemm+res": (D, vd, True, False, n_gdn),
        "attn qkv gemm": (2 * H * hd + 2 * KV * hd, D, False, False, n_attn),
        "attn o gemm+res": (D, H * hd, True, False, n_attn),
        "mlp gate|up silu": (2 * I, D, False, True, c.num_hidden_layers),
        "mlp down gemm+res": (D, I, True, False, c.num_hidden_layers),
    }


class Bench:
    """Shapes and buffers of one prompt length, plus one closure per kernel and config."""

    def __init__(self, T: int, cfg=None):
        c = cfg or qwen35_08b_config()
        self.cfg, self.T = c, T
        dev, bf = "cuda", torch.bfloat16
        D, I = c.hidden_size, c.intermediate_size
        H, KV, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        Hv, vd, cd = c.linear_num_value_heads, c.linear_value_dim, c.conv_dim
        self.dims = dict(D=D, I=I, H=H, KV=KV, hd=hd, Hv=Hv, vd=vd, cd=cd)
        w = lambda n, k: (torch.randn(n, k, device=dev) * k ** -0.5).to(bf)  # noqa: E731
        self.x = torch.randn(T, D, device=dev, dtype=bf)
        self.h = torch.randn(T, D, device=dev, dtype=bf)
        self.gemms = {}  # name: (W, input, out, residual?, silu_mul?, layers)
        for name, (n_w, k, res, silu, layers) in gemm_shapes(c).items():
            n_out = n_w // 2 if silu else n_w
            inp = self.x if k == D else torch.randn(T, k, device=dev, dtype=bf)
            out = self.h if res else torch.empty(T, n_out, device=dev, dtype=bf)
            self.gemms[name] = (w(n_w, k), inp, out, res, silu, layers)
        self.gdn_proj = self.gemms["gdn qkvzba gemm"][2].normal_()
        self.conv_w = (torch.randn(cd, c.linear_conv_kernel_dim, device=dev) * 0.5).to(bf)
        self.conv_state = torch.zeros(cd, c.linear_conv_kernel_dim - 1, device=dev, dtype=bf)
        self.A_log = torch.log(torch.empty(Hv, device=dev).uniform_(1, 16))
        self.dt_bias = torch.randn(Hv, device=dev).to(bf)
        self.norm_w = torch.ones(c.linear_value_head_dim, device=dev)
        self.rec = torch.zeros(Hv, c.linear_key_head_dim, c.linear_value_head_dim, device=dev)
        self.gdn_out = torch.empty(T, vd, device=dev, dtype=bf)
        self.attn_proj = self.gemms["attn qkv gemm"][2].normal_()
        self.qn = torch.zeros(hd, device=dev, dtype=bf)
        self.kn = torch.zeros(hd, device=dev, dtype=bf)
        self.k_cache = torch.zeros(KV, T, hd, device=dev, dtype=bf)
        self.v_cache = torch.zeros(KV, T, hd, device=dev, dtype=bf)
        self.attn_out = torch.empty(T, H * hd, device=dev, dtype=bf)

    def gemm_fn(self, name: str, config):
        W, x, out, res, silu, _ = self.gemms[name]
        return lambda: gemm_mod.gemm(x, W, out, residual=out if res else None, silu_mul=silu,
                                     config=config, table=None)

    def gemm_key(self, name: str) -> str:
        W, x, out, res, silu, _ = self.gemms[name]
        return gemm_mod.gemm_kernel_name(out.shape[1], x.shape[1], res, silu)

    def gdn_fn(self, config):
        c, d = self.cfg, self.dims
        cd, vd, Hv = d["cd"], d["vd"], d["Hv"]
        p = self.gdn_proj

        def run():
            gdn_mod.gdn_prefill(p[:, :cd], p[:, cd + 2 * Hv:], p[:, cd:cd + Hv], p[:, cd + Hv:cd + 2 * Hv],
                                self.conv_w, self.conv_state, self.A_log, self.dt_bias, self.rec,
                                self.norm_w, self.gdn_out, num_k_heads=c.linear_num_key_heads, num_v_heads=Hv,
                                head_k_dim=c.linear_key_head_dim, head_v_dim=c.linear_value_head_dim,
                                eps=c.rms_norm_eps, config=config, table=None)
        return run

    def attn_fn(self, config):
        c, d = self.cfg, self.dims
        q_n, kv_n = 2 * d["H"] * d["hd"], d["KV"] * d["hd"]
        p = self.attn_proj
        return lambda: attn_mod.attention_prefill(
            p[:, :q_n], p[:, q_n:q_n + kv_n], p[:, q_n + kv_n:], self.qn, self.kn, self.k_cache,
            self.v_cache, 0, self.attn_out, num_heads=d["H"], num_kv_heads=d["KV"], head_dim=d["hd"],
            rotary_dim=c.rotary_dim, rope_theta=c.rope_theta, eps=c.rms_norm_eps, config=config,
            table=None)


def _time(fn, quick: bool) -> float:
    """Milliseconds per call (median of do_bench); inf when the config fails to compile/run."""
    from triton.testing import do_bench
    try:
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=5 if quick else 25, rep=15 if quick else 100)
    except Exception as e:  # out of shared memory / registers for this tile: not a candidate
        print(f"    skipped: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
        torch.cuda.synchronize()
        return float("inf")


def _sweep(label: str, make_fn, grid: list[dict], quick: bool) -> tuple[dict, float, float]:
    """(best config, its ms, the built-in table's ms) for one kernel at one T."""
    default_ms = _time(make_fn(None), quick)
    best, best_ms = None, float("inf")
    for cfg in grid:
        ms = _time(make_fn(cfg), quick)
        if ms < best_ms:
            best, best_ms = cfg, ms
    print(f"  {label:22s} built-in {default_ms * 1e3:8.1f} us   best {best_ms * 1e3:8.1f} us  {best}",
          flush=True)
    return best, best_ms, default_ms


def launch_split(kernels, measure) -> list[float]:
    """Each launch's own time in a sequence of Triton `kernels`: measure() times the whole
    sequence with the later launches made no-ops, one more launch on each time; the
    differences of those cumulative prefixes."""
    saved = [k.run for k in kernels]
    times = []
    try:
        for n_on in range(1, len(kernels) + 1):
            for i, k in enumerate(kernels):
                k.run = saved[i] if i < n_on else (lambda *a, **kw: None)
            times.append(measure())
    finally:
        for k, r in zip(kernels, saved):
            k.run = r
    return [times[0]] + [b - a for a, b in zip(times, times[1:])]


def _gdn_launch_split(bench: Bench, cfg: dict, quick: bool) -> str:
    """Time the GDN launches alone (prepare, state, output) with `cfg` (None: the built-in),
    by running with the later launches removed: differences of cumulative prefixes."""
    names, kernels = zip(*gdn_mod.gdn_launches())
    own = launch_split(kernels, lambda: _time(bench.gdn_fn(cfg), quick))
    return " | ".join(f"{n} {t * 1e3:.1f} us" for n, t in zip(names, own))


def tune(T_list, quick: bool, cfg=None) -> tuple[dict, list[str]]:
    configs: dict[str, dict] = {}
    report: list[str] = []
    for T in T_list:
        print(f"T = {T}", flush=True)
        bench = Bench(T, cfg)
        rows = []
        for name, (_, _, _, _, _, layers) in bench.gemms.items():
            key = bench.gemm_key(name)
            W, _, out, _, silu, _ = bench.gemms[name]
            best, ms, dms = _sweep(name, lambda c, n=name: bench.gemm_fn(n, c),
                                   gemm_grid(quick, T, silu, out.shape[1]), quick)
            prev = configs.get(key, {}).get(str(T))
            if best is not None and ms < dms and (prev is None or ms < prev[1]):
                configs.setdefault(key, {})[str(T)] = (best, ms)
            rows.append((name, layers, ms, dms))
        n_gdn, n_attn = len(bench.cfg.linear_attention_layers), len(bench.cfg.full_attention_layers)
        best, ms, dms = _sweep("gdn chunk", bench.gdn_fn, gdn_grid(quick), quick)
        if best is not None and ms < dms:
            c = bench.cfg
            configs.setdefault(gdn_mod.gdn_kernel_name(c.linear_num_value_heads, c.linear_key_head_dim,
                                                       c.linear_value_head_dim), {})[str(T)] = (best, ms)
        if T == REPORT_T:
            split = _gdn_launch_split(bench, best if ms < dms else None, quick)
            print(f"  gdn chunk launches: {split}", flush=True)
            report.append(f"gdn chunk launches (fastest config): {split}")
        rows.append(("gdn chunk", n_gdn, ms, dms))
        best, ms, dms = _sweep("attn flash", bench.attn_fn, attn_grid(quick, T), quick)
        if best is not None and ms < dms:
            d = bench.dims
            configs.setdefault(attn_mod.attention_kernel_name(d["H"], d["KV"], d["hd"]), {})[str(T)] = (best, ms)
        rows.append(("attn flash", n_attn, ms, dms))
        if T == REPORT_T:
            report += _table(rows, T)
        del bench
        torch.cuda.empty_cache()
    return {k: {t: cfg for t, (cfg, _) in v.items()} for k, v in configs.items()}, report


def _table(rows, T: int) -> list[str]:
    lines = [f"per-kernel prefill time at T = {T} (x layers it runs in):",
             f"{'kernel':22s} {'built-in':>10s} {'tuned':>10s}   {'tuned x layers':>14s}"]
    tot_d = tot = 0.0
    for name, layers, ms, dms in rows:
        ms = min(ms, dms)     # the table falls back to the built-in config where that wins
        tot += ms * layers
        tot_d += dms * layers
        lines.append(f"{name:22s} {dms * 1e3:8.1f}us {ms * 1e3:8.1f}us   x{layers:2d} = {ms * layers:6.3f} ms")
    lines.append(f"{'sum':22s} built-in {tot_d:.3f} ms, tuned {tot:.3f} ms "
                 "(norms, embedding, LM head not included)")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(gemm_mod.TUNING_FILE), help="tile table to write")
    ap.add_argument("--quick", action="store_true", help="small grid, short timing (< 4 min)")
    ap.add_argument("--model", default=None, help="tune for this model folder's shapes (default: the 0.8B)")
    ap.add_argument("--T", type=int, nargs="*", default=list(gemm_mod.T_BUCKETS),
                    help="prompt lengths to tune (default: the table's buckets)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_prefill needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    torch.manual_seed(0)
    from . import model_config
    configs, report = tune(args.T, args.quick, model_config(args.model))
    data = dict(_common.gpu_identity(), version=1, torch=torch.__version__,
                triton=__import__("triton").__version__, buckets=list(gemm_mod.T_BUCKETS), configs=configs)
    _common.store_table(args.out, data)           # this GPU's table; the other GPUs' kept
    print("\n".join(report))
    print(f"wrote {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
