"""Premise test for a persistent decode step (issue #59, step 2): whole Gated DeltaNet layers of
Qwen3.5-0.8B (in_proj, recurrent core, out_proj, MLP) as ONE persistent Triton kernel, against
today's per-operator engine kernels.

Per layer l (hidden H = 1024, 16 key / 16 value heads, dk = dv = 128, conv_dim = 6144, taps 4,
intermediate I = 3584; bf16 weights, fp32 recurrent state):

    x    = round(h * rsqrt(mean(h^2) + eps) * (1 + w_in))                  input RMSNorm
    m    = round(W_qkvba x);  qkv = round(silu(round(conv(state | m[:C]))))  in_proj + conv + SiLU
    z    = round(W_z x)                                                    (conv state shifted)
    o    = round(delta rule on S [16, 128, 128] fp32, l2norm q/k, g, beta)  GDN core, S updated
    h    = round(h + W_out round(w_g * round(rmsnorm_head(o)) * silu(z)))  out_proj, gated norm
    a    = round(silu(Wg x') * (Wu x')),  x' = round(rmsnorm(h) * (1 + w_post))   MLP gate|up
    h    = round(h + Wd a)                                                 MLP down

Variants (``--variant a,b,...`` or ``--all``):

  baseline      today's engine: a tritonchat.engine.decode_step.DecodeStep built over these
                layers, its own ``gated_deltanet(i, layer)`` and ``mlp(layer)`` per layer (the
                calls of a decode step: in_proj GEMV + conv epilogue, gdn_decode with the z
                programs, out_proj GEMV + gated norm, gate|up, down), the engine's plans, PDL
                as the engine sets it, CUDA-graph captured. 5 launches a layer.
  phase         this script's kernel, one launch per operator (constexpr PHASE = 0..4, no
                spinning), every launch on the persistent grid, PDL between the launches.
  persist*      ONE launch per chain, grid = SMs x programs per SM (checked against the compiled
                kernel's occupancy), a static task list per program (task t of an operator is
                program t mod G's), per-operator completion counters whose targets carry the
                chain number (read from the program's epoch slot: nothing is reset between
                chains or graph replays), no float atomics (each output row is one program's
                fp32 sum). Weights (and the program's own state tiles) of an operator's first
                task are loaded into registers BEFORE the program waits on the operator's
                inputs; inside an operator each task loads the next one's tile before reducing
                its own (persistent_mlp's persist_sw0 form). Operators, per layer:
                  0 in_proj   rows of [qkv | b | a] (the engine's qkvba), norm recomputed per
                              program, the engine's conv epilogue (kernels.gemv._epilogue)
                  1 core + z  tasks [value head x V-tile of the core | z rows]: a program first
                              runs its z rows (they need only the layer input, no wait), then
                              waits for the in_proj and runs its core tiles (state tile loaded
                              before the wait)
                  2 out_proj  the gated RMSNorm per value head, + residual
                  3 gate|up   RMSNorm, SiLU * up
                  4 down      + residual
                ``_x1`` / ``_x3``: 1 / 3 programs per SM instead of --ppsm.

Every variant reads the same weight and state tensors (weights cycled over several copies so
that each chain reads HBM), from the same initial values. Checks before timing: each variant's
h, conv states and recurrent states after one chain against a PyTorch fp32 reference of the
chain (kernels/reference.py: gemv_ref, gdn_decode_ref; rounded where the kernels round), and
against the baseline's (bf16 tolerance); bit-repeatable over chains.

Reports: bytes a chain (weights + recurrent states read and written + conv states), the
roofline at the HBM read rate measured in the same run (tritonchat.kernels.bandwidth, as
persistent_mlp), us per chain and fraction of the roofline per variant, the cost of a
``--stall-ns`` stall (default 1 us) in one task of one operator (default the middle layer's GDN
core), the baseline's time per operator (CUDA events around each engine kernel, eager) and the
persistent kernel's per operator (%globaltimer when the operator's last task ended). A human
table, then ONE final JSON line.

    PYTHONUNBUFFERED=1 python benchmarks/persistent_gdn.py                 (GPU, true shape)
    TRITON_INTERPRET=1 python benchmarks/persistent_gdn.py --device cpu --tiny --phase
                                                                           (CPU smoke test)
    python benchmarks/persistent_gdn.py --compile-only                     (offline sm_90
                                                                            compile, registers)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import interpret_if_cpu  # noqa: E402

interpret_if_cpu()      # before triton.jit decorates anything below

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from persistent_common import (INTERPRET, add_driver_args, add_run_args,  # noqa: E402
                               best_persistent, cdiv, check_co_resident, compile_only_result,
                               compile_sm90, device_l2, hbm_roofline, import_tritonchat,
                               next_pow2, open_device, rel_err, round_floats, run_variants,
                               selected, stall_cost, sync, time_chains, under_watchdog)

import_tritonchat()

from tritonchat.kernels import persistent_step as PS  # noqa: E402

OPS = ("in_proj", "core+z", "out_proj", "gate_up", "down")       # per layer, in chain order
ENGINE_NAMES = ("gemv_gdn_in_proj_norm_conv", "gdn_decode", "gemv_gdn_out_proj_gatednorm",
                "gemv_mlp_gate_up_norm_silu", "gemv_mlp_down")   # the engine's, same order
N_OPS = len(OPS)
# the kernel's view of the constant above (Triton reads globals only as constexprs)
N_OPS_K = tl.constexpr(N_OPS)


# ------------------------------------------------------------------------------------------
# the chain kernel: persistent (PHASE -1) or one operator per launch (PHASE 0..4), over the
# engine's persistent-step operators (kernels/persistent_step.py)
# ------------------------------------------------------------------------------------------

# no value specialisation of the runtime scalars: one binary for every grid, weight set, layer
# and stall setting
@triton.jit(do_not_specialize=["n_layers", "layer0", "phase_layer", "G", "stall_op", "stall_ns",
                               "timeout_ns", "n_stamp"])
def _gdn_chain_kernel(h_ptr, proj_ptr, z_ptr, o_ptr, act_ptr,
                      w_in_ptr, conv_w_ptr, alog_ptr, dtb_ptr, in_nw_ptr, g_nw_ptr, w_out_ptr,
                      post_nw_ptr, w_gu_ptr, w_d_ptr, conv_ptr, rec_ptr,
                      cnt_ptr, epoch_ptr, err_ptr, stamp_ptr, stall_rec_ptr,
                      n_layers, layer0, phase_layer, G, eps, q_scale, stall_op, stall_ns,
                      timeout_ns, n_stamp,
                      H: tl.constexpr, I: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr,
                      DK: tl.constexpr, DV: tl.constexpr, KW: tl.constexpr,
                      BN_IN: tl.constexpr, BN_Z: tl.constexpr, BV: tl.constexpr,
                      BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr,
                      PHASE: tl.constexpr, SPIN: tl.constexpr, STALL: tl.constexpr,
                      STAMP: tl.constexpr, PDL: tl.constexpr):
    # Weights and states are stacked per layer ([n_layers_total, ...]); this chain runs layers
    # layer0 .. layer0 + n_layers - 1. Operator q = 5 l + k (k: OPS) of layer l; every program
    # adds 1 to counter cnt[q] per chain when done with it, and operator q waits for
    # cnt[q - 1] >= chain number x G (the chain's first operator waits for nothing).
    # Activations: h [H] (residual stream, in place), proj [qkv conv out | b | a], z [Hv dv],
    # o [Hv dv], act [I]. Row-only tasks (K-split 1) for the out_proj and the down.
    pid = tl.program_id(0)
    PERSIST: tl.constexpr = PHASE == -1
    KEY_DIM: tl.constexpr = HK * DK
    CONV_DIM: tl.constexpr = 2 * KEY_DIM + HV * DV
    N_IN: tl.constexpr = CONV_DIM + 2 * HV
    VD: tl.constexpr = HV * DV
    HP: tl.constexpr = triton.next_power_of_2(H)
    if PERSIST:
        l_lo = 0
        l_hi = n_layers
        base = tl.load(epoch_ptr + pid) + 1               # this chain's counter multiple
    else:
        l_lo = phase_layer
        l_hi = phase_layer + 1
        base = 1
    for l in range(l_lo, l_hi):
        L = (layer0 + l).to(tl.int64)
        q0 = N_OPS_K * l
        if PERSIST or PHASE == 0:
            x = PS._gdn_in_proj(h_ptr, proj_ptr, w_in_ptr + L * ((N_IN + VD) * H), in_nw_ptr + L * H,
                                conv_w_ptr + L * (CONV_DIM * KW), conv_ptr + L * (CONV_DIM * (KW - 1)),
                                eps, cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q0, base, pid, G,
                                stall_op, stall_ns, timeout_ns, n_stamp, H, N_IN, CONV_DIM, KW,
                                BN_IN, SPIN, PERSIST, STALL, STAMP, PDL)
        if PERSIST or PHASE == 1:
            if PHASE == 1:
                # its own launch: the normed layer input again (h is final: its writer is two
                # launches back, complete under PDL mode 1)
                offs_h = tl.arange(0, HP)
                nw = tl.load(in_nw_ptr + L * H + offs_h, mask=offs_h < H,
                             other=0.0).to(tl.float32)
                x = PS._rms_x(h_ptr, nw, offs_h, eps, H)
            PS._gdn_core_z(x, proj_ptr, z_ptr, o_ptr, w_in_ptr + L * ((N_IN + VD) * H) + N_IN * H,
                           rec_ptr + L * (HV * DK * DV), alog_ptr + L * HV, dtb_ptr + L * HV,
                           q_scale, cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q0 + 1, base, pid,
                           G, stall_op, stall_ns, timeout_ns, n_stamp, H, HK, HV, DK, DV, BV, BN_Z,
                           SPIN, PERSIST, STALL, STAMP, PDL)
        if PERSIST or PHASE == 2:
            PS._narrow(o_ptr, z_ptr, g_nw_ptr + L * DV, w_out_ptr + L * (H * VD), h_ptr, h_ptr,
                       cnt_ptr, eps, cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q0 + 2, base, pid,
                       G, stall_op, stall_ns, timeout_ns, n_stamp, H, VD, True, HV, DV, BN_O, 1,
                       SPIN, PERSIST, STALL, STAMP, PDL)
        if PERSIST or PHASE == 3:
            PS._rms_gemv(h_ptr, act_ptr, w_gu_ptr + L * (2 * I * H), post_nw_ptr + L * H, eps,
                         cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q0 + 3, base, pid, G,
                         stall_op, stall_ns, timeout_ns, n_stamp, I, H, BN_GU, True, SPIN,
                         PERSIST, STALL, STAMP, PDL)
        if PERSIST or PHASE == 4:
            PS._narrow(act_ptr, act_ptr, act_ptr, w_d_ptr + L * (H * I), h_ptr, h_ptr, cnt_ptr,
                       eps, cnt_ptr, err_ptr, stamp_ptr, stall_rec_ptr, q0 + 4, base, pid, G,
                       stall_op, stall_ns, timeout_ns, n_stamp, H, I, False, 1, 1, BN_D, 1, SPIN,
                       PERSIST, STALL, STAMP, PDL)
    if PERSIST:
        tl.store(epoch_ptr + pid, base)


# ------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    hidden: int = 1024
    inter: int = 3584
    k_heads: int = 16
    v_heads: int = 16
    dk: int = 128
    dv: int = 128
    taps: int = 4

    @property
    def conv_dim(self):
        return 2 * self.k_heads * self.dk + self.v_heads * self.dv

    @property
    def n_in(self):                 # rows of the in_proj GEMV: [qkv | b | a]
        return self.conv_dim + 2 * self.v_heads

    @property
    def vd(self):                   # Hv x dv: z, o
        return self.v_heads * self.dv


TINY = Shape(hidden=64, inter=96, k_heads=2, v_heads=2, dk=16, dv=16, taps=4)


@dataclass
class Variant:
    name: str
    mode: str                   # baseline | phase | persist
    ppsm: int = 0               # programs per SM (0: --ppsm)
    spin: int = 0               # 0 acquire atomic, 1 volatile load
    pdl: int = 1                # phase mode: PDL between the launches
    what: str = ""


VARIANTS = [
    Variant("baseline", "baseline",
            what="today's engine: DecodeStep.gated_deltanet + mlp, engine plans, PDL"),
    Variant("phase", "phase",
            what="this kernel, one launch per operator on the persistent grid, PDL"),
    Variant("persist", "persist",
            what="persistent, counters, next tiles in registers, first tile before each wait"),
    Variant("persist_x1", "persist", ppsm=1, what="as persist, 1 program per SM"),
    Variant("persist_x3", "persist", ppsm=3, what="as persist, 3 programs per SM"),
    Variant("persist_vol", "persist", spin=1, what="as persist, spin on a volatile load"),
]
DEFAULT_VARIANTS = "baseline,phase,persist,persist_x1"
BY_NAME = {v.name: v for v in VARIANTS}


def resolve_tiles(args, shape: Shape):
    """Rows per task from the engine's plans (kernels.gemv.plan: block_n of in_proj, out_proj,
    gate|up, down; z rows = the in_proj's), the core's V-tile from the decode table's gdn_core
    entry (kernels.gdn_decode.default_block_v without one), halved until they fit the shape;
    4 warps (the MLP plans'), programs per SM = the down plan's persistent count (2 without).
    Fills the options left at 0; returns the plans."""
    from tritonchat.kernels import gemv as Gm
    from tritonchat.kernels._common import decode_table
    from tritonchat.kernels.gdn_decode import default_block_v
    s = shape
    plans = dict(
        in_proj=Gm.plan(s.n_in, s.hidden, "rms", "conv"),
        out_proj=Gm.plan(s.hidden, s.vd, "gated", "residual", s.dv),
        gate_up=Gm.plan(s.inter, s.hidden, "rms", "silu_mul"),
        down=Gm.plan(s.hidden, s.inter, "none", "residual"))
    core = decode_table().get(f"gdn_core:{s.v_heads}x{s.dk}x{s.dv}") or {}
    plans["core"] = dict(block_v=int(core.get("block_v", default_block_v(s.dv, s.v_heads))))

    def rows(bn, n):
        bn = max(1, min(int(bn), next_pow2(n)))
        return bn
    if not args.bn_in:
        args.bn_in = rows(plans["in_proj"]["block_n"], s.n_in)
    if not args.bn_z:
        args.bn_z = rows(args.bn_in, s.vd)
    if not args.bn_out:
        args.bn_out = rows(plans["out_proj"]["block_n"], s.hidden)
    if not args.bn_gu:
        args.bn_gu = rows(plans["gate_up"]["block_n"], s.inter)
    if not args.bn_d:
        args.bn_d = rows(plans["down"]["block_n"], s.hidden)
    if not args.bv:
        args.bv = min(next_pow2(s.dv), plans["core"]["block_v"])
    if not args.num_warps:
        args.num_warps = int(plans["gate_up"]["num_warps"])
    if not args.ppsm:
        args.ppsm = int(plans["down"].get("persistent", 0)) or 2
    for name in ("bn_in", "bn_z", "bn_out", "bn_gu", "bn_d", "bv"):
        v = getattr(args, name)
        if v < 1 or v & (v - 1):
            raise SystemExit(f"--{name.replace('_', '-')} must be a power of two, got {v}")
    return plans


class GdnChain:
    """n_sets independent copies of n_layers GDN layers (weights and states), so that successive
    timed chains read HBM, not L2; the initial states and h, for reset(); the activations of the
    persistent kernel. The baseline's DecodeStep gets views of the same tensors."""

    def __init__(self, shape: Shape, n_layers, n_sets, dtype, device, seed=0, eps=1e-6):
        s = self.s = shape
        if s.v_heads % s.k_heads or s.v_heads & (s.v_heads - 1) or s.dv & (s.dv - 1):
            raise SystemExit("value heads must be a power-of-two multiple of the key heads, and "
                             "dv a power of two (the gated norm's [Hv, dv] tile)")
        self.L, self.S, self.dtype, self.eps = n_layers, n_sets, dtype, eps
        self.device = torch.device(device)
        dev = self.device
        nl = n_layers * n_sets
        H, I, C, Hv = s.hidden, s.inter, s.conv_dim, s.v_heads
        g = torch.Generator(device="cpu").manual_seed(seed)

        def rnd(*shp, scale, shift=0.0, dt=dtype):
            return (torch.randn(*shp, generator=g) * scale + shift).to(dt)

        e = lambda *shp, dt=dtype: torch.empty(*shp, dtype=dt, device=dev)  # noqa: E731
        self.w_in = e(nl, s.n_in + s.vd, H)     # the engine's merged in_proj: qkv | b | a | z
        self.conv_w = e(nl, C, s.taps)
        self.a_log = e(nl, Hv, dt=torch.float32)
        self.dt_bias = e(nl, Hv)
        self.in_nw = e(nl, H)
        self.g_nw = e(nl, s.dv, dt=torch.float32)
        self.w_out = e(nl, H, s.vd)
        self.post_nw = e(nl, H)
        self.w_gu = e(nl, 2 * I, H)
        self.w_d = e(nl, H, I)
        self.conv0 = e(nl, C, s.taps - 1)
        self.rec0 = e(nl, Hv, s.dk, s.dv, dt=torch.float32)
        for i in range(nl):
            self.w_in[i].copy_(rnd(s.n_in + s.vd, H, scale=H ** -0.5))
            self.conv_w[i].copy_(rnd(C, s.taps, scale=s.taps ** -0.5))
            self.a_log[i].copy_(torch.log(torch.rand(Hv, generator=g) * 15 + 1))
            self.dt_bias[i].copy_(rnd(Hv, scale=0.5, shift=1.0))
            self.in_nw[i].copy_(rnd(H, scale=0.1))
            self.g_nw[i].copy_(rnd(s.dv, scale=0.1, shift=1.0, dt=torch.float32))
            self.w_out[i].copy_(rnd(H, s.vd, scale=s.vd ** -0.5))
            self.post_nw[i].copy_(rnd(H, scale=0.1))
            self.w_gu[i].copy_(rnd(2 * I, H, scale=H ** -0.5))
            self.w_d[i].copy_(rnd(H, I, scale=I ** -0.5))
            self.conv0[i].copy_(rnd(C, s.taps - 1, scale=1.0))
            self.rec0[i].copy_(rnd(Hv, s.dk, s.dv, scale=0.05, dt=torch.float32))
        self.h0 = rnd(H, scale=1.0).to(dev)
        self.h = self.h0.clone()
        self.conv = self.conv0.clone()
        self.rec = self.rec0.clone()
        z = lambda n: torch.zeros(n, dtype=dtype, device=dev)  # noqa: E731
        self.proj, self.z, self.o, self.act = z(s.n_in), z(s.vd), z(s.vd), z(I)

    def reset(self):
        self.h.copy_(self.h0)
        self.conv.copy_(self.conv0)
        self.rec.copy_(self.rec0)

    def layers(self, s):
        return range(s * self.L, (s + 1) * self.L)

    def result(self, s):
        """What a chain on set s produced: (h, conv states, recurrent states) of its layers."""
        sl = slice(s * self.L, (s + 1) * self.L)
        return self.h.clone(), self.conv[sl].clone(), self.rec[sl].clone()

    def reference(self, s=0):
        """The chain on set s from the initial h and states in PyTorch fp32
        (kernels/reference.py; rounded to the activation dtype where the kernels round):
        (h, conv states, recurrent states)."""
        from tritonchat.kernels import reference as R
        sh, eps = self.s, self.eps
        C, n_in = sh.conv_dim, sh.n_in
        h = self.h0.clone()
        convs, recs = [], []
        for l in self.layers(s):
            W = self.w_in[l]
            y, conv = R.gemv_ref(h, W[:n_in], norm_w=self.in_nw[l], eps=eps,
                                 conv_state=self.conv0[l], conv_w=self.conv_w[l])
            z, _ = R.gemv_ref(h, W[n_in:], norm_w=self.in_nw[l], eps=eps)
            proj = torch.cat([y[:C], z, y[C:]])          # gdn_decode_ref's [x | z | b | a]
            o, S = R.gdn_decode_ref(proj, self.a_log[l], self.dt_bias[l], self.rec0[l],
                                    num_k_heads=sh.k_heads, num_v_heads=sh.v_heads,
                                    head_k_dim=sh.dk, head_v_dim=sh.dv)
            h, _ = R.gemv_ref(o, self.w_out[l], norm_w=self.g_nw[l], gate=z, head_dim=sh.dv,
                              eps=eps, residual=h)
            a, _ = R.gemv_ref(h, self.w_gu[l], norm_w=self.post_nw[l], eps=eps, silu_mul=True)
            h, _ = R.gemv_ref(a, self.w_d[l], residual=h)
            convs.append(conv)
            recs.append(S)
        return h, torch.stack(convs), torch.stack(recs)


def chain_bytes(s: Shape, n_layers, dtype):
    """(weight bytes, state bytes) one chain moves: every weight once (A_log and the gated
    norm's weight in fp32, as the checkpoint stores them); the recurrent and the conv states
    read and written."""
    esz = torch.empty((), dtype=dtype).element_size()
    w = ((s.n_in + s.vd) * s.hidden + s.conv_dim * s.taps + s.v_heads + 2 * s.hidden
         + s.hidden * s.vd + 3 * s.inter * s.hidden) * esz + (s.v_heads + s.dv) * 4
    st = 2 * s.v_heads * s.dk * s.dv * 4 + 2 * s.conv_dim * (s.taps - 1) * esz
    return n_layers * w, n_layers * st


def chain_errors(got, ref):
    """Relative max errors of (h, conv states, recurrent states) against ref's."""
    return {k: float(f"{rel_err(a, b):.3g}")          # 3 digits: the JSON keeps small ones
            for k, a, b in zip(("h", "conv", "rec"), got, ref)}


class Runner:
    """Launches one chain of a variant on weight set s: run(s)."""

    def __init__(self, chain: GdnChain, v: Variant, args):
        self.c, self.v, self.args = chain, v, args
        self.nl = chain.L
        dev = chain.device
        self.is_cuda = dev.type == "cuda"
        self.stall_op, self.stall_ns = -1, 0
        self.timer = None
        if v.mode == "baseline":
            self._init_baseline()
            return
        self.ppsm = v.ppsm or args.ppsm
        if self.is_cuda:
            self.G = torch.cuda.get_device_properties(dev).multi_processor_count * self.ppsm
        elif v.mode == "persist":
            # the interpreter runs programs one after another: a single program is the only
            # persistent grid that cannot deadlock there (it satisfies its own waits)
            self.G = 1
        else:
            self.G = args.cpu_programs
        n_ops = N_OPS * self.nl
        self.n_stamp = 2 * n_ops                # each operator's start and end, per program
        self.cnt = torch.zeros(n_ops + 1, dtype=torch.int32, device=dev)
        self.epoch = torch.zeros(self.G, dtype=torch.int32, device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)
        self.stamps = torch.zeros(self.G, self.n_stamp, dtype=torch.int64, device=dev)
        self.stall_rec = torch.zeros(4, dtype=torch.int64, device=dev)
        self.meta = kernel_meta(args, chain.s)
        self.meta["SPIN"] = v.spin
        self.pdl = bool(v.pdl and v.mode == "phase" and self.is_cuda and not INTERPRET
                        and torch.cuda.get_device_capability(dev)[0] >= 9)
        self.timeout_ns = int(args.spin_timeout_ms * 1e6)

    # -------------------------------------------------------------------- baseline ----
    def _init_baseline(self):
        """A real DecodeStep over the chain's layers (all n_sets x L of them, GDN), built as the
        backend builds it (split-K, context ranges and PDL as the engine's defaults); run()
        calls its gated_deltanet(i, layer) and mlp(layer)."""
        from tritonchat.engine.config import LINEAR_ATTENTION, TextConfig
        from tritonchat.engine.decode_step import (DecodeStep, GdnWeights, KernelTimer,
                                                   LayerWeights, StepIO)
        from tritonchat.engine.reference import ModelState
        from tritonchat.kernels import sampling as Smp
        from tritonchat.kernels._common import pdl_mode, sm_count
        c, s, dev = self.c, self.c.s, self.c.device
        nl = c.L * c.S
        vocab = 256
        tiny = s.hidden < 256
        cfg = TextConfig(hidden_size=s.hidden, intermediate_size=s.inter, num_hidden_layers=nl,
                         layer_types=(LINEAR_ATTENTION,) * nl, vocab_size=vocab,
                         rms_norm_eps=c.eps, tie_word_embeddings=True,
                         num_attention_heads=4 if tiny else 8, num_key_value_heads=2,
                         head_dim=32 if tiny else 256, rope_theta=1e7, partial_rotary_factor=0.25,
                         linear_num_key_heads=s.k_heads, linear_num_value_heads=s.v_heads,
                         linear_key_head_dim=s.dk, linear_value_head_dim=s.dv,
                         linear_conv_kernel_dim=s.taps)
        layers = []
        for i in range(nl):
            W = c.w_in[i]
            mixer = GdnWeights(W, W[:s.n_in], W[s.n_in:], c.conv_w[i], c.a_log[i], c.dt_bias[i],
                               c.g_nw[i], c.w_out[i])
            layers.append(LayerWeights(LINEAR_ATTENTION, c.in_nw[i], c.post_nw[i], c.w_gu[i],
                                       c.w_d[i], mixer))
        state = ModelState(cfg, 16, dev, c.dtype)
        state.rec_buf = c.rec                       # the chain's states, as the step's
        state.conv = {i: c.conv[i] for i in range(nl)}
        state.rec = {i: c.rec[i] for i in range(nl)}
        zt = lambda *shp, dt=c.dtype: torch.zeros(*shp, device=dev, dtype=dt)  # noqa: E731
        io = StepIO(tok=zt(1, dt=torch.int64), pos=zt(1, dt=torch.int32),
                    tok_ring=zt(8, dt=torch.int64), h=c.h, logits=zt(vocab, dt=torch.float32),
                    counts=zt(2, vocab, dt=torch.int32), rng_state=zt(2, dt=torch.int64),
                    sampler_params=zt(Smp.NUM_PARAMS, dt=torch.float32))
        embed = zt(vocab, s.hidden)
        self.step = DecodeStep(cfg, layers, embed, embed, zt(s.hidden), io, state,
                               max_context=64, valid_vocab=vocab, split_k=True,
                               context_ranges=True, pdl=pdl_mode(True, False, dev),
                               sm_count=sm_count(dev))
        self.layers = layers
        self.KernelTimer = KernelTimer

    # ------------------------------------------------------------------------ launch ----
    def _launch(self, s, phase, layer):
        c, s_ = self.c, self.c.s
        kw = dict(self.meta)
        if self.pdl:
            kw["launch_pdl"] = True
        _gdn_chain_kernel[(self.G,)](
            c.h, c.proj, c.z, c.o, c.act, c.w_in, c.conv_w, c.a_log, c.dt_bias, c.in_nw, c.g_nw,
            c.w_out, c.post_nw, c.w_gu, c.w_d, c.conv, c.rec,
            self.cnt, self.epoch, self.err, self.stamps, self.stall_rec,
            self.nl, s * c.L, layer, self.G, c.eps, float(s_.dk) ** -0.5, self.stall_op,
            self.stall_ns, self.timeout_ns, self.n_stamp,
            PHASE=phase, PDL=1 if self.pdl else 0, **kw)

    def run(self, s=0):
        v, c = self.v, self.c
        if v.mode == "baseline":
            step = self.step
            for i in c.layers(s):
                step.gated_deltanet(i, self.layers[i])
                step.mlp(self.layers[i])
        elif v.mode == "phase":
            for l in range(self.nl):
                for ph in range(N_OPS):
                    self._launch(s, ph, l)
        else:
            self._launch(s, -1, 0)

    def check_occupancy(self):
        """Compile without launching and check that the grid fits on the GPU at once (a
        persistent grid that is not co-resident deadlocks; the spin timeout is the last guard).
        Returns a dict (regs, spills, shared, programs_per_sm_max); raises if it cannot fit."""
        if not self.is_cuda or self.v.mode != "persist":
            return None
        c = self.c
        return check_co_resident(
            lambda: _gdn_chain_kernel.warmup(
                c.h, c.proj, c.z, c.o, c.act, c.w_in, c.conv_w, c.a_log, c.dt_bias, c.in_nw,
                c.g_nw, c.w_out, c.post_nw, c.w_gu, c.w_d, c.conv, c.rec,
                self.cnt, self.epoch, self.err, self.stamps, self.stall_rec,
                self.nl, 0, 0, self.G, c.eps, 1.0, -1, 0, self.timeout_ns, self.n_stamp,
                PHASE=-1, PDL=0, grid=(self.G,), **self.meta),
            self.meta["num_warps"], c.device, self.ppsm,
            dict(grid=self.G, programs_per_sm=self.ppsm))

    def errored(self):
        return self.v.mode != "baseline" and int(self.err.item()) != 0

    def op_times_us(self):
        """Per operator of the last persistent chain: when its last task ended minus when the
        previous operator's last task ended (the first: minus its earliest start), us, from the
        programs' %globaltimer stamps."""
        st = self.stamps.double().view(self.G, -1, 2)
        ends = st[:, :, 1].max(dim=0).values
        prev = torch.cat([st[:, :1, 0].min(dim=0).values, ends[:-1]])
        return [float(x) / 1e3 for x in (ends - prev).tolist()]


def kernel_meta(args, s: Shape):
    return dict(H=s.hidden, I=s.inter, HK=s.k_heads, HV=s.v_heads, DK=s.dk, DV=s.dv, KW=s.taps,
                BN_IN=args.bn_in, BN_Z=args.bn_z, BV=args.bv, BN_O=args.bn_out, BN_GU=args.bn_gu,
                BN_D=args.bn_d, SPIN=0, STALL=not INTERPRET, STAMP=not INTERPRET,
                num_warps=args.num_warps)


# ------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------

def engine_op_times(runner: Runner, n_sets, chains):
    """The baseline's time per engine kernel: `chains` eager chains (sets in turn) with the
    engine's own KernelTimer (CUDA events around each launch: no PDL overlap), us per chain
    and per launch, by kernel name."""
    step = runner.step
    timer = runner.KernelTimer()
    step.launch.timer = timer
    try:
        for k in range(chains):
            runner.run(k % n_sets)
            sync(runner.c.device)
            timer.accumulate(timer.events)
            timer.events = []
    finally:
        step.launch.timer = None
    out = {}
    for r in timer.rows() or []:
        out[r["name"]] = dict(us_per_chain=r["us_per_token"],
                              us_per_launch=r["us_per_token"] / r["launches_per_token"],
                              launches=r["launches_per_token"], gb_s=r["gb_s"])
    return out


def measure_variant(v, chain, args, dev, ctx):
    """Correctness, timing, stall cost (and per-operator times) of one variant; fills and returns
    its result dict (raises on failure; the caller records the error)."""
    r = ctx["out"][v.name]
    runner = Runner(chain, v, args)
    if v.mode != "baseline":
        r["grid"] = runner.G
    occ = runner.check_occupancy()
    if occ:
        r["occupancy"] = occ
    # correctness: one chain on set 0 from the initial state, against the reference and the
    # baseline; then once more for bit-repeatability (the counters carry over: epoch 2)
    chain.reset()
    runner.run(0)
    sync(dev)
    if runner.errored():
        raise RuntimeError("spin timeout (deadlock guard fired): grid not co-resident or a "
                           "counter never reached its target")
    got = chain.result(0)
    r["err_vs_ref"] = chain_errors(got, ctx["ref"])
    if v.mode == "baseline":
        ctx["base_out"] = got
    elif ctx.get("base_out") is not None:
        r["err_vs_baseline"] = chain_errors(got, ctx["base_out"])
    r["correct"] = max(r["err_vs_ref"].values()) <= ctx["tol"] and (
        "err_vs_baseline" not in r or max(r["err_vs_baseline"].values()) <= ctx["tol"])
    chain.reset()
    runner.run(0)
    sync(dev)
    again = chain.result(0)
    r["repeatable"] = all(bool(torch.equal(a, b)) for a, b in zip(got, again))
    if dev.type == "cpu":
        t = time.perf_counter()
        runner.run(0)
        r["us_per_chain"] = (time.perf_counter() - t) * 1e6
        return r
    n_sets = ctx["n_sets"]
    time_chains(runner, n_sets, args, ctx["graph"], dev, r)
    if ctx["roof_us"]:
        r["gb_s"] = ctx["chain_bytes"] / (r["us_per_chain"] * 1e3)
        r["frac_roofline"] = ctx["roof_us"] / r["us_per_chain"]
    if v.mode == "baseline":
        if args.eager_chains:
            r["ops"] = engine_op_times(runner, n_sets, args.eager_chains)
        return r
    if v.mode == "persist":
        runner.run(0)                    # one eager chain: its per-operator stamps
        sync(dev)
        t = runner.op_times_us()
        r["op_us"] = t
        r["op_us_by_kind"] = {name: sum(t[k::N_OPS]) for k, name in enumerate(OPS)}
    # stall injection: the same compiled kernel with stall 0 and stall_ns, alternated
    if not args.no_stall and not INTERPRET:
        stall_cost(runner, ctx["stall_op"], lambda: int(runner.stall_rec[0].item()), n_sets,
                   args, ctx["graph"], dev, r)
    return r


# ------------------------------------------------------------------------------------------
# offline compile (no GPU): ptxas register counts
# ------------------------------------------------------------------------------------------

def compile_only(args, shape, variants):
    dt = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}[args.dtype]
    sig = dict(h_ptr=dt, proj_ptr=dt, z_ptr=dt, o_ptr=dt, act_ptr=dt, w_in_ptr=dt,
               conv_w_ptr=dt, alog_ptr="*fp32", dtb_ptr=dt, in_nw_ptr=dt, g_nw_ptr="*fp32",
               w_out_ptr=dt, post_nw_ptr=dt, w_gu_ptr=dt, w_d_ptr=dt, conv_ptr=dt,
               rec_ptr="*fp32", cnt_ptr="*i32", epoch_ptr="*i32", err_ptr="*i32",
               stamp_ptr="*i64", stall_rec_ptr="*i64", n_layers="i32", layer0="i32",
               phase_layer="i32", G="i32", eps="fp32", q_scale="fp32", stall_op="i32",
               stall_ns="i64", timeout_ns="i64", n_stamp="i32")
    out = {}
    phases = sorted({ph for v in variants if v.mode != "baseline"
                     for ph in ((-1,) if v.mode == "persist" else range(N_OPS))})
    for ph in phases:
        meta = kernel_meta(args, shape)
        nwarps = meta.pop("num_warps")
        meta.update(STALL=True, STAMP=True, PHASE=ph, PDL=0 if ph == -1 else 1)
        key = "persist" if ph == -1 else f"phase/{OPS[ph]}"
        info = compile_sm90(_gdn_chain_kernel, sig, meta, nwarps, lambda ptx: dict(
            acquire=ptx.count(".acquire"), pdl=ptx.count("griddepcontrol"),
            globaltimer=ptx.count("%globaltimer")))
        if info.get("regs"):
            info["programs_per_sm_by_regs"] = 65536 // (cdiv(info["regs"] * 32, 256) * 256
                                                         * nwarps)
        out[key] = info
        print(key, json.dumps(info), flush=True)
    return compile_only_result(out)


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_driver_args(p, BY_NAME, DEFAULT_VARIANTS, layers=3, iters=30, reps=8)
    p.add_argument("--eager-chains", type=int, default=20,
                   help="eager baseline chains for the per-kernel event table (0: none)")
    p.add_argument("--phase", action="store_true",
                   help="only the variants without spinning (baseline, phase) and the persistent "
                        "one as a single program: what the interpreter can run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tiny", action="store_true",
                   help="hidden 64, inter 96, 2 + 2 heads of 16 (the CPU tests' shape)")
    for name, default in asdict(Shape()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"default {default} (tiny: {getattr(TINY, name)})")
    p.add_argument("--sets", type=int, default=0,
                   help="weight copies cycled through (0: enough for ~4x the L2 size)")
    p.add_argument("--bn-in", type=int, default=0, help="in_proj rows per task (0: its plan's)")
    p.add_argument("--bn-z", type=int, default=0, help="z rows per task (0: --bn-in)")
    p.add_argument("--bv", type=int, default=0, help="core value columns per task (0: plan)")
    p.add_argument("--bn-out", type=int, default=0, help="out_proj rows per task (0: plan)")
    p.add_argument("--bn-gu", type=int, default=0, help="gate (and up) rows per task (0: plan)")
    p.add_argument("--bn-d", type=int, default=0, help="down rows per task (0: plan)")
    p.add_argument("--num-warps", type=int, default=0, help="0: the gate_up plan's")
    p.add_argument("--ppsm", type=int, default=0,
                   help="programs per SM where a variant names none (0: the down plan's)")
    p.add_argument("--stall-ns", type=int, default=1000)
    p.add_argument("--stall-op", type=int, default=-1,
                   help="operator index that stalls (default: the middle layer's GDN core)")
    p.add_argument("--no-stall", action="store_true")
    p.add_argument("--no-graph", action="store_true")
    add_run_args(p, deadline_s=170.0,
                 cpu_programs_help="grid of the phase mode under the interpreter",
                 compile_only_help="offline sm_90 compile of the kernel (no GPU), ptxas registers")
    args = p.parse_args(argv)
    base = TINY if args.tiny else Shape()
    args.shape = Shape(**{k: (getattr(args, k) if getattr(args, k) is not None else d)
                          for k, d in asdict(base).items()})
    return args


def select(args):
    vs = selected(args, BY_NAME)
    if args.phase or INTERPRET:
        # the interpreter runs the persistent kernel as one program (its own waits satisfied);
        # the persistent variants differ only in grid and spin there: one of them
        keep, seen = [], False
        for v in vs:
            if v.mode == "persist":
                if seen:
                    continue
                seen = True
                v = Variant(**dict(asdict(v), what=v.what + " [one program]"))
            keep.append(v)
        vs = keep
    return vs


def main(argv=None):
    args = parse_args(argv)
    shape = args.shape
    plans = resolve_tiles(args, shape)
    variants = select(args)
    if args.compile_only:
        return compile_only(args, shape, variants)
    dev = open_device(args, "--device cpu --tiny --phase")
    dtype = getattr(torch, args.dtype)
    t_start = time.time()
    res = dict(device=str(dev), dtype=args.dtype, layers=args.layers, shape=asdict(shape),
               triton=triton.__version__, torch=torch.__version__,
               tiles=dict(bn_in=args.bn_in, bn_z=args.bn_z, bv=args.bv, bn_out=args.bn_out,
                          bn_gu=args.bn_gu, bn_d=args.bn_d, num_warps=args.num_warps,
                          ppsm=args.ppsm),
               engine_plans=plans)
    print(f"# task rows from the engine's plans: in_proj {args.bn_in}, z {args.bn_z}, core V-tile "
          f"{args.bv}, out_proj {args.bn_out}, gate_up {args.bn_gu}+{args.bn_gu}, down "
          f"{args.bn_d}; {args.num_warps} warps; persistent grid SMs x {args.ppsm}", flush=True)
    l2 = device_l2(dev, res)
    wb, sb = chain_bytes(shape, args.layers, dtype)
    n_sets = args.sets or (max(1, min(8, cdiv(4 * l2, wb + sb))) if dev.type == "cuda" else 2)
    print(f"# building {args.layers} GDN layers x {n_sets} weight sets, {shape} {args.dtype} on "
          f"{dev}", flush=True)
    chain = GdnChain(shape, args.layers, n_sets, dtype, dev)
    res.update(weight_sets=n_sets, chain_weight_bytes=wb, chain_state_bytes=sb,
               chain_bytes=wb + sb)
    out = {}
    res["variants"] = out
    return under_watchdog(args, res, t_start,
                          lambda: _run_variants(args, variants, dev, chain, res, out, n_sets,
                                                t_start))


def _run_variants(args, variants, dev, chain, res, out, n_sets, t_start):
    chain_bytes = res["chain_bytes"]
    bw, roof_us = hbm_roofline(args, dev, res, chain_bytes)
    if bw:
        print(f"# HBM read {bw:.0f} GB/s; {chain_bytes / 1e6:.2f} MB a chain "
              f"({res['chain_weight_bytes'] / 1e6:.2f} weights + {res['chain_state_bytes'] / 1e6:.2f}"
              f" states); roofline {roof_us:.2f} us a chain", flush=True)
    stall_op = args.stall_op if args.stall_op >= 0 else N_OPS * (args.layers // 2) + 1
    res["stall_op"] = stall_op
    res["stall_op_name"] = f"layer {stall_op // N_OPS} {OPS[stall_op % N_OPS]}"
    ctx = dict(out=out, ref=chain.reference(0), stall_op=stall_op, n_sets=n_sets,
               tol=dict(bfloat16=3e-2, float16=5e-3, float32=1e-4)[args.dtype],
               graph=not args.no_graph and dev.type == "cuda", roof_us=roof_us,
               chain_bytes=chain_bytes)
    run_variants(variants, lambda v: measure_variant(v, chain, args, dev, ctx), out, dev, _row)
    _report(args, res, out, chain_bytes, roof_us, bw, stall_op, t_start)
    return 0


def _report(args, res, out, chain_bytes, roof_us, bw, stall_op, t_start):
    print()
    print(f"{'variant':<12} {'us/chain':>9} {'GB/s':>7} {'%roof':>6} {'stall+us':>8} "
          f"{'err_ref':>8} {'err_base':>8} {'ok':>3}  what")
    for name, r in out.items():
        print(_row(name, r))
    if roof_us:
        print(f"roofline {roof_us:.2f} us/chain = {chain_bytes / 1e6:.2f} MB at {bw:.0f} GB/s "
              f"(weights + recurrent states read and written + conv states); stall: "
              f"{args.stall_ns} ns in one task of operator {stall_op} ({res['stall_op_name']})")
    # per operator: the engine's kernels (events, eager) beside the persistent kernel's stamps
    base_ops = out.get("baseline", {}).get("ops")
    pers = [(n, r) for n, r in out.items() if "op_us_by_kind" in r]
    if base_ops or pers:
        print()
        head = f"{'operator (x' + str(args.layers) + ' layers)':<24} {'engine kernel':<30} " \
               f"{'eager us':>9} {'us/launch':>9} {'GB/s':>6}"
        for n, _ in pers:
            head += f" {n + ' us':>14}"
        print(head)
        for k, op in enumerate(OPS):
            e = (base_ops or {}).get(ENGINE_NAMES[k], {})
            line = (f"{op:<24} {ENGINE_NAMES[k]:<30} {e.get('us_per_chain', float('nan')):9.2f} "
                    f"{e.get('us_per_launch', float('nan')):9.2f} {e.get('gb_s', float('nan')):6.0f}")
            for _, r in pers:
                line += f" {r['op_us_by_kind'][op]:14.2f}"
            print(line)
        if base_ops:
            tot = sum(e["us_per_chain"] for e in base_ops.values())
            line = f"{'sum':<24} {'(no PDL overlap)':<30} {tot:9.2f} {'':>9} {'':>6}"
            for _, r in pers:
                line += f" {sum(r['op_us']):14.2f}"
            print(line)
    best = best_persistent(out)
    verdict = None
    if best:
        b = out[best]
        verdict = dict(best_persistent=best, frac_roofline=b["frac_roofline"],
                       stall_cost_us=b.get("stall_cost_us"),
                       pass_roofline=b["frac_roofline"] >= 0.85,
                       pass_stall=(b.get("stall_cost_us") is not None
                                   and b["stall_cost_us"] < 0.2))
        base = out.get("baseline", {})
        if base.get("us_per_chain"):
            verdict["baseline_frac_roofline"] = base.get("frac_roofline")
            verdict["speedup_vs_baseline"] = base["us_per_chain"] / b["us_per_chain"]
        print(f"\nbest persistent: {best} at {100 * b['frac_roofline']:.1f}% of the roofline "
              f"(target 85%), stall cost {b.get('stall_cost_us')} us (target < 0.2)")
    res.update(variants=out, verdict=verdict, seconds=round(time.time() - t_start, 1))
    print(json.dumps(round_floats(res)))


def _row(name, r):
    def f(k, fmt):
        v = r.get(k)
        width = int(fmt.split(".")[0])
        return format(v, fmt) if isinstance(v, (int, float)) else "-".rjust(width)
    ok = "ERR" if "error" in r else ("yes" if r.get("correct") else "no")

    def worst(k):
        v = r.get(k)
        return format(max(v.values()), "8.1e") if isinstance(v, dict) else "-".rjust(8)
    pct = r.get("frac_roofline")
    pct = format(100 * pct, "6.1f") if isinstance(pct, float) else "-".rjust(6)
    return (f"{name:<12} {f('us_per_chain', '9.2f')} {f('gb_s', '7.0f')} {pct} "
            f"{f('stall_cost_us', '8.3f')} {worst('err_vs_ref')} {worst('err_vs_baseline')} "
            f"{ok:>3}  {r.get('error') or r.get('what', '')}")


if __name__ == "__main__":
    sys.exit(main())
