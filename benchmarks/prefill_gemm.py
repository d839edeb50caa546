"""The prefill projection GEMMs (kernels/gemm.py) in each launch form, at the true
Qwen3.5-0.8B shapes, against cuBLAS (issue #60, lever 2).

For every projection the prefill launches (engine/tuning/prefill.py: gemm_shapes) and every
prompt length (--T, default 2048 and 8192 = one prefill chunk), it times each form with
`triton.testing.do_bench` (median, after warm-up) and prints ms and TFLOP/s, and
torch.matmul (cuBLAS, the plain product into a fresh tensor, no epilogue) as the ceiling. Each
form's output is checked against the grid form's (bf16: at most a rare element more than
two ulps apart, the mean far below one; see agree()). Then the prefill's GEMM time per form
(x the layers each shape runs in) and the best form per shape.

Forms (--forms a,b,...; default all):

    grid            the original form with its built-in tiles (gemm.grid_config)
    table           what gemm() launches now: the packaged tile table, else the built-in
    default         the built-in table (table=None): persistent + TMA for M >= 512
    persistent      the default tiles, persistent programs, pointer loads
    tma             the default tiles, one program per tile, TMA descriptors
    ptma_64 / _128 / _256   persistent + TMA with a 128 x 64 / 128 x 128 / 128 x 256 tile
    ptma_bk128      persistent + TMA, 128 x 128 x 128, 3 stages
    splitk2 / splitk4       persistent + TMA, 128 x 256 (128 x 128 for gate|up) tiles, K in
                    2 / 4 slices and the reduce pass (the narrow N = 1024 shapes only)
    splitk2_128     persistent + TMA, 128 x 128, K in 2 slices (narrow only)
    ptma_256f / _128f       ptma_256 / ptma_128 with the tile loop flattened (flatten=True;
                    ptma_256f with a residual: TMA=2, no shared memory is left to stage it)
    tma_ops         the default with TMA=2: descriptors for the operands only
    ws / flatten    the default with tl.range(warp_specialize=True) / (flatten=True)

    PYTHONUNBUFFERED=1 python benchmarks/prefill_gemm.py                      (device)
    TRITON_INTERPRET=1 python benchmarks/prefill_gemm.py --device cpu --tiny  (CPU smoke run)
    python benchmarks/prefill_gemm.py --compile-only          (offline sm_90 compile, no GPU:
                                                               shared memory, TMA / wgmma ops)

The last line is one JSON object with every number.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch

from tritonchat.engine.config import parse_config, qwen35_08b_config
from tritonchat.engine.tuning.prefill import gemm_shapes
from tritonchat.kernels import gemm as G


def _ptma(bn: int, bk: int = 64, stages: int = 3, **form) -> dict:
    return dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=8, num_stages=stages,
                **{**G.GEMM_FORM_DEFAULTS, "PERSISTENT": 1, "TMA": 1, **form})


def _narrow(N: int) -> bool:
    return N <= 2048


def form_config(form: str, M: int, N: int, K: int, silu: bool, res: bool) -> dict | None:
    """The config of `form` for one shape (N = output columns), or None where it does not
    apply to the shape."""
    default = G.gemm_config(M, N, K, silu, res, table=None)
    if form == "grid":
        return G.grid_config(M, N, K, silu)
    if form == "table":
        return G.gemm_config(M, N, K, silu, res)
    if form == "default":
        return default
    if form == "persistent":
        return dict(default, PERSISTENT=1, TMA=0)
    if form == "tma":
        return dict(default, PERSISTENT=0, TMA=1)
    if form == "ptma_128":
        return _ptma(128, stages=4 if not silu else 3)
    if form == "ptma_64":
        return _ptma(64, stages=4)
    if form == "ptma_256":
        return None if silu else _ptma(256)
    if form == "ptma_bk128":
        return _ptma(128, bk=128, stages=3 if not silu else 2)
    if form in ("splitk2", "splitk4"):
        if not _narrow(N):
            return None
        return _ptma(128 if silu else 256, SPLIT_K=int(form[-1]))
    if form == "splitk2_128":
        return _ptma(128, stages=4, SPLIT_K=2) if _narrow(N) else None
    if form == "ptma_256f":     # flattened, the pipeline stays live in the epilogue: a residual
        return None if silu else _ptma(256, FLATTEN=1, TMA=2 if res else 1)  # tile would not fit
    if form == "ptma_128f":
        return _ptma(128, stages=4 if not silu else 3, FLATTEN=1)
    if form == "tma_ops":
        return dict(default, TMA=2) if default["TMA"] else None
    if form == "ws":
        return dict(default, PERSISTENT=1, TMA=1, WARP_SPEC=1)
    if form == "flatten":
        return dict(default, PERSISTENT=1, TMA=1, FLATTEN=1)
    raise ValueError(f"unknown form {form!r}")


FORMS = ("grid", "table", "default", "persistent", "tma", "ptma_64", "ptma_128", "ptma_256", "ptma_bk128",
         "ptma_256f", "ptma_128f", "tma_ops", "splitk2", "splitk4", "splitk2_128", "ws", "flatten")


def tiny_config(cfg: dict | None) -> dict | None:
    """The same form with tiles the interpreter runs in seconds (the CPU smoke run)."""
    if cfg is None:
        return None
    return dict(cfg, BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=2, num_stages=1)


def agree(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float, int]:
    """(same result up to the order of the K-sum, max abs difference, elements beyond two ulps).

    Two fp32 sums of another order can round to neighbouring values at each rounding point
    (the product, then the residual add / SiLU * up): two ulps of the output apart, and now and
    then more where an intermediate far larger than the output flips (as
    tests/kernels/test_gemm.py's GPU twins allow). fp32 / fp16 outputs: a relative bound."""
    err = (out.float() - ref.float()).abs()
    if out.dtype != torch.bfloat16:
        tol = 1e-4 if out.dtype == torch.float32 else 4e-3
        bad = err > tol * (1 + ref.float().abs())
        return int(bad.sum()) == 0, err.max().item(), int(bad.sum())
    mag = torch.maximum(ref.float().abs(), out.float().abs())
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(mag.clamp_min(1e-30))))
    bad = err > torch.maximum(2 * ulp, torch.full_like(ulp, 1e-2))
    n_bad = int(bad.sum())
    ok = n_bad <= max(2, int(1e-5 * err.numel())) and err.max().item() <= 0.125 \
        and err.mean().item() < 2e-3
    return ok, err.max().item(), n_bad


def _time_ms(fn, device: str, quick: bool) -> float:
    if device == "cpu":           # the interpreter: one timed call (a smoke run, not a number)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100,
                    return_mode="median")


def _host_us(fn, device: str, n: int = 20) -> float:
    """Host time of one launch (argument checks, descriptors, Triton's dispatch): n launches
    queued back to back, far fewer than fill the launch queue, so none waits for the GPU."""
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def bench_shape(name, n_w, K, res, silu, M, forms, args, dtype) -> dict:
    dev = args.device
    N = n_w // 2 if silu else n_w
    g = torch.Generator(device="cpu").manual_seed(n_w * 7 + K)
    W = (torch.randn(n_w, K, generator=g) * K ** -0.5).to(dev, dtype)
    x = torch.randn(M, K, generator=g).to(dev, dtype)
    r0 = torch.randn(M, N, generator=g).to(dev, dtype)
    flops = 2.0 * M * n_w * K
    row = dict(shape=name, M=M, N=N, K=K, n_w=n_w, epilogue="silu_mul" if silu else
               ("residual" if res else "plain"), gflop=flops / 1e9, forms={})

    def run(cfg, out):
        G.gemm(x, W, out, residual=out if res else None, silu_mul=silu, config=cfg, table=None)

    ref = None
    for form in forms:
        cfg = form_config(form, M, N, K, silu, res)
        if args.tiny:
            cfg = tiny_config(cfg)
        if cfg is None:
            continue
        entry = dict(config=cfg)
        try:
            out = r0.clone()
            run(cfg, out)                      # compile, and the result to check
            if dev == "cuda":
                torch.cuda.synchronize()
            if ref is None:                    # the first form that runs (grid) is the reference
                ref = out
            ok, max_err, n_bad = agree(out, ref)
            again = r0.clone()
            run(cfg, again)
            entry.update(correct=ok, max_err=max_err, n_bad=n_bad,
                         repeatable=bool(torch.equal(again, out)))
            scratch = r0.clone()
            ms = _time_ms(lambda: run(cfg, scratch), dev, args.quick)
            entry.update(ms=ms, tflops=flops / ms / 1e9, host_us=_host_us(lambda: run(cfg, scratch), dev))
        except Exception as e:  # a form that does not compile on this GPU / Triton
            entry.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            if args.verbose:
                traceback.print_exc()
            if dev == "cuda":
                torch.cuda.synchronize()
        row["forms"][form] = entry
    if dev == "cuda":                          # cuBLAS: the plain product, the ceiling
        Wt = W.t()
        row["cublas_ms"] = _time_ms(lambda: torch.matmul(x, Wt), dev, args.quick)
        row["cublas_tflops"] = flops / row["cublas_ms"] / 1e9
    return row


def _print_row(row: dict) -> None:
    head = f"{row['shape']:18s} M={row['M']:5d} N={row['N']:5d} K={row['K']:5d} {row['epilogue']:8s}"
    print(head + (f"  cuBLAS {row['cublas_ms'] * 1e3:8.1f} us {row['cublas_tflops']:6.0f} TFLOP/s"
                  if "cublas_ms" in row else ""))
    for form, e in row["forms"].items():
        if "error" in e:
            print(f"    {form:12s} FAILED {e['error']}")
            continue
        flag = "" if e["correct"] and e["repeatable"] else \
            f"  MISMATCH (max {e['max_err']:.3g}, {e['n_bad']} bad, repeatable {e['repeatable']})"
        c = e["config"]
        tiles = f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}"
        form_keys = " ".join(f"{k}={c[k]}" for k in G.GEMM_FORM_DEFAULTS if c[k] != G.GEMM_FORM_DEFAULTS[k])
        print(f"    {form:12s} {e['ms'] * 1e3:8.1f} us {e['tflops']:6.0f} TFLOP/s  host {e['host_us']:5.1f} us"
              f"  {tiles} {form_keys}{flag}")


def summary(rows: list[dict], layers: dict, forms) -> list[str]:
    """The prefill's GEMM time per form at each M (x layers), and the best form per shape."""
    lines = []
    for M in sorted({r["M"] for r in rows}):
        rs = [r for r in rows if r["M"] == M]
        tflop = sum(r["gflop"] * layers[r["shape"]] for r in rs) / 1e3
        lines.append(f"M = {M}: {tflop:.2f} TFLOP of projections per prefill chunk")
        for form in forms:
            # a form that skips a shape (split-K on the wide ones) runs it as `default` does
            tot, ok = 0.0, True
            for r in rs:
                e = r["forms"].get(form) or r["forms"].get("default") or {}
                if "ms" not in e:
                    ok = False
                    break
                tot += e["ms"] * layers[r["shape"]]
            if ok:
                lines.append(f"  {form:12s} {tot:8.3f} ms  {tflop / tot * 1e3:6.0f} TFLOP/s")
        best = 0.0
        for r in rs:
            runs = {f: e for f, e in r["forms"].items() if "ms" in e and e["correct"]}
            if runs:
                f = min(runs, key=lambda k: runs[k]["ms"])
                best += runs[f]["ms"] * layers[r["shape"]]
                lines.append(f"    best for {r['shape']:18s}: {f} ({runs[f]['ms'] * 1e3:.1f} us)")
        if "cublas_ms" in rs[0]:
            cub = sum(r["cublas_ms"] * layers[r["shape"]] for r in rs)
            lines.append(f"  {'cuBLAS':12s} {cub:8.3f} ms  {tflop / cub * 1e3:6.0f} TFLOP/s (no epilogues)")
        lines.append(f"  {'best/shape':12s} {best:8.3f} ms  {tflop / best * 1e3:6.0f} TFLOP/s")
    return lines


def _signature(cfg: dict, silu: bool, res: bool, dtype: str = "bf16") -> tuple:
    """(kernel, signature, constexprs, attrs) of the main launch of `cfg`, specialised as a
    real launch of the true shapes is (16-byte aligned pointers, strides and sizes)."""
    BM, BN, BK = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    common = dict(HAS_RESIDUAL=res, SILU_MUL=silu, EVEN_K=True, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                  GROUP_M=cfg["GROUP_M"], DOT_PREC="tf32", PDL=0)
    ints = ["M", "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_rm", "up_row_offset"]
    if not (cfg["PERSISTENT"] or cfg["TMA"] or cfg["SPLIT_K"] > 1):
        kernel, sig = G._gemm_kernel, dict.fromkeys(["x_ptr", "w_ptr", "out_ptr", "res_ptr"], f"*{dtype}")
        const = common
    else:
        kernel, split = G._gemm_persistent_kernel, cfg["SPLIT_K"]
        tma = bool(cfg["TMA"])
        desc = lambda r, c: f"tensordesc<{dtype}[{r}, {c}]>" if tma else f"*{dtype}"  # noqa: E731
        o = desc(BM, BN) if split == 1 and cfg["TMA"] == 1 else f"*{dtype}"
        sig = dict(x=desc(BM, BK), w=desc(BN, BK), out=o, res=o, ws="*fp32", w_mem=f"*{dtype}")
        ints += ["num_programs", "k_tiles_per_split"]
        const = dict(common, USE_TMA=tma, TMA_OUT=tma and cfg["TMA"] == 1 and split == 1, SPLIT_K=split, FLATTEN=bool(cfg["FLATTEN"]),
                     WARP_SPEC=bool(cfg["WARP_SPEC"]))
    sig.update(dict.fromkeys(ints, "i32"))
    aligned = [i for i, (n, t) in enumerate(sig.items())
               if t.startswith("*") or n not in ("num_programs", "k_tiles_per_split")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    return kernel, dict(sig, **dict.fromkeys(const, "constexpr")), const, attrs


def compile_only(args, forms, shapes) -> int:
    """Compile each form's main kernel for sm_90 at the true shapes (M = 2048) without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    res_all, ok = {}, True
    for name, (n_w, K, res, silu, _layers) in shapes.items():
        N = n_w // 2 if silu else n_w
        for form in forms:
            cfg = form_config(form, 2048, N, K, silu, res)
            if cfg is None:
                continue
            kernel, sig, const, attrs = _signature(cfg, silu, res)
            t0 = time.time()
            try:
                k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs),
                                   target=GPUTarget("cuda", 90, 64),
                                   options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
                ptx = k.asm["ptx"]
                info = dict(ok=True, s=round(time.time() - t0, 1), shared=int(k.metadata.shared),
                            tma=ptx.count("cp.async.bulk.tensor"), cp_async=ptx.count("cp.async.cg"),
                            wgmma=ptx.count("wgmma.mma_async"))
            except Exception as e:  # noqa: BLE001 - reported, the run fails
                info = dict(ok=False, error=f"{type(e).__name__}: {e}"[-1500:])
                ok = False
            res_all[f"{name}/{form}"] = info
            print(f"{name:18s} {form:12s} {json.dumps(info)}", flush=True)
    print(json.dumps({"compile_only": res_all}))
    return 0 if ok else 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--T", type=int, nargs="*", default=[2048, 8192], help="GEMM rows (prompt tokens)")
    p.add_argument("--forms", default=",".join(FORMS), help="comma-separated forms (see above)")
    p.add_argument("--shapes", default="", help="comma-separated substrings of shape names (default all)")
    p.add_argument("--tiny", action="store_true", help="the tiny model's shapes and tiles (CPU smoke run)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) / float16 / float32")
    p.add_argument("--quick", action="store_true", help="shorter timing windows")
    p.add_argument("--verbose", action="store_true", help="tracebacks of the forms that fail")
    p.add_argument("--compile-only", action="store_true", help="offline sm_90 compile (no GPU)")
    return p.parse_args(argv)


def _shapes(args, cfg) -> dict:
    shapes = gemm_shapes(cfg)
    if args.shapes:
        keep = [s.strip() for s in args.shapes.split(",")]
        shapes = {k: v for k, v in shapes.items() if any(s in k for s in keep)}
    return shapes


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_only:
        forms = [f.strip() for f in args.forms.split(",") if f.strip()]
        return compile_only(args, forms, _shapes(args, qwen35_08b_config()))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("prefill_gemm needs a CUDA GPU (or --device cpu under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device == "cuda"
                                                           else torch.float32)
    if args.tiny:
        from tritonchat.engine.tiny_model import TINY_TEXT
        cfg = parse_config(dict(TINY_TEXT, model_type="qwen3_5_text"))
    else:
        cfg = qwen35_08b_config()
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    for f in forms:
        if f not in FORMS:
            print(f"unknown form {f!r}; forms: {', '.join(FORMS)}", file=sys.stderr)
            return 2
    if "grid" in forms:                       # the reference every form is checked against
        forms.remove("grid")
    forms.insert(0, "grid")
    shapes = _shapes(args, cfg)
    info = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
                triton=__import__("triton").__version__, torch=torch.__version__, dtype=str(dtype))
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    rows = []
    for M in args.T:
        for name, (n_w, K, res, silu, _layers) in shapes.items():
            row = bench_shape(name, n_w, K, res, silu, M, forms, args, dtype)
            _print_row(row)
            sys.stdout.flush()
            rows.append(row)
    layers = {name: v[4] for name, v in shapes.items()}
    lines = summary(rows, layers, forms)
    print("\n".join(lines))
    bad = [(r["shape"], r["M"], f) for r in rows for f, e in r["forms"].items()
           if "ms" in e and not (e["correct"] and e["repeatable"])]
    print(json.dumps(dict(info, rows=rows, summary=lines, mismatches=bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
