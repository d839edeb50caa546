"""The decode step as ONE persistent kernel (kernels/persistent_step.py): the engine's other
decode mode beside engine/decode_step.py's per-operator launches (options.decode_mode).

    persistent   one launch: every operator of the step on a grid of co-resident programs,
                 ordered by counters, each operator's first weights fetched before its wait
    phase        one launch per operator, the same task code, no spinning: what runs under the
                 Triton interpreter (CPU), and the head alone after a prefill on the GPU
    sampled      the LM-head operator leaves fp32 logits, and kernels/sampling.py's
                 sample_from_logits draws the token after the kernel (inside the same graph)

`PersistentStep` answers what the backend asks of a DecodeStep (call, head, set_sampler, the
context-range interface with one range, the launcher's timer). At construction it plans the
tasks, builds the address table of every layer's weights and states and the fp32 table of the
small vectors, and on the GPU checks that the grid fits the SMs at once (compiling the kernel
without launching it); when it cannot, it raises PersistentUnavailable and the backend falls
back to the per-operator step.

Timing: the kernel stamps %globaltimer at each operator's start and end, per program. Under a
KernelTimer the step hands the timer one (name, bytes, start, end) record per operator whose
marks read those stamps (an operator's time: from the previous operator's last end to its own
last end, so the rows add up to the step), in the shape of the per-kernel CUDA events, so the
timing panel and the bench show per-operator time and GB/s as for the per-operator step.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from tritonchat.kernels import persistent_step as K
from tritonchat.kernels import sampling as S
from tritonchat.kernels._persistent import programs_per_sm
from tritonchat.kernels.attention_decode import LOG2E

from .config import TextConfig
from .decode_step import (TOP_K_MAX, TOP_K_MAX_INTERPRETER, GdnWeights, Launcher, LayerWeights,
                          StepIO)
from .reference import ModelState

SPIN_TIMEOUT_NS = 2_000_000_000     # a wait this long sets the error flag (a deadlock guard)
CPU_GRID = 3                        # programs of the phase form under the interpreter


class PersistentUnavailable(RuntimeError):
    """The persistent step cannot run here (the message says why, in one sentence)."""


class _StampMark:
    """One end of an operator's time in the timer's records: `elapsed_time(end)` in ms, as a
    CUDA event's, read from the kernel's stamps (once per step, at the first operator)."""

    def __init__(self, step: "PersistentStep", q: int):
        self.step, self.q = step, q

    def elapsed_time(self, end: "_StampMark") -> float:
        if self.q == 0:
            self.step._read_stamps()
        return self.step._op_ns[self.q] / 1e6


class PersistentStep:
    """token in io.tok at position io.pos -> the next token in io.tok, io.pos + 1, in one
    persistent launch (phase=True: one launch per operator). Arguments as DecodeStep's;
    `plan_overrides` replaces the grid's programs per SM and the tile sizes
    (kernels.persistent_step.step_plan's names). On the CPU the phase form runs on CPU_GRID
    programs and the persistent form on one. The kernel reaches the weights and the states
    through their addresses, taken here: the engine updates states in place (prefill,
    snapshots, reset), never by replacing a tensor."""

    def __init__(self, cfg: TextConfig, layers: list[LayerWeights], embed: torch.Tensor,
                 lm_head: torch.Tensor, final_norm: torch.Tensor, io: StepIO, state: ModelState,
                 *, max_context: int, valid_vocab: int, split_k: bool, sm_count: int,
                 launcher: Optional[Launcher] = None, phase: Optional[bool] = None,
                 plan_overrides: Optional[dict] = None):
        self.cfg, self.layers, self.io, self.state = cfg, layers, io, state
        self.device = io.h.device
        self.launch = launcher or Launcher()
        cuda = self.device.type == "cuda"
        self.phase = (not cuda) if phase is None else bool(phase)
        self.max_context, self.valid_vocab = max_context, valid_vocab
        self.sampled, self.candidates = False, 0
        self.top_k_max = TOP_K_MAX if cuda else TOP_K_MAX_INTERPRETER
        self.sample_scratch = torch.zeros(S.sample_scratch_numel(cfg.vocab_size, self.top_k_max),
                                          device=self.device, dtype=torch.int64)
        self.dims = dict(D=cfg.hidden_size, I=cfg.intermediate_size, V=lm_head.shape[0],
                         HK=cfg.linear_num_key_heads, HV=cfg.linear_num_value_heads,
                         DK=cfg.linear_key_head_dim, DV=cfg.linear_value_head_dim,
                         KW=cfg.linear_conv_kernel_dim, H=cfg.num_attention_heads,
                         KV=cfg.num_key_value_heads, HD=cfg.head_dim, ROT=cfg.rotary_dim)
        overrides = dict(plan_overrides or {})
        if not cuda:
            overrides.setdefault("programs_per_sm", 1)
        # the interpreter runs programs one after another: the phase form on CPU_GRID of them,
        # the persistent form only on one (its own counts satisfy its waits)
        self.plan = K.step_plan(self.dims, sm_count=sm_count if cuda else CPU_GRID if self.phase else 1,
                                max_context=max_context, split_k=split_k, overrides=overrides)
        self.grid = self.plan["grid"]
        self._tables(embed, lm_head, final_norm)
        self._buffers()
        # one plan for every position: the context-range interface with one range
        self.ranges: list = [(None, {})]
        self.range_index = 0
        self.split_k_splits = sorted(K.OP_NAMES[op] for op, key in
                                     ((K.OP_GDN_OUT, "KS_O"), (K.OP_ATT_O, "KS_AO"),
                                      (K.OP_MLP_DOWN, "KS_D")) if self.plan[key] > 1)
        self.occupancy = None
        if cuda and not self.phase:
            self.occupancy = self._check_occupancy()

    # ------------------------------------------------------------------ the tables ----
    def _tables(self, embed, lm_head, final_norm) -> None:
        """The address table (N_SLOTS per layer), the fp32 small-vector table, the layer kinds
        and each layer's first operator; the operator list [(q, op kind, layer)]."""
        d, dev = self.dims, self.device
        act = self.io.h.dtype
        D = d["D"]
        sp_n = 2 * D + max(2 * d["HV"] + d["DV"], 2 * d["HD"])
        lw = torch.zeros(len(self.layers), K.N_SLOTS, dtype=torch.int64)
        sp = torch.zeros(len(self.layers), sp_n, dtype=torch.float32)
        kinds, q0s = [], []
        self.ops: list[tuple[int, int, int]] = [(0, K.OP_EMBED, -1)]
        aligned = True
        keep = []                                   # the tensors the table points at

        def put(i, slot, t, dtype):
            nonlocal aligned
            if t.dtype != dtype or not t.is_contiguous():
                raise PersistentUnavailable(f"layer {i}: a {tuple(t.shape)} {t.dtype} tensor where "
                                            f"the persistent step needs contiguous {dtype}")
            lw[i, slot] = t.data_ptr()
            aligned = aligned and t.data_ptr() % 16 == 0
            keep.append(t)

        for i, layer in enumerate(self.layers):
            m = layer.mixer
            sp[i, :D] = layer.input_norm.float()
            sp[i, D:2 * D] = layer.post_norm.float()
            put(i, K.SLOT_GATE_UP, layer.gate_up, act)
            put(i, K.SLOT_DOWN, layer.down, act)
            q0s.append(self.ops[-1][0] + 1)
            if isinstance(m, GdnWeights):
                kinds.append(K.KIND_GDN)
                put(i, K.SLOT_W_IN, m.qkvbaz, act)
                put(i, K.SLOT_CONV_W, m.conv_w, act)
                put(i, K.SLOT_CONV, self.state.conv[i], act)
                put(i, K.SLOT_REC, self.state.rec[i], torch.float32)
                put(i, K.SLOT_OUT, m.out_proj, act)
                hv = d["HV"]
                sp[i, 2 * D:2 * D + hv] = m.A_log.float()
                sp[i, 2 * D + hv:2 * D + 2 * hv] = m.dt_bias.float()
                sp[i, 2 * D + 2 * hv:2 * D + 2 * hv + d["DV"]] = m.norm_w.float()
                mixer_ops = K.GDN_OPS
            else:
                kinds.append(K.KIND_ATTENTION)
                kc, vc = self.state.kv[i]
                put(i, K.SLOT_W_IN, m.qkv, act)
                put(i, K.SLOT_CONV_W, kc, act)
                put(i, K.SLOT_CONV, vc, act)
                put(i, K.SLOT_OUT, m.o_proj, act)
                sp[i, 2 * D:2 * D + d["HD"]] = m.q_norm.float()
                sp[i, 2 * D + d["HD"]:2 * D + 2 * d["HD"]] = m.k_norm.float()
                mixer_ops = K.ATT_OPS
            for op in mixer_ops + K.MLP_OPS:
                self.ops.append((self.ops[-1][0] + 1, op, i))
        self.q_lm = self.ops[-1][0] + 1
        self.ops.append((self.q_lm, K.OP_LM_HEAD, -1))
        self.ops.append((self.q_lm + 1, K.OP_ARGMAX, -1))
        for t, dtype in ((embed, act), (lm_head, act)):
            if t.dtype != dtype or not t.is_contiguous():
                raise PersistentUnavailable("the embedding and LM head must be contiguous "
                                            "in the activation dtype")
        self._keep = keep + [embed, lm_head]
        self.embed_w, self.lm_head_w = embed, lm_head
        self.final_norm = final_norm.float().contiguous()
        self.lw = lw.to(dev)
        self.sp = sp.to(dev)
        self.kinds = torch.tensor(kinds, dtype=torch.int32, device=dev)
        self.q0s = torch.tensor(q0s, dtype=torch.int32, device=dev)
        self.sp_numel = sp_n
        self.aligned = aligned and all(t.data_ptr() % 16 == 0 for t in (embed, lm_head))

    def _buffers(self) -> None:
        """Activations, scratch, counters, epochs and stamps (allocated once); the kernel's
        arguments and constexprs."""
        cfg, d, io, dev, G = self.cfg, self.dims, self.io, self.device, self.grid
        z = lambda n, dtype=io.h.dtype: torch.zeros(n, device=dev, dtype=dtype)  # noqa: E731
        H, KV, hd = d["H"], d["KV"], d["HD"]
        self.gdn_proj = z(cfg.conv_dim + 2 * d["HV"])
        self.gdn_z = z(cfg.linear_value_dim)
        self.gdn_out = z(cfg.linear_value_dim)
        self.attn_proj = z(2 * H * hd + 2 * KV * hd)
        self.attn_out = z(H * hd)
        self.act = z(d["I"])
        sc = K.scratch_sizes(d, self.plan)
        self.attn_part = z(sc["part"], torch.float32)
        self.kpart = z(sc["kpart"], torch.float32)
        self.tick = z(sc["tick"], torch.int32)
        self.keys = z(sc["keys"], torch.int64)
        n_ops = self.q_lm + 2
        self.n_stamp = 2 * n_ops
        self.cnt = z(n_ops, torch.int32)
        self.epoch = z(G, torch.int32)
        self.err = z(1, torch.int32)
        self.stamps = z(G * self.n_stamp, torch.int64)
        self.stall_rec = z(4, torch.int64)
        counts = io.counts
        self.args = dict(
            h_ptr=io.h, proj_ptr=self.gdn_proj, z_ptr=self.gdn_z, o_ptr=self.gdn_out,
            qg_ptr=self.attn_proj, part_ptr=self.attn_part, attn_ptr=self.attn_out,
            act_ptr=self.act, logits_ptr=io.logits, keys_ptr=self.keys, kpart_ptr=self.kpart,
            tick_ptr=self.tick, tok_ptr=io.tok, pos_ptr=io.pos, ring_ptr=io.tok_ring,
            counts_ptr=counts, emb_ptr=self.embed_w, fn_ptr=self.final_norm, lm_ptr=self.lm_head_w,
            lw_ptr=self.lw, sp_ptr=self.sp, kind_ptr=self.kinds, q0_ptr=self.q0s,
            cnt_ptr=self.cnt, epoch_ptr=self.epoch, err_ptr=self.err, stamp_ptr=self.stamps,
            stall_rec_ptr=self.stall_rec, G=G, q_lm=self.q_lm, eps=float(cfg.rms_norm_eps),
            q_scale=float(d["DK"]) ** -0.5, qk_scale_log2=float(d["HD"]) ** -0.5 * LOG2E,
            freq_log2_step=-2.0 * math.log2(float(cfg.rope_theta)) / d["ROT"],
            max_ctx=self.max_context,
            valid_vocab=int(self.valid_vocab),
            row_offset=counts.shape[-1] if counts.dim() == 2 else 0,
            stall_op=-1, stall_ns=0, timeout_ns=SPIN_TIMEOUT_NS, n_stamp=self.n_stamp)
        p = {k: v for k, v in self.plan.items() if k not in ("grid", "programs_per_sm")}
        self.num_warps = p.pop("num_warps")
        kv_dtype = next(iter(self.state.kv.values()))[0].dtype if self.state.kv else io.h.dtype
        self.meta = dict(
            NL=len(self.layers), **{k: d[k] for k in ("D", "I", "V", "HK", "HV", "DK", "DV", "KW",
                                                      "H", "KV", "HD", "ROT")},
            SP=self.sp_numel, **p, RING=io.tok_ring.numel(), ALIGN=self.aligned,
            DOT_PRECISION="ieee" if kv_dtype == torch.float32 else None, SPIN=0, STALL=False,
            STAMP=self.device.type == "cuda", num_warps=self.num_warps)
        self._op_ns = [0.0] * n_ops

    def _check_occupancy(self) -> dict:
        """Compile the persistent kernel without launching it and check that the grid's
        programs fit the SMs at once (a grid that does not would deadlock)."""
        ppsm = self.plan["programs_per_sm"]
        try:
            compiled = K._step_kernel.warmup(**self.args, phase_layer=0, PHASE=K.PERSISTENT,
                                             SAMPLED=False, ADVANCE=True, grid=(self.grid,),
                                             **self.meta)
            occ = programs_per_sm(compiled, self.num_warps, self.device)
        except Exception as e:
            raise PersistentUnavailable(f"the persistent kernel did not compile "
                                        f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
        if occ["programs_per_sm_max"] < ppsm:
            raise PersistentUnavailable(
                f"its grid of {self.grid} programs ({ppsm} an SM) cannot be resident at once: "
                f"{occ['programs_per_sm_max']} fit an SM (registers {occ['regs']}, shared memory "
                f"{occ['shared']} B)")
        return dict(occ, grid=self.grid, programs_per_sm=ppsm)

    # -------------------------------------------------------------------- the step ----
    def __call__(self) -> None:
        if self.phase:
            for _, op, layer in self.ops:
                if op != K.OP_ARGMAX or not self.sampled:
                    self._phase(op, layer, advance=True)
        else:
            t = self.launch.timer
            self.launch.timer = None           # timed by its stamps, per operator
            try:
                self.launch("persistent_decode_step", self._step_bytes(), K.launch, self.args,
                            dict(self.meta, SAMPLED=self.sampled, ADVANCE=True), self.grid,
                            phase=K.PERSISTENT)
            finally:
                self.launch.timer = t
            if t is not None:
                t.events.extend(self.timer_records())
        if self.sampled:
            self._sample(advance=True)

    def head(self, advance: bool = False) -> None:
        """Final norm, LM head and the next token into io.tok (counted for the penalties; with
        `advance` also io.pos += 1): the head's operators, one launch each."""
        for _, op, layer in self.ops[-2:]:
            if op != K.OP_ARGMAX or not self.sampled:
                self._phase(op, layer, advance=advance)
        if self.sampled:
            self._sample(advance=advance)

    def _phase(self, op: int, layer: int, advance: bool) -> None:
        self.launch(K.OP_NAMES[op], self._op_bytes(op, layer), K.launch, self.args,
                    dict(self.meta, SAMPLED=self.sampled, ADVANCE=advance, STAMP=False),
                    self.grid, phase=op, layer=max(layer, 0))

    def _sample(self, advance: bool) -> None:
        io = self.io
        pos, ring = (io.pos, io.tok_ring) if advance else (None, None)
        self.launch("sample", io.logits.numel() * 4, S.sample_from_logits, io.logits,
                    io.sampler_params, io.counts, io.rng_state, io.tok, self.sample_scratch,
                    valid_vocab=self.valid_vocab, top_k_max=self.candidates, count=True, pos=pos,
                    ring=ring)

    # ------------------------------------------------------------------ bytes, time ----
    def _op_bytes(self, op: int, layer: int) -> int:
        """What operator `op` of layer `layer` reads and writes (weights, states; the KV cache
        at the current length), for the GB/s of the timing rows."""
        es = self.io.h.element_size()
        d = self.dims
        D = d["D"]
        if op == K.OP_EMBED:
            return 2 * D * es
        if op == K.OP_LM_HEAD:
            return self.lm_head_w.numel() * es + d["V"] * 4          # E, and the fp32 logits
        if op == K.OP_ARGMAX:
            return self.grid * 8                                     # the programs' keys
        lw = self.layers[layer]
        m = lw.mixer
        if op == K.OP_GDN_IN:
            return m.qkvba.numel() * es + 2 * self.state.conv[layer].numel() * es
        if op == K.OP_GDN_CORE:
            return m.z_w.numel() * es + 2 * self.state.rec[layer].numel() * 4
        if op == K.OP_GDN_OUT:
            return m.out_proj.numel() * es
        if op == K.OP_ATT_QKV:
            return m.qkv.numel() * es
        if op == K.OP_ATT_CORE:
            return 2 * d["KV"] * d["HD"] * es * max(self.state.length, 1)
        if op == K.OP_ATT_MERGE:
            return self.attn_part.numel() * 4
        if op == K.OP_ATT_O:
            return m.o_proj.numel() * es
        if op == K.OP_MLP_GATE_UP:
            return lw.gate_up.numel() * es
        return lw.down.numel() * es

    def timer_records(self) -> list[tuple]:
        """A KernelTimer's (name, bytes, start, end) records of one persistent step, one per
        operator, whose marks read the step's stamps when the timer accumulates them."""
        return [(K.OP_NAMES[op], self._op_bytes(op, layer), _StampMark(self, q), _StampMark(self, q))
                for q, op, layer in self.ops if op != K.OP_ARGMAX or not self.sampled]

    def _step_bytes(self) -> int:
        return sum(self._op_bytes(op, layer) for _, op, layer in self.ops)

    def _read_stamps(self) -> None:
        """Each operator's time (ns) in the last step from the programs' stamps: its last end
        minus the previous operator's last end (the first: minus the earliest start)."""
        st = self.stamps.view(self.grid, -1, 2).to("cpu", torch.float64)
        ends = st[:, :, 1].max(dim=0).values
        prev = torch.cat([st[:, :1, 0].min(dim=0).values, ends[:-1]])
        self._op_ns = (ends - prev).clamp_min(0).tolist()

    def op_times_us(self) -> list[tuple[str, float]]:
        """(name, us) of each operator of the last persistent step, from its stamps."""
        self._read_stamps()
        return [(K.OP_NAMES[op] + (f"[{layer}]" if layer >= 0 else ""), self._op_ns[q] / 1e3)
                for q, op, layer in self.ops]

    def errored(self) -> bool:
        """Whether a wait timed out since the step was built (the deadlock guard fired)."""
        return int(self.err.item()) != 0

    # -------------------------------------------------------------------- sampler ----
    def set_sampler(self, sampled: bool, candidates: int) -> bool:
        """Argmax head, or the sampler with `candidates` top-k candidates; True if it changed
        (a captured graph of this step is stale)."""
        if (bool(sampled), int(candidates)) == (self.sampled, self.candidates):
            return False
        self.sampled, self.candidates = bool(sampled), int(candidates)
        return True

    # ------------------------------------------------------------- context ranges ----
    def use_position(self, pos: int) -> None:
        """One plan serves every position."""

    def use_range(self, i: int) -> None:
        self.range_index = 0

    @property
    def range_bounds(self) -> list[int]:
        return []

    def range_info(self, pos: int) -> Optional[dict]:
        return None
