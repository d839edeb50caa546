"""kernels/_common.py: the plain-Python grid arithmetic equals Triton's helpers, PDL stays off
under the interpreter, every PDL kernel (decode and prefill) compiles for sm_90 with the PDL
instructions, and the kernels package imports only downwards (nothing from engine/app, no
cycles)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton

from tests.kernels.util import DEVICE, EPS, vec
from tritonchat.kernels._common import cdiv, launch_kw, next_pow2, pdl_mode
from tritonchat.kernels.gemv import gemv
from tritonchat.kernels.reference import gemv_ref


def test_cdiv_and_next_pow2_equal_tritons():
    for a in list(range(0, 2100)) + [248320, 2**31 - 1, 2**40 + 3]:
        for b in (1, 2, 3, 7, 16, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
        assert next_pow2(a) == triton.next_power_of_2(a), a


def test_pdl_switch_is_a_no_op_under_the_interpreter():
    assert pdl_mode(True, False, "cpu") == 0 and pdl_mode(True, True, "cpu") == 0
    assert launch_kw(pdl_mode(True, False, "cpu")) == {}
    g = torch.Generator().manual_seed(1)
    h, nw = vec(64, g), vec(64, g, 0.2)
    W = vec(16 * 64, g, 0.125).view(16, 64)
    out = torch.empty(16, device=DEVICE)
    gemv(h, W, out, norm_w=nw, eps=EPS, block_n=4, block_k=16)
    torch.testing.assert_close(out, gemv_ref(h, W, norm_w=nw, eps=EPS)[0],
                               rtol=2e-5, atol=2e-5)


_COMPILE_SCRIPT = textwrap.dedent("""
    import os
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
    import tritonchat.kernels.attention_decode as A
    import tritonchat.kernels.gemv as G
    import tritonchat.kernels.gdn_decode as C
    import tritonchat.kernels.sampling as S

    def build(fn, args, const, num_warps, pdl=True):
        sig = dict(args)
        sig.update({k: "constexpr" for k in const})
        src = ASTSource(fn=fn, signature=sig, constexprs=const)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=num_warps))
        ptx = k.asm["ptx"]
        if pdl:
            assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, fn
        assert len(k.asm["cubin"]) > 0, fn            # ptxas accepted the PTX
        return k

    gemv_args = dict(x_ptr="*bf16", z_ptr="*bf16", nw_ptr="*bf16", w_ptr="*bf16",
                     out_ptr="*bf16", res_ptr="*bf16", conv_state_ptr="*bf16",
                     conv_w_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32", N_OUT="i32",
                     K="i32", stride_w="i32", eps="fp32", K_PER_SPLIT="i32", CONV_DIM="i32")
    base = dict(DV=1, KW=4, BLOCK_X=1024, ONE_X=True, MASK_N=False, MASK_K=False, PDL=1)
    for pro, epi, split, bn, bk in ((1, 3, 1, 8, 512), (1, 2, 1, 4, 512), (1, 0, 2, 8, 512),
                                    (0, 1, 4, 4, 512)):
        build(G._gemv_kernel, gemv_args,
              dict(base, PRO=pro, EPI=epi, SPLIT_K=split, BLOCK_N=bn, BLOCK_K=bk), 4)
    gated_args = dict(gemv_args, nw_ptr="*fp32")
    build(G._gemv_kernel, gated_args,
          dict(base, PRO=2, EPI=1, DV=128, BLOCK_X=128, SPLIT_K=2, BLOCK_N=4, BLOCK_K=128), 4)
    core_args = dict(proj_ptr="*bf16", A_log_ptr="*fp32", dt_bias_ptr="*bf16",
                     state_ptr="*fp32", o_ptr="*bf16", q_scale="fp32", zw_ptr="*bf16",
                     zx_ptr="*bf16", znw_ptr="*bf16", z_ptr="*bf16", z_eps="fp32", HK="i32",
                     HV="i32", BA_OFF="i32", N_Z="i32")
    # without z programs, with them (first or last in the grid: the engine's launch)
    for bv, z_rows, z_first in ((16, 0, True), (32, 2048, True), (32, 2048, False)):
        build(C._gdn_decode_kernel, core_args,
              dict(DK=128, DV=128, GROUP=1, BLOCK_K=128, BLOCK_V=bv, L2_EPS=1e-6,
                   SP_THRESHOLD=20.0, PDL=True, Z_ROWS=z_rows, ZK=1024 if z_rows else 0,
                   BLOCK_ZN=8, BLOCK_ZK=1024 if z_rows else 1, Z_FIRST=z_first), 4)
    # the persistent direct form, with the trigger-at-start PDL mode (2)
    pers_args = dict(x_ptr="*bf16", z_ptr="*bf16", nw_ptr="*bf16", w_ptr="*bf16",
                     out_ptr="*bf16", res_ptr="*bf16", conv_state_ptr="*bf16",
                     conv_w_ptr="*bf16", ap_ptr="*fp32", pos_ptr="*i32", N_OUT="i32", K="i32",
                     stride_w="i32", eps="fp32", CONV_DIM="i32")
    for pro, epi, bn, bk, pdl in ((1, 3, 8, 1024, 2), (1, 2, 4, 1024, 1), (0, 1, 4, 4096, 1),
                                  (2, 1, 8, 2048, 1)):
        build(G._gemv_persistent_kernel,
              dict(pers_args, nw_ptr="*fp32") if pro == 2 else pers_args,
              dict(PRO=pro, EPI=epi, DV=128 if pro == 2 else 1, KW=4, NPROG=132, BLOCK_N=bn,
                   BLOCK_K=bk, MASK_K=bk == 4096, PDL=pdl, A_NS=1, A_BN=1, A_DEFER=0,
                   A_MERGE=1, A_GROUPS=False), 8)
    # the attention o_proj merging the split (or group) partials the attention left
    # (PRO_ATTN), and the attention launches that leave them
    for groups in (False, True):
        build(G._gemv_persistent_kernel, pers_args,
              dict(PRO=4, EPI=1, DV=256, KW=2, NPROG=128, BLOCK_N=8, BLOCK_K=2048, MASK_K=False,
                   PDL=1, A_NS=66, A_BN=64, A_DEFER=12, A_MERGE=8, A_GROUPS=groups), 8)
    attn_args = dict(qg_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", qn_w_ptr="*bf16",
                     kn_w_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", pos_ptr="*i32",
                     part_ptr="*fp32", cnt_ptr="*i32", out_ptr="*bf16", max_ctx="i32",
                     eps="fp32", qk_scale_log2="fp32", freq_log2_step="fp32")
    for groups in (False, True):
        build(A._attn_decode_kernel, attn_args,
              dict(HD=256, ROT=64, GROUP=4, NUM_SPLITS=66, NUM_HEADS=8, BLOCK_H=16, BLOCK_G=4,
                   BLOCK_D=256, BLOCK_N=64, MERGE=8, MERGE_TOP=16,
                   ONE_LEVEL=0 if groups else 32, DEFER=12, DEFER_GROUPS=groups,
                   DOT_PRECISION=None, PDL=1), 8)
    # the step's last kernel: argmax of the keys + token count + position advance
    build(S._argmax_keys_kernel, dict(part_ptr="*i64", n="i32", token_ptr="*i64",
                                      counts_ptr="*i32", row_offset="i32", pos_ptr="*i32",
                                      ring_ptr="*i64"),
          dict(BLOCK=16384, COUNT=True, ADVANCE=True, RING=4, PDL=2), 16)
    lm_args = dict(h_ptr="*bf16", nw_ptr="*bf16", e_ptr="*bf16", logits_ptr="*fp32",
                   part_ptr="*i64", V="i32", VALID="i32", K="i32", stride_e="i32", eps="fp32")
    build(S._lm_head_kernel, lm_args,
          dict(PRO=1, BLOCK_N=8, BLOCK_K=512, BLOCK_X=1024, ONE_X=True, MASK_N=False,
               MASK_K=False, PDL=True), 4)
    # the persistent LM head (the table's plan): whole rows, 3 pipeline stages
    build(S._lm_head_persistent_kernel, dict(lm_args, NB="i32"),
          dict(PRO=1, BLOCK_N=16, BLOCK_K=1024, MASK_N=False, MASK_K=False, STAGES=3,
               EVICT=False, PDL=True), 8)
    # the sampler's merge levels (bitonic top-k of sorted runs) at the engine's plans for 64
    # candidates (top-k 20) and 256 (top-p alone); the sampler launches without PDL
    for kc, chunk in ((64, 1024), (256, 2048)):
        build(S._topk_merge_kernel, dict(in_ptr="*i64", n_in="i32", out_ptr="*i64",
                                         params_ptr="*fp32"), dict(KC=kc, CHUNK=chunk), 8,
              pdl=False)

    # the prefill kernels (pdl 1), at the true shapes and the packaged table's forms: every
    # argument not named here is a bf16 pointer (*_ptr) or an i32 (eps / scale: fp32)
    import tritonchat.kernels.flash_attention as FA
    import tritonchat.kernels.gdn_chunk as GC
    import tritonchat.kernels.gemm as GM
    import tritonchat.kernels.rms_norm as RN

    def prefill(fn, types, const, num_warps, num_stages=3):
        args = {n: types.get(n, "*bf16" if n.endswith("_ptr") else
                             "fp32" if n in ("eps", "scale", "qk_scale") else "i32")
                for n in fn.arg_names if n not in const}
        sig = dict(args, **{k: "constexpr" for k in const})
        src = ASTSource(fn=fn, signature=sig, constexprs=const)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 64),
                           options=dict(num_warps=num_warps, num_stages=num_stages))
        ptx = k.asm["ptx"]
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, fn
        assert len(k.asm["cubin"]) > 0, fn

    prefill(RN._rms_norm_kernel, {}, dict(BLOCK_D=1024, PDL=1), 4)
    tiles = dict(EVEN_K=True, GROUP_M=8, DOT_PREC="tf32", PDL=1)
    prefill(GM._gemm_kernel, {}, dict(tiles, HAS_RESIDUAL=False, SILU_MUL=True, BLOCK_M=64,
                                       BLOCK_N=64, BLOCK_K=64), 4, 4)
    for bn, silu, res, split in ((256, False, False, 1), (128, True, False, 1), (128, False, True, 2)):
        d = lambda r, c: f"tensordesc<bf16[{r}, {c}]>"
        o = d(128, bn) if split == 1 else "*bf16"
        prefill(GM._gemm_persistent_kernel,
                dict(x=d(128, 64), w=d(bn, 64), out=o, res=o, ws="*fp32", w_mem="*bf16"),
                dict(tiles, HAS_RESIDUAL=res, SILU_MUL=silu, USE_TMA=True, TMA_OUT=split == 1,
                     SPLIT_K=split, BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, FLATTEN=bn == 256,
                     WARP_SPEC=False), 8)
    prefill(GM._gemm_splitk_reduce_kernel, dict(ws="*fp32"),
            dict(HAS_RESIDUAL=True, SILU_MUL=False, SPLIT_K=2, BLOCK_M=32, BLOCK_N=128, PDL=1), 4)
    gdn = dict(a_log_ptr="*fp32", t_ptr="*i32", gam_ptr="*fp32", state_ptr="*fp32")
    heads = dict(HK=16, GROUP=1, DK=128, DV=128, DKP=128, DVP=128, CHUNK=64, DOT_PREC="tf32", PDL=1)
    conv = dict(KC=4, KM1P=4, T_DEV=True)
    prefill(GC._gdn_chunk_prepare_kernel, gdn, dict(heads, BC=16, SOLVE=1, WU_ACT=True, **conv), 8)
    state = dict(DK=128, DV=128, DKP=128, DVP=128, CHUNK=64, BV=16, DOT_PREC="tf32", PDL=1)
    prefill(GC._gdn_chunk_state_kernel, gdn, state, 4, 2)
    prefill(GC._gdn_chunk_output_kernel, gdn, dict(heads, **conv), 8)
    prefill(FA._kv_cache_write_kernel, dict(inv_freq_ptr="*fp32", start_pos="*i32"),
            dict(HD=256, HDP=256, ROT=64, BLOCK_T=16, START_PTR=True, PDL=1), 4)
    for kv in ("*bf16", "tensordesc<bf16[64, 256]>"):
        prefill(FA._attention_prefill_kernel, dict(k_src=kv, v_src=kv, start_pos="*i32"),
                dict(GROUP=4, GROUP_P=4, TOK=8, HD=256, HDP=256, ROT=64, BLOCK_N=64, PRO_ROWS=16,
                     KV_DESC=kv != "*bf16", WARP_SPEC=False, DOT_PREC="tf32", START_PTR=True,
                     PDL=1), 8, 2)
    print("OK")
""")


@pytest.mark.slow
def test_pdl_kernels_compile_for_sm90():
    """Offline PTX + cubin for sm_90 (no GPU needed), the PDL instructions present."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True,
                       env=env, timeout=600)
    if r.returncode != 0 and ("ptxas" in r.stderr and "not found" in r.stderr.lower()):
        pytest.skip("no ptxas for an offline sm_90 compile")
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]

