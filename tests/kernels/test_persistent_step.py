"""kernels/persistent_step.py without a GPU: its plan (the grid, tiles that fit two programs an SM,
what split-K means there) and an offline sm_90 compile of the persistent kernel at the true
shape (registers and shared memory: the grid must be co-resident). The step's numbers against
the per-operator step and the reference engine: tests/engine/test_persistent_step.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tritonchat.kernels import persistent_step as K
from tritonchat.kernels._common import cdiv, next_pow2

TRUE = dict(D=1024, I=3584, V=248320, HK=16, HV=16, DK=128, DV=128, KW=4, H=8, KV=2, HD=256, ROT=64)
ODD = dict(D=80, I=72, V=512, HK=2, HV=4, DK=24, DV=40, KW=4, H=2, KV=1, HD=48, ROT=12)


@pytest.mark.parametrize("dims", [TRUE, ODD])
@pytest.mark.parametrize("sm_count", [1, 3, 132])
def test_plan_split_k_and_tiles(dims, sm_count):
    """Row-only narrow projections without split-K; with it, K-splits until every program has
    two tasks (MAX_SPLIT at most), each split holding whole value heads for the gated norm;
    tiles of about TILE weights; power-of-two sizes; the attention's K/V tile within 8K
    elements and no more splits than the context has tiles."""
    off = K.step_plan(dims, sm_count=sm_count, max_context=4096, split_k=False)
    on = K.step_plan(dims, sm_count=sm_count, max_context=4096, split_k=True)
    G = on["grid"]
    assert G == off["grid"] == sm_count * K.PROGRAMS_PER_SM
    assert off["KS_O"] == off["KS_AO"] == off["KS_D"] == 1
    for bn, ks, kp in (("BN_O", "KS_O", next_pow2(dims["HV"]) * next_pow2(dims["DV"])),
                       ("BN_AO", "KS_AO", next_pow2(dims["H"] * dims["HD"])),
                       ("BN_D", "KS_D", next_pow2(dims["I"]))):
        n_tasks = cdiv(dims["D"], on[bn]) * on[ks]
        assert on[ks] & (on[ks] - 1) == 0 and 1 <= on[ks] <= K.MAX_SPLIT
        assert n_tasks >= 2 * G or on[ks] == K.MAX_SPLIT or kp // (2 * on[ks]) < 16 or (
            ks == "KS_O" and on[ks] == next_pow2(dims["HV"]))
        assert on[bn] * kp <= max(K.TILE, kp)
    assert next_pow2(dims["HV"]) * next_pow2(dims["DV"]) // on["KS_O"] >= next_pow2(dims["DV"])
    assert on["BLOCK_N"] * next_pow2(dims["HD"]) <= 8192
    assert 1 <= on["NS"] <= max(1, cdiv(4096, on["BLOCK_N"]))
    for k in ("BN_E", "BN_IN", "BN_Z", "BV", "BN_QKV", "BN_GU", "BN_LM", "BDM", "ARG_BLOCK"):
        assert on[k] >= 1 and on[k] & (on[k] - 1) == 0, k
    sc = K.scratch_sizes(dims, on)
    assert sc["keys"] == G and sc["kpart"] >= on["KS_D"] * dims["D"]
    assert sc["part"] == dims["H"] * on["NS"] * (dims["HD"] + 2)


def test_plan_overrides():
    p = K.step_plan(TRUE, sm_count=132, max_context=32768, split_k=True,
                    overrides=dict(programs_per_sm=1, BN_LM=16, num_warps=8))
    assert p["grid"] == 132 and p["programs_per_sm"] == 1 and p["BN_LM"] == 16 and p["num_warps"] == 8


_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tritonchat.kernels import persistent_step as K
dims, phase = json.loads(sys.argv[1]), int(sys.argv[2])
plan = K.step_plan(dims, sm_count=132, max_context=32768, split_k=True)
ppsm = plan.pop("programs_per_sm"); plan.pop("grid"); nw = plan.pop("num_warps")
bf, f32, i32, i64 = "*bf16", "*fp32", "*i32", "*i64"
sig = dict(h_ptr=bf, proj_ptr=bf, z_ptr=bf, o_ptr=bf, qg_ptr=bf, part_ptr=f32, attn_ptr=bf,
           act_ptr=bf, logits_ptr=f32, keys_ptr=i64, kpart_ptr=f32, tick_ptr=i32, tok_ptr=i64,
           pos_ptr=i32, ring_ptr=i64, counts_ptr=i32, emb_ptr=bf, fn_ptr=f32, lm_ptr=bf,
           lw_ptr=i64, sp_ptr=f32, kind_ptr=i32, q0_ptr=i32, cnt_ptr=i32, epoch_ptr=i32,
           err_ptr=i32, stamp_ptr=i64, stall_rec_ptr=i64, phase_layer="i32", G="i32", q_lm="i32",
           eps="fp32", q_scale="fp32", qk_scale_log2="fp32", freq_log2_step="fp32", max_ctx="i32",
           valid_vocab="i32", row_offset="i32", stall_op="i32", stall_ns="i64", timeout_ns="i64",
           n_stamp="i32")
const = dict(NL=24, **dims, SP=2 * dims["D"] + max(2 * dims["HV"] + dims["DV"], 2 * dims["HD"]),
             **plan, PHASE=phase, SAMPLED=False, ADVANCE=True, RING=8, ALIGN=True,
             DOT_PRECISION=None, SPIN=0, STALL=False, STAMP=True)
s = dict(sig)
s.update({k: "constexpr" for k in const})
attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t.startswith("*")}
k = triton.compile(ASTSource(fn=K._step_kernel, signature=s, constexprs=const, attrs=attrs),
                   target=GPUTarget("cuda", 90, 64), options=dict(num_warps=nw))
ptx = k.asm["ptx"]
out = dict(shared=int(k.metadata.shared), num_warps=nw, programs_per_sm=ppsm,
           acquire=ptx.count(".acquire"), globaltimer=ptx.count("%globaltimer"))
try:
    sys.path.insert(0, sys.argv[3])
    from _bench_util import ptxas_regs
    out.update(ptxas_regs(ptx))
except Exception as e:
    out["ptxas"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.parametrize("phase", [K.PERSISTENT, K.OP_LM_HEAD])
def test_kernel_compiles_for_sm90_and_fits_two_programs_an_sm(phase):
    """Offline sm_90 compile (no GPU) at the true shape with the default plan: the persistent
    kernel (spin waits, stamps) and the head's phase launch; the shared memory of
    PROGRAMS_PER_SM programs fits an H100/H200 SM (228 KB), and so do their registers."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p])
    r = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(TRUE), str(phase),
                        str(root / "benchmarks")], capture_output=True, text=True, env=env,
                       timeout=900)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("no ptxas for an offline sm_90 compile")
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    print(info)
    ppsm = info["programs_per_sm"]
    assert ppsm * (info["shared"] + 1024) <= 233472
    if phase == K.PERSISTENT:
        assert info["acquire"] > 0 and info["globaltimer"] > 0
    if "regs" in info:
        per_warp = cdiv(info["regs"] * 32, 256) * 256
        assert (65536 // per_warp) // info["num_warps"] >= ppsm
