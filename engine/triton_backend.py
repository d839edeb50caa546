"""The Triton backend: the lifecycle around the decode step (engine/decode_step.py).

It loads and merges the weights, allocates the static KV cache, the GDN states and the buffers
the step shares with the host, builds the DecodeStep (whose constructor plans every launch),
captures and replays its CUDA graphs (one per context range, engine/graph.py), replays its
recorded launches with the graph off (engine/launch_replay.py), times it for the panel, and
reads each step's token back through a ring of pinned slots while the next step runs. Prefill
is engine/triton_prefill.py.

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
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .options import EngineOptions, SamplingParams, check_switches
from .backend import Backend
from .config import FULL_ATTENTION, TextConfig
from .errors import BackendUnavailableError, ContextFullError
from .decode_step import (AttentionWeights, DecodeStep, GdnWeights, KernelTimer, Launcher, LayerWeights,
                          StepIO)
from . import graph as graph_mod
from .graph import capture_ranges
from .reference import ModelState, ReferenceModel, torch_dtype

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
        self.launcher = Launcher()
        self.plan_overrides: dict = {}           # DecodeStep's (the in-step tuner's and tests')
        self._sampler = (False, 0)               # the head the step runs: sampled?, candidates
        self._sampling_key = None                 # set once the first sampling settings came
        self._allocate(options.max_context)
        self._graph = None                        # the decode graph last replayed
        self._graphs: Optional[list] = None       # one captured decode step per context range
        self._timed_graphs: Optional[list] = None  # the same with timing events: (graph, events)
        self._timed_graph_failed = False
        # eager decode (graph off): each context range's recorded launches, replayed from the
        # host (engine/launch_replay.py); a range records at its second eager step (its first
        # compiles the kernels); a refused recording turns the option off, with the reason
        self._drop_replays()
        self.launch_cache_error: Optional[str] = None
        self._timer: Optional[KernelTimer] = None
        self.timing_interval_s = 0.5
        self._last_timed = 0.0
        self._l2_error: Optional[str] = None     # why the GDN states cannot persist in L2
        self._l2_limit = 0                       # the L2 set aside for them now (bytes)
        self.l2_state_nodes = 0                  # kernel nodes of the last graph with the window
        # prompts up to 2,048 tokens replay a captured prefill per bucket length (CUDA)
        self.prefill_graph = options.prefill_graph and self.device.type == "cuda"
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
        self.layers: list[LayerWeights] = []
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
                mixer = AttentionWeights(qkv, w[a + "q_norm.weight"], w[a + "k_norm.weight"], w[a + "o_proj.weight"])
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
                mixer = GdnWeights(merged, merged[:n_ba], merged[n_ba:], conv_w, w[g + "A_log"],
                                  w[g + "dt_bias"].contiguous(),
                                  w[g + "norm.weight"].contiguous(), w[g + "out_proj.weight"])
            self.layers.append(LayerWeights(kind, w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"],
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
        D = cfg.hidden_size
        z = lambda *s, dtype=dt: torch.zeros(*s, device=dev, dtype=dtype)  # noqa: E731
        self.tok_buf = torch.zeros(1, device=dev, dtype=torch.int64)
        self.pos_buf = torch.zeros(1, device=dev, dtype=torch.int32)
        # each decode step also writes its token to tok_ring[position % TOKEN_RING]: the host
        # reads it there (copied on a side stream) while the next step is already running
        self.tok_ring = torch.full((TOKEN_RING,), -1, device=dev, dtype=torch.int64)
        self.h = z(D)                                          # residual stream
        self.logits_buf = z(cfg.vocab_size, dtype=torch.float32)
        from tritonchat.kernels import sampling as S
        self.counts = torch.zeros(2, cfg.vocab_size, device=dev, dtype=torch.int32)  # [prompt, generated]
        self.sampler_params = z(S.NUM_PARAMS, dtype=torch.float32)
        self.rng_state = torch.zeros(2, device=dev, dtype=torch.int64)     # [seed, step]
        self.io = StepIO(tok=self.tok_buf, pos=self.pos_buf, tok_ring=self.tok_ring, h=self.h,
                         logits=self.logits_buf, counts=self.counts, rng_state=self.rng_state,
                         sampler_params=self.sampler_params)
        self._sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
        self._build_step()

    def _build_step(self) -> None:
        """The decode step for the current options, plans and buffers (its constructor plans
        every launch); the graphs and recorded launches of the previous one are dropped. In
        persistent mode (options.decode_mode) the one-kernel step, unless it cannot run here:
        then the per-operator step, said once, and the option reads per_op."""
        self.decode_step = None
        if self.options.decode_mode == "persistent":
            from .persistent_step import PersistentStep, PersistentUnavailable
            try:
                self.decode_step = PersistentStep(
                    self.cfg, self.layers, self.embed, self.lm_head_w, self.final_norm, self.io, self.state,
                    max_context=self.options.max_context, valid_vocab=self.valid_vocab,
                    split_k=self.options.split_k, sm_count=self._sms, launcher=self.launcher,
                    plan_overrides=self.plan_overrides.get("persistent"))
            except PersistentUnavailable as e:
                self.decode_mode_error = f"The persistent decode step cannot run here: {e}; decoding per operator."
                print(f"tritonchat: {self.decode_mode_error}", file=sys.stderr)
                self.options.decode_mode = "per_op"
        if self.decode_step is None:
            self.decode_step = DecodeStep(self.cfg, self.layers, self.embed, self.lm_head_w, self.final_norm,
                                          self.io, self.state, max_context=self.options.max_context,
                                          valid_vocab=self.valid_vocab, split_k=self.options.split_k,
                                          context_ranges=self.options.context_ranges, pdl=self._pdl,
                                          sm_count=self._sms, launcher=self.launcher,
                                          plan_overrides=self.plan_overrides)
        self.decode_step.set_sampler(*self._sampler)
        self._invalidate_graph()

    decode_mode_error: Optional[str] = None      # why persistent mode fell back, once it did

    def set_plans(self, overrides: dict) -> None:
        """Replace launch plans by key (decode_step.gemv_key(...), or "lm_head"); {} = the
        table's. For the in-step tuner and tests; the step is rebuilt (scratch sized anew)."""
        self.plan_overrides = dict(overrides)
        self._build_step()

    @property
    def split_k_note(self) -> str:
        """'' when the tuned plans split K somewhere on this GPU, else the sentence the
        settings and the timing panel show (split-K on and off then run the same step)."""
        if self._split_k_splits is None:
            step = self.decode_step if self.options.split_k else DecodeStep(
                self.cfg, self.layers, self.embed, self.lm_head_w, self.final_norm, self.io, self.state,
                max_context=self.options.max_context, valid_vocab=self.valid_vocab, split_k=True,
                context_ranges=False, pdl=self._pdl, sm_count=self._sms)
            self._split_k_splits = step.split_k_splits
        return "" if self._split_k_splits else "split-K: no shape splits on this GPU"

    _split_k_splits: Optional[list] = None

    # ------------------------------------------------------------------ context ranges ----
    # Some plans are faster only at short or long contexts (the decode table's `context_ranges`).
    # The host knows each step's position, so the step keeps one plan set per range of
    # positions, and the backend one captured graph per range, all captured together.
    def set_context_ranges(self, enabled: bool) -> None:
        """Use the table's per-context-range plans (the default) or its base plans at every
        position (one graph; what engine/tune_step.py tunes)."""
        if bool(enabled) != self.options.context_ranges:
            self.options.context_ranges = bool(enabled)
            self._build_step()

    def plan_range(self) -> Optional[dict]:
        """The context range whose kernel plans the next decode step runs (DecodeStep.range_info)."""
        return self.decode_step.range_info(self.state.length)

    @property
    def context_range_bounds(self) -> list[int]:
        """Positions at which the decode step changes plans (and graphs); [] for one range."""
        return self.decode_step.range_bounds

    def graph_for(self, pos: int):
        """The captured decode step that serves position `pos` (every range's captured first if
        needed), for tools that replay it from a position they put in pos_buf. Raises when
        capture fails."""
        self.decode_step.use_position(pos)
        if self._graphs is None:
            with torch.inference_mode():
                self._graphs = self._capture_ranges()
        self._graph = self._graphs[self.decode_step.range_index]
        return self._graph

    def _mutable(self) -> list:
        """What a decode step writes (restored around a graph capture's warm-up)."""
        st = self.state
        return [*st.conv.values(), *st.rec.values(), self.tok_buf, self.pos_buf, self.h, self.counts,
                self.rng_state]

    def _capture_ranges(self) -> list:
        return capture_ranges(self.decode_step, lambda: graph_mod.capture(self.decode_step, self._mutable(), l2=self))

    def _replay_graph(self) -> None:
        """One decode step through the CUDA graph of its context range, capturing the graphs
        first if needed; a failed capture says so once and decodes eagerly from then on."""
        if self._graphs is None:
            try:
                self._graphs = self._capture_ranges()
            except Exception as e:  # driver/memory trouble
                self.options.graph = False
                self._graphs = self._graph = None
                self.graph_error = (f"CUDA Graph capture failed ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0][:160]}); decoding without it.")
                print(f"tritonchat: {self.graph_error}", file=sys.stderr)
                self.decode_step()
                return
        self._graph = self._graphs[self.decode_step.range_index]
        self._graph.replay()

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

    def mark_prefilled(self) -> None:
        """The state, pos_buf and h were filled by hand (the bench's long-context runs): the
        next logits()/sample() runs the final norm and LM head on h."""
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
            self.decode_step.use_position(max(0, self.state.length - 1))
            with torch.inference_mode():
                self.decode_step.head()
            self._pending_head = False
        return self.logits_buf

    def begin_sampling(self, params: SamplingParams, history_ids: Sequence[int]) -> None:
        from tritonchat.kernels import sampling as S
        self._check_persistent_step()       # a persistent step switched on live: its first answer
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
        top = self.decode_step.top_k_max
        kc = top if p.is_greedy else sample_candidates(p.top_k, p.top_p, p.min_p, top)
        self._sampling_key = key
        self._sampler = (key == "sample", kc)
        if self.decode_step.set_sampler(*self._sampler):
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
        self.decode_step.use_position(self.state.length)
        with torch.inference_mode():
            if self._timer is not None and time.perf_counter() - self._last_timed >= self.timing_interval_s:
                self._timed_decode()
                self._last_timed = time.perf_counter()
            elif self.options.graph and self.device.type == "cuda":
                self._replay_graph()
            else:
                self._eager_step()
        self.state.length += 1
        self._pending_head = False

    def _eager_step(self) -> None:
        """One decode step without the graph: the range's recorded launches replayed from the
        host where there are some (launch_cache on, CUDA), else launched through Triton."""
        if not self.options.launch_cache or self.device.type != "cuda":
            self.decode_step()
            return
        rec = self._replays.get(self.decode_step.range_index)
        if rec is not None and rec.stream == torch.cuda.current_stream(self.device).cuda_stream:
            rec.replay()
            return
        if self.decode_step.range_index not in self._eager_ran:
            self._eager_ran.add(self.decode_step.range_index)
            self.decode_step()
            return
        from . import launch_replay
        rec, why = launch_replay.record(self.decode_step, self.device)
        if rec is None:
            # said once; eager decode launches through Triton from now on, and the option reads
            # off (as the L2 window's and the graph's do when they fail), so the stats say so
            self.launch_cache_error = why
            self.options.launch_cache = False
            print(f"tritonchat: the decode step's launches cannot be replayed ({why}); launching "
                  "them through Triton.", file=sys.stderr)
        else:
            self._replays[self.decode_step.range_index] = rec

    # ------------------------------------------------------------- what runs, for tools ----
    @property
    def graphs(self) -> Optional[list]:
        """The captured decode steps, one per context range (None until captured)."""
        return self._graphs

    @property
    def graph(self):
        """The captured decode step replayed last (None before the first replay)."""
        return self._graph

    @property
    def timed_graphs(self) -> Optional[list]:
        """The timed captures (graph, its events) per range, while the timing panel is open."""
        return self._timed_graphs

    @property
    def launch_recordings(self) -> dict:
        """{context range index: its recorded launches} of the graph-off decode path."""
        return self._replays

    @property
    def l2_set_aside(self) -> int:
        """Bytes of L2 set aside for persisting lines now (0: none)."""
        return self._l2_limit

    @property
    def prefill_graphs(self):
        """The prefill CUDA graphs (engine/triton_prefill.py PrefillGraphs), None until used."""
        return self._prefill_graphs

    @property
    def launch_replay_active(self) -> bool:
        """Whether eager decode steps replay recorded launches now (graph off, cache on, CUDA,
        the current range recorded)."""
        return (self.options.launch_cache and not self.options.graph and self.device.type == "cuda"
                and self.decode_step.range_index in self._replays)

    def _capture_timed_graph(self) -> None:
        """The decode step with an event-record node between kernels (for the timing panel), one
        per context range, as the untimed ones."""
        t = self._timer

        def timed():
            t.events = []
            graph = graph_mod.capture(self.decode_step, self._mutable(), l2=self)
            return graph, list(t.events)                    # the events recorded into it

        self.launcher.timer = t
        try:
            self._timed_graphs = capture_ranges(self.decode_step, timed)
        except Exception:
            self._timed_graph_failed = True
        finally:
            self.launcher.timer = None

    def _timed_decode(self) -> None:
        """One decode step whose kernels are timed: replayed from a graph with an event-record node
        between launches (the kernels' GPU time inside the step, without host launch gaps), or
        eagerly with events when no graph can be captured (then launch gaps are included)."""
        t = self._timer
        if self.device.type != "cuda":
            self.decode_step()
            return
        if self._timed_graphs is None and not self._timed_graph_failed:
            self._capture_timed_graph()
        if self._timed_graphs is not None:
            graph, events = self._timed_graphs[self.decode_step.range_index]
            graph.replay()
            torch.cuda.synchronize(self.device)
            t.accumulate(events)
        else:
            t.events = []
            self.launcher.timer = t
            try:
                self.decode_step()
            finally:
                self.launcher.timer = None
            torch.cuda.synchronize(self.device)
            t.accumulate(t.events)

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
        self._check_persistent_step()

    def _check_persistent_step(self) -> None:
        """The persistent kernel's deadlock guard: a counter wait that ran out of time (its
        programs not all resident after all) lets the kernel finish with a flag set instead of
        hanging. Then its results cannot be trusted: decode per operator from now on, said once.
        Warm-up looks at the flag once its steps ran, and every answer before it samples (a
        step switched on in the settings between answers is caught after its first answer)."""
        step = self.decode_step
        if self.options.decode_mode != "persistent" or not step.errored():
            return
        self.decode_mode_error = ("The persistent decode step timed out waiting for its own programs on "
                                  "this GPU; decoding per operator.")
        print(f"tritonchat: {self.decode_mode_error}", file=sys.stderr)
        self.options.decode_mode = "per_op"
        self._build_step()

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
            # else): docs/performance.md
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

    def configure(self, decode_mode: Optional[str] = None, **switches: bool) -> None:
        if decode_mode is not None and decode_mode != self.options.decode_mode:
            from dataclasses import replace
            replace(self.options, decode_mode=decode_mode).validate()
            self.options.decode_mode = decode_mode
            self.decode_mode_error = None
            self._split_k_splits = None
            self._build_step()
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
            self._build_step()
        if launch_cache is not None and bool(launch_cache) != self.options.launch_cache:
            self.options.launch_cache = bool(launch_cache)
            self._drop_replays()
            self.launch_cache_error = None
        if split_k is not None and bool(split_k) != self.options.split_k:
            self.options.split_k = bool(split_k)
            self._build_step()
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
            self._timer = KernelTimer() if timing else None
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
        self._split_k_splits = None

    def set_max_context(self, n: int) -> None:
        self._drain()
        self._invalidate_graph()
        del self.state
        torch.cuda.empty_cache() if self.device.type == "cuda" else None
        self._allocate(int(n))

    def kernel_timings(self) -> Optional[list[dict]]:
        return self._timer.rows() if self._timer is not None else None

    def reset_timings(self) -> None:
        if self._timer is not None:
            self._timer = KernelTimer()

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
