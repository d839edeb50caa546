"""Prefill for the Triton backend: a prompt of T tokens through the model with our prefill kernels
(tensor-core GEMMs with fused epilogues, the chunked gated delta rule with its causal conv1d,
flash attention), filling the KV cache and the GDN states that the decode step continues from.
A GDN layer is gemm -> gdn_prefill (conv, recurrence, gated norm, both states) -> gemm.

Long prompts run in chunks of PREFILL_CHUNK tokens (every kernel continues from the state the
previous chunk left), which bounds the activation memory; buffers are allocated per call.
`backend.prefill_kernels = False` switches to the PyTorch reference model on the same device,
over views of the same merged weights and the same state tensors.

Prefill CUDA graphs (`EngineOptions.prefill_graph`, on by default on CUDA): up to ~230 kernel
launches make a short prompt's prefill cost the host 9-16 ms, more than the GPU work. A prompt
of up to GRAPH_MAX_T tokens instead runs padded to a bucket length B (a multiple of 64, of 256
past 1,024) as one captured graph per bucket, replayed for every later prompt of that bucket,
whatever its length and its start position. The padding is made inert: pad rows read token 0;
the GDN kernels read the real row count from the device and treat the rows past it as inert
(beta = g = 0, so the recurrent state passes through them unchanged; the conv state takes the
last real inputs); attention is causal (real rows never see the pads, whose K/V land past the
new length and are overwritten later), and the first position is read from the device. The first
prompt of a bucket runs the padded path eagerly (compiling what it needs) and then captures it.

Every prefill kernel is launched with the backend's programmatic dependent launch mode
(`be._pdl`, the decode step's): it is resident and has its weights on the way while the previous
kernel drains, and waits for it before touching an activation (kernels/_common.py). Before its
wait a kernel reads only weights and writes nothing, so the early trigger (mode 2) is safe too:
each wait covers the whole chain before it. A graph is captured per (bucket, PDL mode), so
switching PDL never replays a graph of the other mode.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .graph import no_collection

PREFILL_CHUNK = 8192
GRAPH_MAX_T = 2048


def graph_bucket(T: int) -> Optional[int]:
    """The padded length a T-token prompt replays at, or None (too long for a graph)."""
    if T <= 0 or T > GRAPH_MAX_T:
        return None
    step = 64 if T <= 1024 else 256
    return -(-T // step) * step


class PrefillGraphs:
    """One captured prefill per bucket length and PDL mode, sharing one memory pool (replays
    never overlap, and every result is copied into `out`, outside the pool)."""

    def __init__(self, be):
        # a weak reference: the backend holds this object, and a cycle would leave a dead backend
        # (its graphs, their pool) to the garbage collector, at any later time
        self._be = weakref.ref(be)
        dev = be.device
        self.ids = torch.zeros(GRAPH_MAX_T, dtype=torch.long, device=dev)
        self.t = torch.zeros(1, dtype=torch.int32, device=dev)
        self.start = torch.zeros(1, dtype=torch.int32, device=dev)
        self.out = torch.zeros(be.cfg.hidden_size, dtype=be.dtype, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}     # (bucket, be._pdl)
        self.pool = None
        self.failed = False

    def run(self, ids: torch.Tensor, start: int) -> Optional[torch.Tensor]:
        """The last token's residual stream (states updated), or None where the graph path does
        not apply (too long, too close to the end of the context, capture failed before)."""
        be = self._be()
        T = ids.numel()
        B = graph_bucket(T)
        if B is None or self.failed or start + B > be.options.max_context:
            return None
        self.ids[:T].copy_(ids)
        self.ids[T:B].zero_()                       # pads read token 0
        self.t.fill_(T)
        self.start.fill_(start)
        key = (B, be._pdl)
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
            return self.out
        self.out.copy_(padded_prefill(be, self.ids[:B], self.start, self.t))
        if be.device.type == "cuda":
            try:
                g = torch.cuda.CUDAGraph()
                with no_collection(), torch.cuda.graph(g, pool=self.pool):
                    self.out.copy_(padded_prefill(be, self.ids[:B], self.start, self.t))
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[key] = g
            except Exception:  # noqa: BLE001 - a capture failure leaves the eager path
                self.failed = True
        return self.out


def padded_prefill(be, ids: torch.Tensor, start: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Prefill of the first t[0] of ids (padded to len(ids) rows with inert tokens) at the
    first position start[0]; no host reads of device values, so it can be captured."""
    return _prefill_chunk(be, ids, start, t_dev=t)


def prefill_hidden(backend, ids: torch.Tensor) -> torch.Tensor:
    """Residual stream of the last prompt token (before the final norm); states updated."""
    if not getattr(backend, "prefill_kernels", True):
        return backend.reference.forward_hidden(ids, backend.state.length, backend.state)
    start = backend.state.length
    if getattr(backend, "prefill_graph", False):
        graphs = getattr(backend, "_prefill_graphs", None)
        if graphs is None:
            graphs = backend._prefill_graphs = PrefillGraphs(backend)
        h = graphs.run(ids, start)
        if h is not None:
            return h
    h_last = None
    for s in range(0, ids.numel(), PREFILL_CHUNK):
        h_last = _prefill_chunk(backend, ids[s:s + PREFILL_CHUNK], start + s)
    return h_last


def _prefill_chunk(be, ids: torch.Tensor, start, t_dev: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ids [T] at positions start.. (an int, or a device int32 with t_dev: then only the first
    t_dev[0] rows are real and the rest is inert padding, see the module docstring)."""
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
    gdn_proj = new(T, cd + 2 * Hv + vd) if cfg.linear_attention_layers else None   # [qkv | b | a | z]
    gdn_out = new(T, vd) if gdn_proj is not None else None
    attn_proj = new(T, 2 * H * hd + 2 * KV * hd) if cfg.full_attention_layers else None
    attn_out = new(T, H * hd) if attn_proj is not None else None

    pdl = be._pdl       # every launch waits for the previous one before touching activations
    embedding_gather(ids, be.embed, h, pdl=pdl)
    for i, L in enumerate(be.layers):
        rms_norm(h, L.input_norm, eps, x, pdl=pdl)
        m = L.mixer
        if L.kind == "full_attention":
            q_n, kv_n = 2 * H * hd, KV * hd
            gemm(x, m.qkv, attn_proj, pdl=pdl)
            kc, vc = be.state.kv[i]
            attention_prefill(attn_proj[:, :q_n], attn_proj[:, q_n:q_n + kv_n], attn_proj[:, q_n + kv_n:],
                              m.q_norm, m.k_norm, kc, vc, start, attn_out, num_heads=H, num_kv_heads=KV,
                              head_dim=hd, rotary_dim=cfg.rotary_dim, rope_theta=cfg.rope_theta, eps=eps,
                              pdl=pdl)
            gemm(attn_out, m.o_proj, h, residual=h, pdl=pdl)
        else:
            gemm(x, m.qkvbaz, gdn_proj, pdl=pdl)
            gdn_prefill(gdn_proj[:, :cd], gdn_proj[:, cd + 2 * Hv:], gdn_proj[:, cd:cd + Hv],
                        gdn_proj[:, cd + Hv:cd + 2 * Hv], m.conv_w, be.state.conv[i], m.A_log, m.dt_bias,
                        be.state.rec[i], m.norm_w, gdn_out, num_k_heads=cfg.linear_num_key_heads,
                        num_v_heads=Hv, head_k_dim=cfg.linear_key_head_dim,
                        head_v_dim=cfg.linear_value_head_dim, eps=eps, t_dev=t_dev, pdl=pdl)
            gemm(gdn_out, m.out_proj, h, residual=h, pdl=pdl)
        rms_norm(h, L.post_norm, eps, x, pdl=pdl)
        gemm(x, L.gate_up, act, silu_mul=True, pdl=pdl)
        gemm(act, L.down, h, residual=h, pdl=pdl)
    if t_dev is not None:
        return h.index_select(0, t_dev.long() - 1)[0]
    return h[-1]
