"""One decode step of Qwen3.5 as Triton kernel launches: read it beside engine/reference.py.

    embed -> for each layer: (norm -> Gated DeltaNet | gated attention) + residual,
                             (norm -> MLP) + residual
          -> final norm -> LM head -> next token

Each line of `DecodeStep.__call__` and the methods it calls is one kernel launch, in order:

    embedding_gather                        the token's embedding row into h
    per Gated DeltaNet layer (18 of 24):
      gemv  in_proj q|k|v|b|a               input RMSNorm in the prologue, causal conv1d + SiLU
                                            in the epilogue (conv state shifted in place)
      gdn_decode                            the gated delta rule on the fp32 state; programs of
                                            the same launch compute z = in_proj_z @ norm(h)
      gemv  out_proj                        gated RMSNorm(o, silu(z)) prologue, += into h
    per gated-attention layer (6 of 24):
      gemv  q|gate|k|v                      input RMSNorm in the prologue
      attention_decode                      q/k norm, partial RoPE, KV-cache append,
                                            flash-decoding over split KV, sigmoid output gate
      gemv  o_proj                          += into h (merging the attention's split partials
                                            itself at short contexts: deferred merge)
    per layer, the MLP:
      gemv  gate|up                         post-attention RMSNorm prologue, SiLU(gate)*up
      gemv  down                            += into h
    head, greedy:   lm_head_argmax          final RMSNorm, tied LM head, argmax: the token
    head, sampled:  gemv lm_head            final RMSNorm, tied LM head -> fp32 logits
                    sample_from_logits      penalties, temperature, top-k/p, min-p, the draw

All launches read the token and its position from device tensors and allocate nothing, so the
step is captured once as a CUDA graph (engine/graph.py) and replayed. The launch plans (block
sizes, split-K, persistent forms, the attention's split-KV layout) come from the tuned decode
table in the constructor, one plan set per range of positions where the table has plans for
short or long contexts (`context_ranges`); `use_position` picks the range before a step.
The backend (engine/triton_backend.py) owns weights, buffers, graphs and the token readback.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from tritonchat.kernels import attention_decode as AD
from tritonchat.kernels import gemv as G
from tritonchat.kernels import sampling as S
from tritonchat.kernels.attention_decode import attention_decode, deferred_merge, groups_deferrable
from tritonchat.kernels.embedding import embedding_gather
from tritonchat.kernels.gdn_decode import gdn_decode
from tritonchat.kernels.gemv import gemv

from .config import TextConfig
from .reference import ModelState

# The GPU sampler searches top-p / min-p within the TOP_K_MAX most likely tokens (top-k larger
# than this is clamped); greedy and plain temperature sampling are exact over the whole vocab.
# With top-k set it searches 2 x top_k candidates (at least 32; sampling.sample_candidates).
TOP_K_MAX = 256
TOP_K_MAX_INTERPRETER = 64   # the interpreter (CPU tests) sorts slowly: a smaller candidate cap

# -------------------------------------------------------------------------- weights ----


@dataclass
class GdnWeights:
    qkvbaz: torch.Tensor      # [conv_dim + 2*Hv + value_dim, D]: in_proj_qkv|b|a|z (prefill GEMM)
    qkvba: torch.Tensor       # its first conv_dim + 2*Hv rows (the decode in_proj GEMV)
    z_w: torch.Tensor         # its last value_dim rows, in_proj_z (the decode GDN launch)
    conv_w: torch.Tensor      # [conv_dim, Kc]
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_w: torch.Tensor
    out_proj: torch.Tensor


@dataclass
class AttentionWeights:
    qkv: torch.Tensor         # [2*H*hd + 2*KV*hd, D]: q|gate interleaved per head, then k, then v
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor


@dataclass
class LayerWeights:
    kind: str                 # config.FULL_ATTENTION or linear attention (Gated DeltaNet)
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor     # [2I, D]
    down: torch.Tensor        # [D, I]
    mixer: object             # GdnWeights | AttentionWeights


@dataclass
class StepIO:
    """The tensors a step shares with the backend: it reads tok and pos, leaves the next token
    in tok (and in tok_ring[pos % len]) and pos + 1 in pos; h is the residual stream, logits
    the sampled head's output; counts, rng_state and sampler_params are the sampler's."""
    tok: torch.Tensor
    pos: torch.Tensor
    tok_ring: torch.Tensor
    h: torch.Tensor
    logits: torch.Tensor
    counts: torch.Tensor
    rng_state: torch.Tensor
    sampler_params: torch.Tensor


# ------------------------------------------------------------------------- launcher ----


@dataclass
class KernelTimer:
    """Per-kernel GPU time of timed steps, by CUDA events."""
    events: list = field(default_factory=list)     # (name, nbytes, start, end) of the current step
    totals: dict = field(default_factory=dict)     # name -> [launches, seconds, bytes]
    steps: int = 0
    step_seconds: float = 0.0

    def accumulate(self, events) -> None:
        step_s = 0.0
        for name, nbytes, s, e in events:
            dt = s.elapsed_time(e) * 1e-3
            row = self.totals.setdefault(name, [0, 0.0, 0])
            row[0] += 1
            row[1] += dt
            row[2] += nbytes
            step_s += dt
        self.steps += 1
        self.step_seconds += step_s

    def rows(self) -> Optional[list[dict]]:
        if self.steps == 0:
            return None
        rows = [{"name": name, "launches_per_token": n / self.steps, "us_per_token": sec / self.steps * 1e6,
                 "share": sec / self.step_seconds if self.step_seconds else 0.0,
                 "gb_s": nbytes / sec / 1e9 if sec else 0.0}
                for name, (n, sec, nbytes) in self.totals.items()]
        rows.sort(key=lambda r: -r["us_per_token"])
        return rows


class Launcher:
    """Calls a kernel wrapper; while `timer` is set, between CUDA events recorded under the
    kernel's name (inside a graph capture too: external events become event-record nodes).
    `trace`, when set, is called with each launch's name and keywords first (the profiler's
    and the tests' hook)."""

    def __init__(self) -> None:
        self.timer: Optional[KernelTimer] = None
        self.trace: Optional[Callable[[str, dict], None]] = None

    def __call__(self, name: str, nbytes: int, fn, *args, **kw):
        if self.trace is not None:
            self.trace(name, kw)
        t = self.timer
        if t is None:
            return fn(*args, **kw)
        capturing = torch.cuda.is_current_stream_capturing()
        start = torch.cuda.Event(enable_timing=True, external=capturing)
        end = torch.cuda.Event(enable_timing=True, external=capturing)
        start.record()
        fn(*args, **kw)
        end.record()
        t.events.append((name, nbytes, start, end))


# ---------------------------------------------------------------------------- plans ----

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


def gemv_key(W: torch.Tensor, prologue: str, epilogue: str) -> tuple:
    """A decode GEMV's plan key: (weight shape, prologue, epilogue)."""
    return (tuple(W.shape), prologue, epilogue)


# ------------------------------------------------------------------------------ step ----

class DecodeStep:
    """token in io.tok at position io.pos -> the next token in io.tok, io.pos + 1.

    split_k=False plans every GEMV without splitting K; context_ranges=False uses the table's
    base plans at every position; pdl is the kernels' PDL mode (kernels/_common.pdl_mode).
    plan_overrides replaces plans by key (gemv_key(...), "lm_head", or "attention": the
    attention's defer_splits / defer_groups): the in-step tuner and tests use it. sampled / candidates pick the head (argmax, or the sampler with that many
    top-k candidates); set them with set_sampler (a new launch geometry: recapture)."""

    def __init__(self, cfg: TextConfig, layers: list[LayerWeights], embed: torch.Tensor,
                 lm_head: torch.Tensor, final_norm: torch.Tensor, io: StepIO, state: ModelState,
                 *, max_context: int, valid_vocab: int, split_k: bool, context_ranges: bool, pdl: int, sm_count: int,
                 launcher: Optional[Launcher] = None, plan_overrides: Optional[dict] = None):
        self.cfg, self.layers, self.io, self.state = cfg, layers, io, state
        self.embed_w, self.lm_head_w, self.final_norm = embed, lm_head, final_norm
        self.valid_vocab, self.pdl, self.sm_count = valid_vocab, pdl, sm_count
        self.max_context = max_context
        self.launch = launcher or Launcher()
        self.device = io.h.device
        self.sampled, self.candidates = False, 0
        # the activations between launches (all allocated here, once)
        z = lambda n, dtype=io.h.dtype: torch.zeros(n, device=self.device, dtype=dtype)  # noqa: E731
        H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.gdn_proj = z(cfg.conv_dim + 2 * cfg.linear_num_value_heads)   # [q|k|v conv out | b | a]
        self.gdn_z = z(cfg.linear_value_dim)                                 # written by gdn_decode
        self.gdn_out = z(cfg.linear_value_dim)
        self.attn_proj = z(2 * H * hd + 2 * KV * hd)
        self.attn_out = z(H * hd)
        self.act = z(cfg.intermediate_size)
        self._plan(split_k, context_ranges, plan_overrides or {})
        self.use_range(len(self.ranges) - 1)

    # -------------------------------------------------------------------- the step ----
    def __call__(self) -> None:
        self.embed()
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mixer, GdnWeights):
                self.gated_deltanet(i, layer)
            else:
                self.attention(i, layer)
            self.mlp(layer)
        self.head(advance=True)

    def embed(self) -> None:
        h = self.io.h
        self.launch("embedding_gather", h.numel() * h.element_size() * 2, embedding_gather,
                    self.io.tok, self.embed_w, h.view(1, -1), pdl=self.pdl)

    def gated_deltanet(self, i: int, layer: LayerWeights) -> None:
        cfg, m, h, eps = self.cfg, layer.mixer, self.io.h, self.cfg.rms_norm_eps
        self._gemv("gemv_gdn_in_proj_norm_conv", h, m.qkvba, self.gdn_proj, "rms", "conv",
                   norm_w=layer.input_norm, eps=eps, conv_state=self.state.conv[i], conv_w=m.conv_w)
        rec = self.state.rec[i]
        # the recurrence, and in programs of the same launch z = in_proj_z @ norm(h) (needed
        # only by the out_proj; its rows stream while the recurrence waits)
        nbytes = rec.numel() * 4 * 2 + m.z_w.numel() * m.z_w.element_size()
        self.launch("gdn_decode", nbytes, gdn_decode, self.gdn_proj, m.A_log, m.dt_bias, rec,
                    self.gdn_out, num_k_heads=cfg.linear_num_key_heads,
                    num_v_heads=cfg.linear_num_value_heads, head_k_dim=cfg.linear_key_head_dim,
                    head_v_dim=cfg.linear_value_head_dim, block_v=None, z_weight=m.z_w, z_x=h,
                    z_norm_w=layer.input_norm, z_out=self.gdn_z, z_eps=eps, pdl=self.pdl)
        self._gemv("gemv_gdn_out_proj_gatednorm", self.gdn_out, m.out_proj, h, "gated", "residual",
                   norm_w=m.norm_w, gate=self.gdn_z, head_dim=cfg.linear_value_head_dim, eps=eps,
                   residual=h)

    def attention(self, i: int, layer: LayerWeights) -> None:
        cfg, m, h, eps = self.cfg, layer.mixer, self.io.h, self.cfg.rms_norm_eps
        H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_n, kv_n = 2 * H * hd, KV * hd
        self._gemv("gemv_attn_qkv_norm", h, m.qkv, self.attn_proj, "rms", "plain",
                   norm_w=layer.input_norm, eps=eps)
        kc, vc = self.state.kv[i]
        a = self._attention_now
        # bytes: the KV read depends on the position; counted at the current length
        kv_bytes = 2 * KV * hd * kc.element_size() * max(self.state.length, 1)
        self.launch("attention_decode", kv_bytes, attention_decode,
                    self.attn_proj[:q_n], self.attn_proj[q_n:q_n + kv_n], self.attn_proj[q_n + kv_n:],
                    m.q_norm, m.k_norm, kc, vc, self.io.pos, self.attn_out, a["partials"], a["counters"],
                    num_heads=H, num_kv_heads=KV, head_dim=hd, rotary_dim=cfg.rotary_dim,
                    rope_theta=cfg.rope_theta, eps=eps, defer_splits=a["defer"], pdl=self.pdl,
                    **a["launch"])
        self._gemv("gemv_attn_o_proj", self.attn_out, m.o_proj, h, "none", "residual", residual=h,
                   merge=self._merge_now)

    def mlp(self, layer: LayerWeights) -> None:
        h, eps = self.io.h, self.cfg.rms_norm_eps
        self._gemv("gemv_mlp_gate_up_norm_silu", h, layer.gate_up, self.act, "rms", "silu_mul",
                   norm_w=layer.post_norm, eps=eps, silu_mul=True)
        self._gemv("gemv_mlp_down", self.act, layer.down, h, "none", "residual", residual=h)

    def head(self, advance: bool = False) -> None:
        """Final norm (fused), LM head and the next token into io.tok; the token is counted for
        the penalties and, with `advance`, io.pos += 1 in the same last kernel."""
        io, E, eps = self.io, self.lm_head_w, self.cfg.rms_norm_eps
        nbytes = E.numel() * E.element_size()
        pos, ring = (io.pos, io.tok_ring) if advance else (None, None)
        if not self.sampled:
            lm = self.lm_plan
            self.launch("lm_head_norm_argmax", nbytes, S.lm_head_argmax, io.h, E, self.valid_vocab,
                        io.logits, io.tok, self.lm_head_partials, norm_w=self.final_norm, eps=eps,
                        block_n=lm["block_n"], block_k=lm["block_k"], num_warps=lm["num_warps"],
                        persistent=lm.get("persistent", 0), num_stages=lm.get("num_stages", 1),
                        evict=lm.get("evict", True), counts=io.counts, pos=pos, ring=ring, pdl=self.pdl)
        else:
            # (the greedy plan's persistent form was measured slower here, 0.646 against 0.618 ms)
            self._gemv("gemv_lm_head_norm", io.h, E, io.logits, "rms", "plain", norm_w=self.final_norm,
                       eps=eps)
            self.launch("sample", io.logits.numel() * 4, S.sample_from_logits, io.logits,
                        io.sampler_params, io.counts, io.rng_state, io.tok, self.sample_scratch,
                        valid_vocab=self.valid_vocab, top_k_max=self.candidates, count=True, pos=pos,
                        ring=ring)

    def _gemv(self, name: str, x, W, out, prologue: str, epilogue: str, **kw) -> None:
        p = self.plans[gemv_key(W, prologue, epilogue)]
        nbytes = W.numel() * W.element_size() + x.numel() * x.element_size() + out.numel() * out.element_size()
        self.launch(name, nbytes, gemv, x, W, out, split_k=p["split_k"], partials=self.gemv_partials,
                    counters=self.gemv_counters, block_n=p["block_n"], block_k=p["block_k"],
                    num_warps=p["num_warps"], persistent=p.get("persistent", 0), pdl=self.pdl, **kw)

    # -------------------------------------------------------------------- sampler ----
    def set_sampler(self, sampled: bool, candidates: int) -> bool:
        """Argmax head, or the sampler with `candidates` top-k candidates; True if it changed
        (the launches differ: a captured graph of this step is stale)."""
        if (bool(sampled), int(candidates)) == (self.sampled, self.candidates):
            return False
        self.sampled, self.candidates = bool(sampled), int(candidates)
        return True

    # ---------------------------------------------------------------------- plans ----
    def _plan(self, split_k: bool, use_ranges: bool, overrides: dict) -> None:
        """Every launch's plan from the decode table, per range of positions; the scratch the
        largest of them needs."""
        cfg = self.cfg
        self._o_key = None
        self.names: dict = {"attention": "attention_decode"}   # plan key -> kernel name
        base: dict = {}
        range_plans: dict = {}                  # key -> [(from, below, plan)]
        need_p, need_c = 1, 1

        def add(name, W, prologue, epilogue, head_dim=0):
            nonlocal need_p, need_c
            key = gemv_key(W, prologue, epilogue)
            if key in base:
                return
            n_out = W.shape[0] // 2 if epilogue == "silu_mul" else W.shape[0]
            self.names[key] = name
            p = overrides.get(key) or G.plan(n_out, W.shape[1], prologue, epilogue, head_dim,
                                             split_k_enabled=split_k)
            base[key] = p
            rps = (G.range_plans(n_out, W.shape[1], prologue, epilogue, head_dim, split_k_enabled=split_k)
                   if use_ranges and key not in overrides else [])
            if rps:
                range_plans[key] = [(lo, below, rp) for lo, (below, rp) in zip([0] + [b for b, _ in rps], rps)]
            for q in [p] + [rp for _, rp in rps]:
                np_, nc = G.scratch_numel(n_out, q, epilogue == "silu_mul")
                need_p, need_c = max(need_p, np_), max(need_c, nc)

        for layer in self.layers:
            m = layer.mixer
            if isinstance(m, GdnWeights):
                add("gemv_gdn_in_proj_norm_conv", m.qkvba, "rms", "conv")
                add("gemv_gdn_out_proj_gatednorm", m.out_proj, "gated", "residual", cfg.linear_value_head_dim)
            else:
                add("gemv_attn_qkv_norm", m.qkv, "rms", "plain")
                add("gemv_attn_o_proj", m.o_proj, "none", "residual")
                self._o_key = gemv_key(m.o_proj, "none", "residual")
            add("gemv_mlp_gate_up_norm_silu", layer.gate_up, "rms", "silu_mul")
            add("gemv_mlp_down", layer.down, "none", "residual")
        add("gemv_lm_head_norm", self.lm_head_w, "rms", "plain")      # the sampled head
        self.base_plans = base
        self.split_k_splits = sorted(self.names[k] for k, p in base.items() if p["split_k"] > 1)
        self.gemv_partials = torch.zeros(need_p, device=self.device, dtype=torch.float32)
        self.gemv_counters = torch.zeros(need_c, device=self.device, dtype=torch.int32)

        # the attention: its split-KV layout for this context, and per range the table's
        # plans; at short contexts (up to defer_splits active splits) it leaves the merge of its
        # partials to the o_proj's prologue while that GEMV runs the persistent form, and with
        # defer_groups also the merge of its groups' partials
        H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        max_context = self.max_context
        a_plan = dict(AD.attention_plan(H, KV, hd), **overrides.get("attention", {}))
        self.defer_splits = a_plan.get("defer_splits", 0)
        self._groups_wanted = bool(a_plan.get("defer_groups", 0))
        splits = AD.plan_num_splits(max_context, KV, sm_count=self.sm_count, block_n=AD.tile_positions(H, KV, hd))
        self.attention_base = self._attention_launch(splits, AD.DEFAULT_MERGE, {}, base_plan=True)
        self.defer_groups = self._groups_wanted and groups_deferrable(splits, self.defer_splits)
        if use_ranges:
            a_ranges = []
            for lo, hi, p in AD.attention_range_plans(H, KV, hd):
                s = AD.plan_num_splits(max_context, KV, sm_count=self.sm_count * p["splits_per_sm"],
                                       block_n=p["block_n"])
                launch = dict(num_splits=s, block_n=p["block_n"], merge_splits=p["merge_splits"],
                              num_warps=p["num_warps"], num_stages=p["num_stages"])
                a_ranges.append((lo, hi, self._attention_launch(s, p["merge_splits"], launch)))
            if a_ranges:
                range_plans["attention"] = a_ranges
        self.lm_plan = overrides.get("lm_head") or S.lm_head_plan(cfg.vocab_size, cfg.hidden_size, True)
        self.lm_head_partials = torch.zeros(S.lm_head_partials_numel(cfg.vocab_size, self.lm_plan["block_n"]),
                                            device=self.device, dtype=torch.int64)
        self.top_k_max = TOP_K_MAX if self.device.type == "cuda" else TOP_K_MAX_INTERPRETER
        self.sample_scratch = torch.zeros(S.sample_scratch_numel(cfg.vocab_size, self.top_k_max),
                                          device=self.device, dtype=torch.int64)
        self.ranges = context_ranges(base, range_plans)

    def _attention_launch(self, num_splits: int, merge_splits: int, launch: dict,
                          base_plan: bool = False) -> dict:
        """One attention launch's keywords and zeroed scratch (partials, ticket counters; every
        launch leaves the counters zero)."""
        H, KV, hd = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        return dict(
            launch=dict(launch) if not base_plan else dict(num_splits=num_splits),
            merge_splits=merge_splits, num_splits=num_splits,
            partials=torch.zeros(AD.partials_numel(H, hd, num_splits, merge_splits), device=self.device,
                                 dtype=torch.float32),
            counters=torch.zeros(AD.counters_numel(KV, num_splits, merge_splits), device=self.device,
                                 dtype=torch.int32))

    # ------------------------------------------------------------- context ranges ----
    def range_of(self, pos: int) -> int:
        for i, (below, _) in enumerate(self.ranges):
            if below is None or pos < below:
                return i
        return len(self.ranges) - 1

    def use_position(self, pos: int) -> None:
        """Run the plans of the range holding position `pos` from now on (asked before every
        step: nothing to do while the range stays the same)."""
        i = self.range_of(pos)
        if i != self.range_index:
            self.use_range(i)

    def use_range(self, i: int) -> None:
        self.range_index = i
        self.plans = self.ranges[i][1]
        cfg = self.cfg
        H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_n = 2 * H * hd
        o_plan = self.plans.get(self._o_key)
        defer = self.defer_splits if o_plan and o_plan.get("persistent", 0) else 0
        ranged = self.plans.get("attention")
        a = ranged or self.attention_base
        if ranged is not None:              # a context range's own launch plan
            groups = bool(defer) and self._groups_wanted and groups_deferrable(a["num_splits"], defer,
                                                                               a["merge_splits"])
        else:                               # the table's plan (sizes default in attention_decode)
            groups = bool(defer) and self._groups_wanted and groups_deferrable(a["num_splits"], defer)
        launch = dict(a["launch"], defer_groups=groups)
        self._attention_now = dict(a, launch=launch, defer=defer)
        if defer and self.attn_proj is not None:
            m_kw = {k: launch[k] for k in ("num_splits", "block_n", "merge_splits", "defer_groups") if k in launch}
            self._merge_now = deferred_merge(self.attn_proj[:q_n], self.io.pos, a["partials"], num_heads=H,
                                             num_kv_heads=KV, head_dim=hd, defer_splits=defer, **m_kw)
        else:
            self._merge_now = None

    @property
    def range_bounds(self) -> list[int]:
        """Positions at which the step changes plans (and graphs); [] for one range."""
        return [b for b, _ in self.ranges if b is not None]

    def range_info(self, pos: int) -> Optional[dict]:
        """The context range whose plans serve position `pos`: {"index", "count", "start",
        "below" (None: to the end), "tuned": the kernels whose plan there is not the base one};
        None while one plan set serves every position."""
        if len(self.ranges) < 2:
            return None
        i = self.range_of(pos)
        below, plans = self.ranges[i]
        tuned = sorted({self.names.get(key, str(key)) for key, p in plans.items()
                        if p is not None and p != self.base_plans.get(key)})
        return {"index": i, "count": len(self.ranges), "start": self.ranges[i - 1][0] if i else 0,
                "below": below, "tuned": tuned}

