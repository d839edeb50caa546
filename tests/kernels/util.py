"""Helpers the kernel tests share (fixtures live in conftest.py)."""
import contextlib

import torch

from tritonchat.kernels.gemv import scratch_numel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# bf16 only on the GPU: the interpreter rounds fp32 -> bf16 toward zero where the reference
# (and the GPU) round to nearest even, and the fused kernels round at several points.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# the true 0.8B shapes the GPU twins run at
Q08 = dict(D=1024, I=3584, hk=16, hv=16, dk=128, dv=128, kw=4, V=248320)


def tol(dtype):
    # fp32: summation-order noise. half: an fp32 value may round one ulp apart at a rounding
    # point (norm output, conv, SiLU), which the GEMV then carries into the output.
    return {torch.float32: dict(rtol=2e-5, atol=2e-5),
            torch.float16: dict(rtol=4e-3, atol=4e-3),
            torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}[dtype]


def scratch(n_out, split_k, block_n, silu_mul=False):
    """NaN-filled partials (a stale read would show) and zeroed counters."""
    n_p, n_c = scratch_numel(n_out, dict(split_k=split_k, block_n=block_n), silu_mul)
    return (torch.full((max(n_p, 1) + 3,), float("nan"), device=DEVICE),
            torch.zeros(max(n_c, 1) + 3, device=DEVICE, dtype=torch.int32))


def vec(n, g, scale=1.0, dtype=torch.float32):
    return (torch.randn(n, generator=g) * scale).to(DEVICE, dtype)


def epilogue_case(epilogue, n_out, g, dtype, conv_channels):
    """(out, launcher kwargs, reference kwargs) for one GEMV epilogue: `out` is NaN-filled (or
    the residual itself for residual_inplace); the conv case holds a state of 3 inputs for the
    first `conv_channels` rows."""
    kw, ref_kw = {}, {}
    if epilogue == "residual_inplace":
        res = vec(n_out, g, 1.0, dtype)
        out = res.clone()
        kw, ref_kw = dict(residual=out), dict(residual=res)
    else:
        out = torch.full((n_out,), float("nan"), device=DEVICE, dtype=dtype)
    if epilogue == "silu_mul":
        kw, ref_kw = dict(silu_mul=True), dict(silu_mul=True)
    if epilogue == "conv":
        C, kwid = conv_channels, 4
        conv_w = vec(C * kwid, g, 0.5, dtype).view(C, kwid)
        conv_state = vec(C * (kwid - 1), g, 1.0, dtype).view(C, kwid - 1)
        ref_kw = dict(conv_state=conv_state.clone(), conv_w=conv_w)
        kw = dict(conv_state=conv_state, conv_w=conv_w)
    return out, kw, ref_kw


@contextlib.contextmanager
def launches(*modules):
    """[(kernel, its PDL constexpr, launch_pdl asked)] of every launch of the `*_kernel` JIT
    functions of these modules while the block runs (PDL None: the launch passed none)."""
    seen = []
    kernels = [getattr(m, n) for m in modules for n in dir(m)
               if n.endswith("_kernel") and hasattr(getattr(m, n), "run")]
    saved = [k.run for k in kernels]

    def spy(k, run):
        def launch(*args, **kw):
            seen.append((k.fn.__name__, kw.get("PDL"), bool(kw.get("launch_pdl", False))))
            return run(*args, **kw)
        return launch
    try:
        for k, run in zip(kernels, saved):
            k.run = spy(k, run)
        yield seen
    finally:
        for k, run in zip(kernels, saved):
            k.run = run
