"""The Triton backend: every decode operator is one of our kernels (tritonchat.kernels).

Everything is allocated once at load: the merged weights, the static KV cache, the GDN conv and
recurrent states, every activation buffer, split-K partials and sampler scratch. One decode step
(`_decode_step`) allocates nothing and reads the token id and position from device tensors, so it
is captured once into a CUDA graph and replayed until the context is full (engine/graph.py).
Where the decode table gives a GEMV or the attention other plans for a range of positions
(`context_ranges`: short contexts for the q|k|v GEMV, long ones for the attention's split-KV
launch), there is one plan set and one graph per range of positions, all captured together, and
each step runs the range of its position (the host knows it).

Load-time merges (fewer, fatter GEMVs): GDN in_proj_qkv|in_proj_b|in_proj_a|in_proj_z -> one
matrix (decode: the in_proj GEMV reads the first three, the GDN core's launch the z rows);
attention q_proj|k_proj|v_proj -> one; MLP gate_proj|up_proj -> one (SiLU*mul epilogue).
The reference model keeps working on views into the merged matrices (used for prefill until the
Triton prefill kernels take over, and as a cross-check).
"""
from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .options import EngineOptions, SamplingParams, check_switches
from .backend import Backend
from .config import FULL_ATTENTION, TextConfig
from .errors import BackendUnavailableError, ContextFullError
from .graph import capture as capture_graph
from .graph import replay_or_capture
from .reference import ModelState, ReferenceModel, torch_dtype

# The GPU sampler searches top-p / min-p within the TOP_K_MAX most likely tokens (top-k larger
# than this is clamped); greedy and plain temperature sampling are exact over the whole vocab.
# With top-k set it searches 2 x top_k candidates (at least 32; sampling.sample_candidates).
TOP_K_MAX = 256
TOP_K_MAX_INTERPRETER = 64   # the interpreter (CPU tests) sorts slowly: a smaller candidate cap
TOKEN_RING = 4               # decode steps whose tokens the host can have outstanding (ring slots)


@dataclass
class _Readback:
    """What brings one backend's decode tokens to the host: a side stream, a pinned buffer of
    TOKEN_RING slots, an event per slot when its step is done and when its copy is. Freed with
    its backend (which no reference cycle keeps alive, and graph captures run with the cyclic
    collector off: no collection makes CUDA calls inside a capture)."""
    stream: "torch.cuda.Stream"
    host: torch.Tensor
    step_done: list
    copied: list

    @classmethod
    def on(cls, dev: torch.device) -> "_Readback":
        host = torch.zeros(TOKEN_RING, dtype=torch.int64, pin_memory=True)
        return cls(torch.cuda.Stream(dev), host, [torch.cuda.Event() for _ in range(TOKEN_RING)],
                   [torch.cuda.Event() for _ in range(TOKEN_RING)])


@dataclass
class _GdnLayer:
    qkvbaz: torch.Tensor      # [conv_dim + 2*Hv + value_dim, D]: in_proj_qkv|b|a|z (prefill GEMM)
    qkvba: torch.Tensor       # its first conv_dim + 2*Hv rows (the decode in_proj GEMV)
    z_w: torch.Tensor         # its last value_dim rows, in_proj_z (the decode GDN core's launch)
    conv_w: torch.Tensor      # [conv_dim, Kc]
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_w: torch.Tensor
    out_proj: torch.Tensor


@dataclass
class _AttnLayer:
    qkv: torch.Tensor         # [2*H*hd + 2*KV*hd, D]: q|gate interleaved per head, then k, then v
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor


@dataclass
class _Layer:
    kind: str
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor     # [2I, D]
    down: torch.Tensor        # [D, I]
    mixer: object


@dataclass
class _Timer:
    """Per-kernel GPU time of eager steps, by CUDA events (only while timing is on)."""
    events: list = field(default_factory=list)     # (name, nbytes, start, end) of the current step
    totals: dict = field(default_factory=dict)     # name -> [launches, seconds, bytes]
    steps: int = 0
    step_seconds: float = 0.0


def context_ranges(base: dict, range_plans: dict) -> list[tuple[Optional[int], dict]]:
    """[(below, plans)] for positions [previous below or 0, below), the last (None, plans) for
    every position past them. range_plans is {key: [(from, below, plan)]} (below None: to the
    end); each range's plans are `base` with, for each key, the plan of its first range that
    holds the range's start (base.get(key) where none does). A last range that no key's range
    reaches is `base` itself."""
    bounds = sorted({b for rps in range_plans.values() for lo, hi, _ in rps
                     for b in (lo, hi) if b})
    out: list[tuple[Optional[int], dict]] = []
    for i, lo in enumerate([0] + bounds):
        below = bounds[i] if i < len(bounds) else None
        picked = {key: next((p for a, b, p in rps if a <= lo and (b is None or lo < b)), None)
                  for key, rps in range_plans.items()}
        if below is None and all(p is None for p in picked.values()):
            out.append((None, base))
            break
        plans = dict(base)
        plans.update({key: p if p is not None else base.get(key) for key, p in picked.items()})
        out.append((below, plans))
    return out


class TritonBackend(Backend):
    name = "triton"

    def __init__(self, cfg: TextConfig, weights: dict[str, torch.Tensor], options: EngineOptions,
                 valid_vocab: Optional[int] = None, progress: Optional[Callable[[str, float], None]] = None):
        import os

        self.cfg = cfg
        self.options = options
        self._apply_pdl()
        self.device = torch.device(options.device)
        if self.device.type != "cuda":
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise BackendUnavailableError(
                    "The Triton backend needs a CUDA GPU; on the CPU it runs only under the Triton "
                    "interpreter (set TRITON_INTERPRET=1, slow) -- use --backend reference.")
        self.dtype = torch_dtype(options.dtype)
        self.valid_vocab = min(valid_vocab or cfg.vocab_size, cfg.vocab_size)
        self._progress = progress
        self._pack_weights(weights)
        self._allocate(options.max_context)
        self._gdn_block_v = None                  # from the tuned table (gdn_decode default)
        self._graph = None                        # the decode graph last replayed
        self._graphs: Optional[list] = None       # one captured decode step per context range
        self._timed_graphs: Optional[list] = None  # the same with timing events: (graph, events)
        self._timed_graph_failed = False
        # eager decode (graph off): each context range's recorded launches, replayed from the
        # host (engine/launch_replay.py); a range records at its second eager step (its first
        # compiles the kernels); a refused recording turns the option off, with the reason
        self._drop_replays()
        self.launch_cache_error: Optional[str] = None
        self._context_ranges = bool(options.context_ranges)   # the table's per-range plans in use
        self._set_split_k(options.split_k)
        self._timer: Optional[_Timer] = None
        self._timing_interval_s = 0.5
        self._last_timed = 0.0
        self._l2_error: Optional[str] = None     # why the GDN states cannot persist in L2
        self._l2_limit = 0                       # the L2 set aside for them now (bytes)
        self.l2_state_nodes = 0                  # kernel nodes of the last graph with the window
        # prompts up to 2,048 tokens replay a captured prefill per bucket length (CUDA)
        self.prefill_graph = options.prefill_graph and self.device.type == "cuda"
        self._sampling_key = None
        self._sample_kc = None               # the sampler's candidate count (sample_candidates)
        self._mode_params: Optional[SamplingParams] = None   # the settings the two above follow
        self._params = SamplingParams()
        self._pending_head = False          # prefill done, final norm + LM head not yet run
        self._last_token: Optional[int] = None   # the token in tok_buf, when the host knows it
        # positions of the decode steps launched and not yet finished (finish_step pops them)
        self._inflight: deque[int] = deque()
        if self.device.type == "cuda":
            self._readback = _Readback.on(self.device)
        if options.timing:
            self.configure(timing=True)

    # ------------------------------------------------------------------------ loading ----
    def _pack_weights(self, w: dict[str, torch.Tensor]) -> None:
        cfg = self.cfg
        views: dict[str, torch.Tensor] = {}
        self.layers: list[_Layer] = []
        for i, kind in enumerate(cfg.layer_types):
            p = f"layers.{i}."
            gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]).contiguous()
            I = cfg.intermediate_size
            views[p + "mlp.gate_proj.weight"], views[p + "mlp.up_proj.weight"] = gate_up[:I], gate_up[I:]
            views[p + "mlp.down_proj.weight"] = w[p + "mlp.down_proj.weight"]
            for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                views[p + n] = w[p + n]
            if kind == FULL_ATTENTION:
                a = p + "self_attn."
                parts = [w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]
                qkv = torch.cat(parts).contiguous()
                o = 0
                for name, t in zip(("q_proj.weight", "k_proj.weight", "v_proj.weight"), parts):
                    views[a + name] = qkv[o:o + t.shape[0]]
                    o += t.shape[0]
                for n in ("q_norm.weight", "k_norm.weight", "o_proj.weight"):
                    views[a + n] = w[a + n]
                mixer = _AttnLayer(qkv, w[a + "q_norm.weight"], w[a + "k_norm.weight"], w[a + "o_proj.weight"])
            else:
                g = p + "linear_attn."
                names = ("in_proj_qkv.weight", "in_proj_b.weight", "in_proj_a.weight", "in_proj_z.weight")
                parts = [w[g + n] for n in names]
                merged = torch.cat(parts).contiguous()
                o = 0
                for name, t in zip(names, parts):
                    views[g + name] = merged[o:o + t.shape[0]]
                    o += t.shape[0]
                conv_w = w[g + "conv1d.weight"].reshape(cfg.conv_dim, cfg.linear_conv_kernel_dim).contiguous()
                views[g + "conv1d.weight"] = conv_w.view(cfg.conv_dim, 1, -1)
                for n in ("A_log", "dt_bias", "norm.weight", "out_proj.weight"):
                    views[g + n] = w[g + n]
                n_ba = cfg.conv_dim + 2 * cfg.linear_num_value_heads
                mixer = _GdnLayer(merged, merged[:n_ba], merged[n_ba:], conv_w, w[g + "A_log"],
                                  w[g + "dt_bias"].contiguous(),
                                  w[g + "norm.weight"].contiguous(), w[g + "out_proj.weight"])
            self.layers.append(_Layer(kind, w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"],
                                      gate_up, w[p + "mlp.down_proj.weight"], mixer))
            for k in [k for k in w if k.startswith(p)]:
                del w[k]                       # free the unmerged copies layer by layer
            if self._progress:
                self._progress("weights", (i + 1) / len(cfg.layer_types))
        self.embed = w["embed_tokens.weight"]
        self.lm_head_w = w["lm_head.weight"]
        self.final_norm = w["norm.weight"]
        views.update({"embed_tokens.weight": self.embed, "lm_head.weight": self.lm_head_w, "norm.weight": self.final_norm})
        self.reference = ReferenceModel(self.cfg, views)

    def _allocate(self, max_context: int) -> None:
        cfg, dev, dt = self.cfg, self.device, self.dtype
        self._prefill_graphs = None           # captured over the state tensors replaced here
        self.options.max_context = int(max_context)
        self.state = ModelState(cfg, max_context, dev, dt)
        D, I = cfg.hidden_size, cfg.intermediate_size
        H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        z = lambda *s, dtype=dt: torch.zeros(*s, device=dev, dtype=dtype)  # noqa: E731
        self.tok_buf = torch.zeros(1, device=dev, dtype=torch.int64)
        self.pos_buf = torch.zeros(1, device=dev, dtype=torch.int32)
        # each decode step also writes its token to tok_ring[position % TOKEN_RING]: the host
        # reads it there (copied on a side stream) while the next step is already running
        self.tok_ring = torch.full((TOKEN_RING,), -1, device=dev, dtype=torch.int64)
        self.h = z(D)                                          # residual stream
        self.gdn_proj = z(cfg.conv_dim + 2 * cfg.linear_num_value_heads)   # [q|k|v conv out | b | a]
        self.gdn_z = z(cfg.linear_value_dim)                                 # written by the core's launch
        self.gdn_out = z(cfg.linear_value_dim)
        self.attn_proj = z(2 * H * hd + 2 * KV * hd)
        self.attn_out = z(H * hd)
        self.act = z(I)
        self.logits_buf = z(cfg.vocab_size, dtype=torch.float32)
        from tritonchat.kernels import attention_decode as ad
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
        self.attn_splits = ad.plan_num_splits(max_context, KV, sm_count=sms,
                                              block_n=ad.tile_positions(H, KV, hd))
        self._sms = sms
        self.attn_partials, self.attn_counters = self._attention_scratch(self.attn_splits, ad.DEFAULT_MERGE)
        from tritonchat.kernels import sampling as S
        self.counts = torch.zeros(2, cfg.vocab_size, device=dev, dtype=torch.int32)  # [prompt, generated]
        self.sampler_params = z(S.NUM_PARAMS, dtype=torch.float32)
        self.rng_state = torch.zeros(2, device=dev, dtype=torch.int64)     # [seed, step]
        self.top_k_max = TOP_K_MAX if dev.type == "cuda" else TOP_K_MAX_INTERPRETER
        self.sample_scratch = torch.zeros(S.sample_scratch_numel(cfg.vocab_size, self.top_k_max), device=dev,
                                          dtype=torch.int64)

    def _attention_scratch(self, num_splits: int, merge_splits: int):
        """Zeroed (partials, ticket counters) for an attention launch of this many splits and
        merge groups of merge_splits (every launch leaves the counters zero)."""
        from tritonchat.kernels import attention_decode as ad
        H, KV, hd = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        return (torch.zeros(ad.partials_numel(H, hd, num_splits, merge_splits), device=self.device,
                            dtype=torch.float32),
                torch.zeros(ad.counters_numel(KV, num_splits, merge_splits), device=self.device,
                            dtype=torch.int32))

    def _attention_range_plans(self) -> list:
        """The table's attention launch plans for ranges of positions (attention_range_plans),
        resolved for this context and GPU, each with scratch of its own (the base launch's
        stays as it is): [(from, below, launch keywords)]."""
        from tritonchat.kernels import attention_decode as ad
        H, KV, hd = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        out = []
        for lo, hi, p in ad.attention_range_plans(H, KV, hd):
            splits = ad.plan_num_splits(self.options.max_context, KV,
                                        sm_count=self._sms * p["splits_per_sm"], block_n=p["block_n"])
            out.append((lo, hi, dict(num_splits=splits, block_n=p["block_n"],
                                     merge_splits=p["merge_splits"], num_warps=p["num_warps"],
                                     num_stages=p["num_stages"],
                                     scratch=self._attention_scratch(splits, p["merge_splits"]))))
        return out

    def _set_split_k(self, enabled: bool) -> None:
        """Launch plans of every decode GEMV (block sizes and split-K from the tuned tables);
        split-K off = the same tiles without splitting. Scratch sized for the largest."""
        from tritonchat.kernels import gemv as G
        from tritonchat.kernels import sampling as S
        self.options.split_k = bool(enabled)
        cfg = self.cfg
        self._fplans: dict = {}
        range_plans: dict = {}                     # key -> [(below, plan)] (context ranges)
        need_p, need_c = 1, 1

        self._plan_names: dict = {"attention": "attention_decode"}   # plan key -> kernel name

        def add(name, W, prologue, epilogue, head_dim=0):
            nonlocal need_p, need_c
            n_out = W.shape[0] // 2 if epilogue == "silu_mul" else W.shape[0]
            key = (tuple(W.shape), prologue, epilogue)
            if key in self._fplans:
                return
            self._plan_names[key] = name
            p = G.plan(n_out, W.shape[1], prologue, epilogue, head_dim, split_k_enabled=enabled)
            self._fplans[key] = p
            rps = (G.range_plans(n_out, W.shape[1], prologue, epilogue, head_dim,
                                       split_k_enabled=enabled) if self._context_ranges else [])
            if rps:
                # each plan from the previous range's bound (or 0) to its own
                range_plans[key] = [(lo, below, rp) for lo, (below, rp)
                                    in zip([0] + [b for b, _ in rps], rps)]
            for q in [p] + [rp for _, rp in rps]:
                np_, nc = G.scratch_numel(n_out, q, epilogue == "silu_mul")
                need_p, need_c = max(need_p, np_), max(need_c, nc)

        for L in self.layers:
            m = L.mixer
            if isinstance(m, _GdnLayer):
                add("gemv_gdn_in_proj_norm_conv", m.qkvba, "rms", "conv")
                add("gemv_gdn_out_proj_gatednorm", m.out_proj, "gated", "residual",
                    cfg.linear_value_head_dim)
            else:
                add("gemv_attn_qkv_norm", m.qkv, "rms", "plain")
                add("gemv_attn_o_proj", m.o_proj, "none", "residual")
            add("gemv_mlp_gate_up_norm_silu", L.gate_up, "rms", "silu_mul")
            add("gemv_mlp_down", L.down, "none", "residual")
        add("gemv_lm_head_norm", self.lm_head_w, "rms", "plain")   # the sampled path's LM head
        self.gemv_partials = torch.zeros(need_p, device=self.device, dtype=torch.float32)
        self.gemv_counters = torch.zeros(need_c, device=self.device, dtype=torch.int32)
        # short contexts: up to this many active splits the attention leaves its merge to the
        # o_proj's prologue (the table's defer_splits; only while the o_proj's plan is the
        # persistent form, see _layers_step), which saves the attention's ticket and merger;
        # with the table's defer_groups (where the merge groups are few enough), past them it
        # leaves the merge of its groups' partials too, which saves the second ticket
        from tritonchat.kernels.attention_decode import attention_plan, groups_deferrable
        a_plan = attention_plan(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self._attn_defer = a_plan.get("defer_splits", 0)
        self._attn_groups_wanted = bool(a_plan.get("defer_groups", 0))   # the table's, every range
        self._attn_defer_groups = self._attn_groups_wanted and groups_deferrable(
            self.attn_splits, self._attn_defer)
        lm = S.lm_head_plan(cfg.vocab_size, cfg.hidden_size, True)
        self._lm_plan = lm
        self.lm_head_partials = torch.zeros(S.lm_head_partials_numel(cfg.vocab_size, lm["block_n"]),
                                            device=self.device, dtype=torch.int64)
        a_ranges = self._attention_range_plans() if self._context_ranges else []
        if a_ranges:
            # the attention launch's plan in a range (absent from the base: the table's default)
            range_plans["attention"] = a_ranges
        self._ranges = context_ranges(self._fplans, range_plans)
        self._use_range(len(self._ranges) - 1)
        self._invalidate_graph()

    # ------------------------------------------------------------------ context ranges ----
    # Some plans are faster only at short or long contexts (decode_tuning.json, `context_ranges`
    # of an entry). The host knows each step's position, so the engine keeps one set of plans, and
    # one captured decode step, per range of positions, and picks by the position: the graphs
    # are all captured together, so none is captured as the position advances.
    def set_context_ranges(self, enabled: bool) -> None:
        """Use the table's per-context-range plans (the default) or its base plans at every
        position (one graph; what engine/tune_step.py tunes)."""
        self.options.context_ranges = bool(enabled)
        if bool(enabled) != self._context_ranges:
            self._context_ranges = bool(enabled)
            self._set_split_k(self.options.split_k)

    def _range_of(self, pos: int) -> int:
        for i, (below, _) in enumerate(self._ranges):
            if below is None or pos < below:
                return i
        return len(self._ranges) - 1

    def _use_range(self, i: int) -> None:
        self._range = i
        self._plans_now = self._ranges[i][1]

    def plan_range(self) -> Optional[dict]:
        """The context range whose kernel plans the next decode step runs: {"index", "count",
        "start", "below" (None: to the end of the context), "tuned": the kernels whose launch
        plan there is not the base one, by name}; None while one set of plans serves every
        position (the ranges off, or none in the decode table)."""
        if len(self._ranges) < 2:
            return None
        i = self._range_of(self.state.length)
        below, plans = self._ranges[i]
        tuned = sorted({self._plan_names.get(key, str(key)) for key, p in plans.items()
                        if p is not None and p != self._fplans.get(key)})
        return {"index": i, "count": len(self._ranges),
                "start": self._ranges[i - 1][0] if i else 0, "below": below, "tuned": tuned}

    @property
    def context_range_bounds(self) -> list[int]:
        """Positions at which the decode step changes plans (and graphs); [] for one range."""
        return [b for b, _ in self._ranges if b is not None]

    def graph_for(self, pos: int):
        """The captured decode step that serves position `pos` (every range's captured first if
        needed), for tools that replay it from a position they put in pos_buf. Raises when
        capture fails."""
        from .graph import capture_ranges
        self._use_range(self._range_of(pos))
        if self._graphs is None:
            with torch.inference_mode():
                self._graphs = capture_ranges(self)
        self._graph = self._graphs[self._range]
        return self._graph

    # ------------------------------------------------------------------- kernel calls ----
    def _launch(self, name: str, nbytes: int, fn, *args, **kw):
        t = self._timer_active
        if t is None:
            return fn(*args, **kw)
        # external events can be recorded inside a CUDA graph capture (event-record nodes)
        capturing = torch.cuda.is_current_stream_capturing()
        start = torch.cuda.Event(enable_timing=True, external=capturing)
        end = torch.cuda.Event(enable_timing=True, external=capturing)
        start.record()
        fn(*args, **kw)
        end.record()
        t.events.append((name, nbytes, start, end))

    _timer_active: Optional[_Timer] = None

    def _gemv(self, name: str, x, W, out, prologue: str = "none", epilogue: str = "plain", **kw):
        """One fused decode GEMV (RMSNorm / gated-norm prologue; residual / SiLU*up / conv epilogue)."""
        from tritonchat.kernels.gemv import gemv
        p = self._plans_now[(tuple(W.shape), prologue, epilogue)]
        nbytes = W.numel() * W.element_size() + x.numel() * x.element_size() + out.numel() * out.element_size()
        self._launch(name, nbytes, gemv, x, W, out, split_k=p["split_k"], partials=self.gemv_partials,
                     counters=self.gemv_counters, block_n=p["block_n"], block_k=p["block_k"],
                     num_warps=p["num_warps"], persistent=p.get("persistent", 0), pdl=self._pdl, **kw)

    def _layers_step(self) -> None:
        """All layers for the token whose embedding is in self.h, at position pos_buf.
        GDN layer: 3 launches + MLP 2; attention layer: 3 + MLP 2 (norms fused into GEMV prologues)."""
        from tritonchat.kernels.attention_decode import (attention_decode, deferred_merge,
                                                         groups_deferrable)
        from tritonchat.kernels.gdn_decode import gdn_decode
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        for i, L in enumerate(self.layers):
            m = L.mixer
            if isinstance(m, _GdnLayer):
                conv = self.state.conv[i]
                self._gemv("gemv_gdn_in_proj_norm_conv", self.h, m.qkvba, self.gdn_proj, "rms", "conv",
                           norm_w=L.input_norm, eps=eps, conv_state=conv, conv_w=m.conv_w)
                rec = self.state.rec[i]
                # the recurrence, and in programs of the same launch z = in_proj_z @ norm(h)
                # (needed only by the out_proj; its rows stream while the recurrence waits)
                zb = m.z_w.numel() * m.z_w.element_size()
                self._launch("gdn_decode", rec.numel() * 4 * 2 + zb, gdn_decode, self.gdn_proj,
                             m.A_log, m.dt_bias, rec, self.gdn_out, num_k_heads=cfg.linear_num_key_heads,
                             num_v_heads=cfg.linear_num_value_heads, head_k_dim=cfg.linear_key_head_dim,
                             head_v_dim=cfg.linear_value_head_dim, block_v=self._gdn_block_v,
                             z_weight=m.z_w, z_x=self.h, z_norm_w=L.input_norm, z_out=self.gdn_z, z_eps=eps,
                             pdl=self._pdl)
                self._gemv("gemv_gdn_out_proj_gatednorm", self.gdn_out, m.out_proj, self.h, "gated", "residual",
                           norm_w=m.norm_w, gate=self.gdn_z, head_dim=cfg.linear_value_head_dim,
                           eps=eps, residual=self.h)
            else:
                self._gemv("gemv_attn_qkv_norm", self.h, m.qkv, self.attn_proj, "rms", "plain",
                           norm_w=L.input_norm, eps=eps)
                H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
                q_n, kv_n = 2 * H * hd, KV * hd
                kc, vc = self.state.kv[i]
                # bytes: the KV read is position dependent; counted at the current length
                kv_bytes = 2 * KV * hd * kc.element_size() * max(self.state.length, 1)
                o_plan = self._plans_now[(tuple(m.o_proj.shape), "none", "residual")]
                defer = self._attn_defer if o_plan.get("persistent", 0) else 0
                a_plan = self._plans_now.get("attention")
                if a_plan is None:        # the table's plan (its sizes default in attention_decode)
                    a_kw = dict(num_splits=self.attn_splits)
                    partials, counters = self.attn_partials, self.attn_counters
                    groups = bool(defer) and self._attn_defer_groups
                else:                     # a context range's, with its own scratch
                    a_kw = dict(a_plan)
                    partials, counters = a_kw.pop("scratch")
                    groups = (bool(defer) and self._attn_groups_wanted
                              and groups_deferrable(a_plan["num_splits"], defer, a_plan["merge_splits"]))
                a_kw["defer_groups"] = groups
                self._launch("attention_decode", kv_bytes, attention_decode,
                             self.attn_proj[:q_n], self.attn_proj[q_n:q_n + kv_n], self.attn_proj[q_n + kv_n:],
                             m.q_norm, m.k_norm, kc, vc, self.pos_buf, self.attn_out, partials, counters,
                             num_heads=H, num_kv_heads=KV, head_dim=hd, rotary_dim=cfg.rotary_dim,
                             rope_theta=cfg.rope_theta, eps=eps, defer_splits=defer, pdl=self._pdl, **a_kw)
                m_kw = {k: a_kw[k] for k in ("num_splits", "block_n", "merge_splits", "defer_groups")
                        if k in a_kw}
                merge = (deferred_merge(self.attn_proj[:q_n], self.pos_buf, partials, num_heads=H,
                                        num_kv_heads=KV, head_dim=hd, defer_splits=defer, **m_kw)
                         if defer else None)
                self._gemv("gemv_attn_o_proj", self.attn_out, m.o_proj, self.h, "none", "residual",
                           residual=self.h, merge=merge)
            self._gemv("gemv_mlp_gate_up_norm_silu", self.h, L.gate_up, self.act, "rms", "silu_mul",
                       norm_w=L.post_norm, eps=eps, silu_mul=True)
            self._gemv("gemv_mlp_down", self.act, L.down, self.h, "none", "residual", residual=self.h)

    def _head_step(self, sampled: bool, advance: bool = False) -> None:
        """Final norm (fused), LM head and the choice of the next token into tok_buf (no host
        sync); the token is counted for the penalties and, with `advance`, pos_buf += 1 in the
        same last kernel (no separate launches)."""
        from tritonchat.kernels import sampling as S
        E = self.lm_head_w
        eps = self.cfg.rms_norm_eps
        nbytes = E.numel() * E.element_size()
        pos = self.pos_buf if advance else None
        if not sampled:
            lm = self._lm_plan
            self._launch("lm_head_norm_argmax", nbytes, S.lm_head_argmax, self.h, E, self.valid_vocab,
                         self.logits_buf, self.tok_buf, self.lm_head_partials, norm_w=self.final_norm, eps=eps,
                         block_n=lm["block_n"], block_k=lm["block_k"], num_warps=lm["num_warps"],
                         persistent=lm.get("persistent", 0), num_stages=lm.get("num_stages", 1),
                         evict=lm.get("evict", True), counts=self.counts, pos=pos,
                         ring=self.tok_ring if advance else None, pdl=self._pdl)
        else:
            # (the greedy plan's persistent form was measured slower here, 0.646 against 0.618 ms)
            self._gemv("gemv_lm_head_norm", self.h, E, self.logits_buf, "rms", "plain", norm_w=self.final_norm,
                       eps=eps)
            self._launch("sample", self.logits_buf.numel() * 4, S.sample_from_logits, self.logits_buf,
                         self.sampler_params, self.counts, self.rng_state, self.tok_buf, self.sample_scratch,
                         valid_vocab=self.valid_vocab, top_k_max=self._sample_kc, count=True, pos=pos,
                         ring=self.tok_ring if advance else None)

    def _decode_step(self) -> None:
        """token in tok_buf at position pos_buf -> next token in tok_buf, pos_buf + 1."""
        from tritonchat.kernels.embedding import embedding_gather
        self._launch("embedding_gather", self.h.numel() * self.h.element_size() * 2, embedding_gather,
                     self.tok_buf, self.embed, self.h.view(1, -1), pdl=self._pdl)
        self._layers_step()
        self._head_step(self._sampling_key == "sample", advance=True)

    # -------------------------------------------------------------------- Backend API ----
    @property
    def length(self) -> int:
        return self.state.length

    def reset(self) -> None:
        self._drain()
        self.state.zero_()
        self.pos_buf.zero_()

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> None:
        ids = list(ids)
        self._drain()
        if self.state.length + len(ids) > self.options.max_context:
            raise ContextFullError(
                f"The conversation needs {self.state.length + len(ids)} tokens but the context holds "
                f"{self.options.max_context}; start a new chat or raise the context length.")
        ids_t = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        h = self._prefill_hidden(ids_t)
        self.state.length += len(ids)
        self.pos_buf.fill_(self.state.length)
        self.h.copy_(h)
        self._pending_head = True

    def _prefill_hidden(self, ids_t: torch.Tensor) -> torch.Tensor:
        """Pre-final-norm hidden state of the last prompt token; fills the caches/states."""
        from . import triton_prefill
        return triton_prefill.prefill_hidden(self, ids_t)

    def decode(self, token_id: int) -> None:
        self._ensure_sampler_mode()
        self.tok_buf.fill_(int(token_id))
        self._run_decode()

    def logits(self) -> torch.Tensor:
        if self._pending_head:
            self._ensure_sampler_mode()
            self._use_range(self._range_of(max(0, self.state.length - 1)))
            with torch.inference_mode():
                self._head_step(self._sampling_key == "sample")
            self._pending_head = False
        return self.logits_buf

    def begin_sampling(self, params: SamplingParams, history_ids: Sequence[int]) -> None:
        from tritonchat.kernels import sampling as S
        self._params = params
        self.sampler_params.copy_(torch.tensor(S.params_from_sampling(params), dtype=torch.float32))
        self.counts.zero_()
        if len(history_ids):
            ids = torch.as_tensor(list(history_ids), dtype=torch.long, device=self.device)
            self.counts[0] += torch.bincount(ids.clamp(0, self.cfg.vocab_size - 1),
                                             minlength=self.cfg.vocab_size).to(torch.int32)
        seed = params.seed if params.seed is not None else (time.time_ns() & 0x7FFFFFFF)
        self.rng_state.copy_(torch.tensor([int(seed), 0], dtype=torch.int64))
        self._mode_params = None            # the same object may come back with new values
        self._ensure_sampler_mode()

    def _ensure_sampler_mode(self) -> None:
        # called at every decode launch; the settings change only in begin_sampling, so the
        # mode is worked out there (or at the first launch) and not again per token
        p = self._params
        if p is self._mode_params:
            return
        from tritonchat.kernels.sampling import sample_candidates
        plain_greedy = p.is_greedy and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
        key = "argmax" if plain_greedy else "sample"
        # the sampler's candidate count follows the settings (a small top_k sorts far fewer keys);
        # a new count is a new launch geometry, so the step is captured again (on a settings change)
        kc = self.top_k_max if p.is_greedy else sample_candidates(p.top_k, p.top_p, p.min_p, self.top_k_max)
        if key != self._sampling_key or kc != self._sample_kc:
            self._sampling_key, self._sample_kc = key, kc
            self._invalidate_graph()
        self._mode_params = p

    def sample(self) -> int:
        if self._pending_head:
            self.logits()
        tok = int(self.tok_buf.item())
        self._last_token = tok
        return tok

    def step(self, token_id: int) -> int:
        self.launch_step(token_id)
        return self.finish_step()

    def launch_step(self, token_id: int) -> None:
        """Replay the decode step for token_id (already in tok_buf when it is the token this
        backend sampled) without waiting: the host streams text while the GPU computes."""
        self._ensure_sampler_mode()
        if token_id != self._last_token:
            self.tok_buf.fill_(int(token_id))
        self._launch_decode()

    def launch_next(self) -> bool:
        """Queue the step after the newest one in flight: it reads the token that step leaves
        in tok_buf, on the device, in stream order."""
        if not self._inflight or len(self._inflight) >= TOKEN_RING - 1:
            return False
        self._ensure_sampler_mode()
        self._last_token = None                 # tok_buf will hold a token the host has not seen
        self._launch_decode()
        return True

    def _launch_decode(self) -> None:
        pos = self.state.length
        self._run_decode()
        self._inflight.append(pos)
        if self.device.type == "cuda":
            # after the step: copy its ring slot to pinned host memory on the side stream (the
            # next step's writes go to other slots), so finish_step waits for this step only
            rb, slot = self._readback, pos % TOKEN_RING
            rb.step_done[slot].record(torch.cuda.current_stream(self.device))
            rb.stream.wait_event(rb.step_done[slot])
            with torch.cuda.stream(rb.stream):
                rb.host[slot:slot + 1].copy_(self.tok_ring[slot:slot + 1], non_blocking=True)
                rb.copied[slot].record(rb.stream)

    def finish_step(self) -> int:
        """The token of the oldest decode step in flight (waits for that step only)."""
        if not self._inflight:
            return self.sample()
        slot = self._inflight.popleft() % TOKEN_RING
        if self.device.type == "cuda":
            self._readback.copied[slot].synchronize()
            tok = int(self._readback.host[slot])
        else:
            tok = int(self.tok_ring[slot])
        if not self._inflight:
            self._last_token = tok              # the newest step's token: what tok_buf holds
        return tok

    def _drain(self) -> None:
        """Forget the steps in flight (their tokens unread) once they are done; tok_buf then
        holds a token the host does not know."""
        if self._inflight:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._inflight.clear()
            self._last_token = None

    def _run_decode(self) -> None:
        if self.state.length >= self.options.max_context:
            raise ContextFullError(f"The context of {self.options.max_context} tokens is full.")
        self._use_range(self._range_of(self.state.length))
        with torch.inference_mode():
            if self._timer is not None and time.perf_counter() - self._last_timed >= self._timing_interval_s:
                self._timed_decode()
                self._last_timed = time.perf_counter()
            elif self.options.graph and self.device.type == "cuda":
                replay_or_capture(self)
            else:
                self._eager_step()
        self.state.length += 1
        self._pending_head = False

    def _eager_step(self) -> None:
        """One decode step without the graph: the range's recorded launches replayed from the
        host where there are some (launch_cache on, CUDA), else launched through Triton."""
        if not self.options.launch_cache or self.device.type != "cuda":
            self._decode_step()
            return
        rec = self._replays.get(self._range)
        if rec is not None and rec.stream == torch.cuda.current_stream(self.device).cuda_stream:
            rec.replay()
            return
        if self._range not in self._eager_ran:
            self._eager_ran.add(self._range)
            self._decode_step()
            return
        from . import launch_replay
        rec, why = launch_replay.record(self._decode_step, self.device)
        if rec is None:
            # said once; eager decode launches through Triton from now on, and the option reads
            # off (as the L2 window's and the graph's do when they fail), so the stats say so
            self.launch_cache_error = why
            self.options.launch_cache = False
            print(f"tritonchat: the decode step's launches cannot be replayed ({why}); launching "
                  "them through Triton.", file=sys.stderr)
        else:
            self._replays[self._range] = rec

    @property
    def launch_replay_active(self) -> bool:
        """Whether eager decode steps replay recorded launches now (graph off, cache on, CUDA,
        the current range recorded)."""
        return (self.options.launch_cache and not self.options.graph and self.device.type == "cuda"
                and self._range in self._replays)

    def _capture_timed_graph(self) -> None:
        """The decode step with an event-record node between kernels (for the timing panel), one
        per context range, as the untimed ones."""
        from .graph import capture_ranges
        t = self._timer

        def timed(backend):
            t.events = []
            return capture_graph(backend), list(t.events)   # the events recorded into it

        self._timer_active = t
        try:
            self._timed_graphs = capture_ranges(self, timed)
        except Exception:
            self._timed_graph_failed = True
        finally:
            self._timer_active = None

    def _timed_decode(self) -> None:
        """One decode step whose kernels are timed: replayed from a graph with an event-record node
        between launches (the kernels' GPU time inside the step, without host launch gaps), or
        eagerly with events when no graph can be captured (then launch gaps are included)."""
        t = self._timer
        if self.device.type != "cuda":
            self._decode_step()
            return
        if self._timed_graphs is None and not self._timed_graph_failed:
            self._capture_timed_graph()
        if self._timed_graphs is not None:
            graph, events = self._timed_graphs[self._range]
            graph.replay()
            torch.cuda.synchronize(self.device)
            self._accumulate(events)
        else:
            t.events = []
            self._timer_active = t
            try:
                self._decode_step()
            finally:
                self._timer_active = None
            torch.cuda.synchronize(self.device)
            self._accumulate(t.events)

    def _accumulate(self, events) -> None:
        t = self._timer
        step_s = 0.0
        for name, nbytes, s, e in events:
            dt = s.elapsed_time(e) * 1e-3
            row = t.totals.setdefault(name, [0, 0.0, 0])
            row[0] += 1
            row[1] += dt
            row[2] += nbytes
            step_s += dt
        t.steps += 1
        t.step_seconds += step_s

    # ---------------------------------------------------------------------- warm-up ----
    # prompt lengths that reach every prefill tile class (the GEMM tiles change at 16/32/64
    # rows and at the tuned buckets 128/2048), each also continued by a second turn
    WARM_PROMPTS = (5, 24, 40, 100, 1000)

    def warm_up(self, progress: Optional[Callable[[str, float], None]] = None,
                prompt_lengths: Sequence[int] = WARM_PROMPTS) -> None:
        """Compile the kernels a chat uses and capture the decode graph now, at load, so that
        the first answer does not pay for them: a prefill at each tile class of prompt length
        (and a second-turn prefill after it), decode steps in both sampling modes (argmax;
        temperature/top-k/top-p/min-p with both penalties) run eagerly, then one decode step
        that captures the graph. Ends with an empty state. Triton keeps compiled kernels on
        disk, so later loads are much faster than the first; a prompt of a length class or
        alignment not seen here can still compile once."""
        vocab = min(self.cfg.vocab_size, 1000)
        modes = (SamplingParams(greedy=True),
                 SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05,
                                presence_penalty=0.5, repetition_penalty=1.05, seed=0))
        room = self.options.max_context - 16
        lengths = sorted({max(1, min(int(n), room // 2)) for n in prompt_lengths})
        prompt = lambda n: [(7 * i + 11) % vocab for i in range(n)]  # noqa: E731
        graph = self.options.graph
        self.options.graph = False
        self._invalidate_graph()
        total, done = len(lengths) + len(modes), 0
        try:
            if progress:
                progress("kernels", 0.0)
            for n in lengths:
                self.reset()
                self.prefill(prompt(n))
                self.prefill(prompt(n + 3)[-min(n, room - n):])       # a second turn
                done += 1
                if progress:
                    progress("kernels", done / total)
            for params in modes:
                self.reset()
                self.prefill(prompt(5))
                self.begin_sampling(params, prompt(5))
                tok = self.sample()
                for _ in range(2):
                    tok = self.step(tok)
                done += 1
                if progress:
                    progress("kernels", done / total)
        finally:
            self.options.graph = graph
        if graph and self.device.type == "cuda":
            if progress:
                progress("graph", 0.0)
            self.reset()
            self.prefill(prompt(4))
            self.begin_sampling(modes[1], prompt(4))
            self.step(self.sample())               # captures the graph of the sampled step
            if progress:
                progress("graph", 1.0)
        self.reset()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---------------------------------------------------------------------- snapshots ----
    def snapshot(self):
        self._drain()
        return self.state.snapshot()

    def restore(self, snap) -> None:
        self._drain()
        self.state.restore(snap)
        self.pos_buf.fill_(self.state.length)
        self._pending_head = False

    # ------------------------------------------------------------------ switches/timing ----
    def l2_state_window(self) -> Optional[tuple[int, int, float]]:
        """(base, bytes, hit ratio) of the access policy window graph.capture puts on the
        decode step's kernels, after setting aside that much L2 for persisting lines: the GDN
        recurrent states (ModelState.rec_buf), when options.l2_state is on and the GPU can
        (engine/l2_state.py). None otherwise, with the set-aside returned to normal L2."""
        from . import l2_state as L2
        if self._l2_error is not None:
            self.options.l2_state = False          # refused before: the switch says what runs
        want = (self.options.l2_state and self.device.type == "cuda" and self._l2_error is None
                and self.state.rec_buf.numel() > 0)
        try:
            if not want:
                if self._l2_limit:
                    L2.set_persisting_limit(0)
                    self._l2_limit = 0
                return None
            buf = self.state.rec_buf
            nbytes = buf.numel() * buf.element_size()
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            max_persist, max_window = L2.device_limits(index)
            if max_persist <= 0 or max_window <= 0:
                self.l2_state_failed("this GPU has no persisting L2 cache")
                return None
            nbytes = min(nbytes, max_window)
            # the set-aside a little larger than the window: set to the window's size exactly,
            # the states gained nothing on the H200; 1, 2 or 4 MiB more all gave the full gain,
            # and the whole 37.5 MiB the driver allows was 7% slower (less L2 for everything
            # else): docs/decode_log.md, stop 26
            limit = min(nbytes + L2.SLACK_BYTES, max_persist)
            if limit != self._l2_limit:
                L2.set_persisting_limit(limit)
                self._l2_limit = limit
            room = limit - L2.SLACK_BYTES if limit > 2 * L2.SLACK_BYTES else limit // 2
            return buf.data_ptr(), nbytes, min(1.0, room / nbytes)   # a window past it: in part
        except L2.L2StateError as e:
            self.l2_state_failed(str(e))
            return None

    def l2_state_failed(self, why: str) -> None:
        """The persisting-L2 window cannot be used: say so once; decode goes on without it, and
        the option reads off (as the graph's does when its capture fails), so the stats and the
        app's status bar say what runs."""
        self.options.l2_state = False
        if self._l2_error is None:
            self._l2_error = why
            print(f"tritonchat: the GDN states cannot be kept in L2 ({why.rstrip('.')}); "
                  "decoding without it.", file=sys.stderr)
        self.l2_state_nodes = 0

    def _invalidate_graph(self) -> None:
        """Drop the captured decode steps and the recorded eager launches (valid exactly where
        the graphs are): the step's plans, buffers or sampler changed."""
        self._graph = None
        self._graphs = None
        self._timed_graphs = None
        self._timed_graph_failed = False
        self._drop_replays()

    def _drop_replays(self) -> None:
        """Forget the recorded eager launches; each range records again at its second step."""
        self._replays = {}
        self._eager_ran = set()

    def configure(self, **switches: bool) -> None:
        sw = check_switches(switches)
        split_k, graph, timing = sw.get("split_k"), sw.get("graph"), sw.get("timing")
        l2_state, context_ranges, launch_cache = sw.get("l2_state"), sw.get("context_ranges"), sw.get("launch_cache")
        if "prefill_graph" in sw:
            self.options.prefill_graph = sw["prefill_graph"]
            self.prefill_graph = self.options.prefill_graph and self.device.type == "cuda"
        pdl = {k: sw[k] for k in ("pdl", "pdl_early") if k in sw and sw[k] != getattr(self.options, k)}
        if pdl:
            # the kernels read these when launched: record them anew (graphs, launch replays)
            for k, v in pdl.items():
                setattr(self.options, k, v)
            self._apply_pdl()
            self._drop_replays()
            self._invalidate_graph()
        if launch_cache is not None and bool(launch_cache) != self.options.launch_cache:
            self.options.launch_cache = bool(launch_cache)
            self._drop_replays()
            self.launch_cache_error = None
        if split_k is not None and bool(split_k) != self.options.split_k:
            self._set_split_k(bool(split_k))
        if context_ranges is not None:
            self.set_context_ranges(bool(context_ranges))
        if graph is not None and bool(graph) != self.options.graph:
            self.options.graph = bool(graph)
            self._invalidate_graph()
        if l2_state is not None and bool(l2_state) != self.options.l2_state:
            self.options.l2_state = bool(l2_state)
            self._invalidate_graph()
        if timing is not None:
            self.options.timing = bool(timing)
            self._timer = _Timer() if timing else None
            self._last_timed = 0.0
            # capture the timed step now (the panel opens between answers), not inside the
            # next answer's first step, where it would cost that answer ~20 ms
            if (timing and self.options.graph and self.device.type == "cuda"
                    and self._sampling_key is not None and self._timed_graphs is None
                    and not self._timed_graph_failed):
                with torch.inference_mode():
                    self._capture_timed_graph()

    def _apply_pdl(self) -> None:
        # programmatic dependent launch (sm_90+; a no-op elsewhere): each GEMV starts streaming
        # its weights while the previous kernel finishes
        from tritonchat.kernels._common import pdl_mode
        self._pdl = pdl_mode(self.options.pdl, self.options.pdl_early, self.options.device)

    def set_max_context(self, n: int) -> None:
        self._drain()
        self._invalidate_graph()
        del self.state
        torch.cuda.empty_cache() if self.device.type == "cuda" else None
        self._allocate(int(n))
        self._set_split_k(self.options.split_k)

    def kernel_timings(self) -> Optional[list[dict]]:
        t = self._timer
        if t is None or t.steps == 0:
            return None
        rows = []
        for name, (n, sec, nbytes) in t.totals.items():
            rows.append({"name": name, "launches_per_token": n / t.steps, "us_per_token": sec / t.steps * 1e6,
                         "share": sec / t.step_seconds if t.step_seconds else 0.0,
                         "gb_s": nbytes / sec / 1e9 if sec else 0.0})
        rows.sort(key=lambda r: -r["us_per_token"])
        return rows

    def reset_timings(self) -> None:
        if self._timer is not None:
            self._timer = _Timer()

    def measure_roofline(self) -> dict:
        from tritonchat.kernels.bandwidth import read_rates_gb_s
        nbytes = self.cfg.decode_bytes_per_token(self.embed.element_size())
        gb_s = max(read_rates_gb_s(nbytes, self.device, 20).values())   # as the bench's roofline
        return {"gb_s": gb_s, "bytes_per_token": nbytes}

    def close(self) -> None:
        self._drain()
        self._invalidate_graph()
        self.layers = []
        if self._l2_limit:                        # the set-aside L2 back to everyone
            from .l2_state import L2StateError, set_persisting_limit
            try:
                set_persisting_limit(0)
            except L2StateError:
                pass
            self._l2_limit = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
