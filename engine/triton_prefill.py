"""Prefill for the Triton backend: a prompt of T tokens through the model with our prefill kernels
(tensor-core GEMMs with fused epilogues, causal conv1d, chunked gated delta rule, flash
attention), filling the KV cache and the GDN states that the decode step continues from.

Long prompts run in chunks of PREFILL_CHUNK tokens (every kernel continues from the state the
previous chunk left), which bounds the activation memory; buffers are allocated per call (prefill
is not graph-captured). `backend.prefill_kernels = False` switches to the PyTorch reference
model on the same device, over views of the same merged weights and the same state tensors.
"""
from __future__ import annotations

import torch

PREFILL_CHUNK = 8192


def prefill_hidden(backend, ids: torch.Tensor) -> torch.Tensor:
    """Residual stream of the last prompt token (before the final norm); states updated."""
    if not getattr(backend, "prefill_kernels", True):
        return backend.reference.forward_hidden(ids, backend.state.length, backend.state)
    start = backend.state.length
    h_last = None
    for s in range(0, ids.numel(), PREFILL_CHUNK):
        h_last = _prefill_chunk(backend, ids[s:s + PREFILL_CHUNK], start + s)
    return h_last


def _prefill_chunk(be, ids: torch.Tensor, start: int) -> torch.Tensor:
    from tritonchat.kernels.conv1d import causal_conv1d
    from tritonchat.kernels.embedding import embedding_gather
    from tritonchat.kernels.flash_attention import attention_prefill
    from tritonchat.kernels.gdn_chunk import gdn_prefill
    from tritonchat.kernels.gemm import gemm
    from tritonchat.kernels.rms_norm import rms_norm

    cfg, dev, dt = be.cfg, be.device, be.dtype
    T = ids.numel()
    D, I = cfg.hidden_size, cfg.intermediate_size
    H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    Hv, vd, cd = cfg.linear_num_value_heads, cfg.linear_value_dim, cfg.conv_dim
    eps = cfg.rms_norm_eps
    new = lambda *s: torch.empty(*s, device=dev, dtype=dt)  # noqa: E731
    h, x, act = new(T, D), new(T, D), new(T, I)
    gdn_proj = new(T, cd + vd + 2 * Hv) if cfg.linear_attention_layers else None
    conv_out = new(T, cd) if gdn_proj is not None else None
    gdn_out = new(T, vd) if gdn_proj is not None else None
    attn_proj = new(T, 2 * H * hd + 2 * KV * hd) if cfg.full_attention_layers else None
    attn_out = new(T, H * hd) if attn_proj is not None else None

    embedding_gather(ids, be.embed, h)
    for i, L in enumerate(be.layers):
        rms_norm(h, L.input_norm, eps, x)
        m = L.mixer
        if L.kind == "full_attention":
            q_n, kv_n = 2 * H * hd, KV * hd
            gemm(x, m.qkv, attn_proj)
            kc, vc = be.state.kv[i]
            attention_prefill(attn_proj[:, :q_n], attn_proj[:, q_n:q_n + kv_n], attn_proj[:, q_n + kv_n:],
                              m.q_norm, m.k_norm, kc, vc, start, attn_out, num_heads=H, num_kv_heads=KV,
                              head_dim=hd, rotary_dim=cfg.rotary_dim, rope_theta=cfg.rope_theta, eps=eps)
            gemm(attn_out, m.o_proj, h, residual=h)
        else:
            gemm(x, m.qkvzba, gdn_proj)
            causal_conv1d(gdn_proj[:, :cd], m.conv_w, be.state.conv[i], conv_out)
            gdn_prefill(conv_out, gdn_proj[:, cd:cd + vd], gdn_proj[:, cd + vd:cd + vd + Hv],
                        gdn_proj[:, cd + vd + Hv:], m.A_log, m.dt_bias, be.state.rec[i], m.norm_w, gdn_out,
                        num_k_heads=cfg.linear_num_key_heads, num_v_heads=Hv,
                        head_k_dim=cfg.linear_key_head_dim, head_v_dim=cfg.linear_value_head_dim, eps=eps)
            gemm(gdn_out, m.out_proj, h, residual=h)
        rms_norm(h, L.post_norm, eps, x)
        gemm(x, L.gate_up, act, silu_mul=True)
        gemm(act, L.down, h, residual=h)
    return h[-1]
