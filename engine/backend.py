"""The interface every inference backend implements (reference PyTorch, Triton).

A backend owns the weights and the state of ONE conversation (KV cache, GDN conv and recurrent
states, current length). The generation loop (engine/generation.py) drives it:

    backend.reset()                       # or keep the cache and prefill only new tokens
    backend.prefill(ids)                  # appends ids to the state, computes last-position logits
    backend.begin_sampling(params, history_ids)
    tok = backend.sample()                # picks the next token from the last logits (host int)
    while ...:
        tok = backend.step(tok)           # decode(tok) + sample(): one token in, next token out

State layouts shared by all backends (so a prefill on one path hands over to another):
    KV cache, per full-attention layer:   k, v  [num_kv_heads, max_context, head_dim]  model dtype
    GDN conv state, per linear layer:     [conv_dim, conv_kernel - 1]  model dtype (oldest first)
    GDN recurrent state, per linear layer:[num_v_heads, key_head_dim, value_head_dim]  float32
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

from .options import EngineOptions, SamplingParams, check_switches


class Backend(ABC):
    name: str = "?"
    options: EngineOptions
    notes: tuple = ()           # sentences about options turned off at start (engine/compat.py)

    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens currently held in the state (the next token's position)."""

    @property
    def max_context(self) -> int:
        return self.options.max_context

    @abstractmethod
    def reset(self) -> None:
        """Forget the conversation: length 0, states zero."""

    @abstractmethod
    def prefill(self, ids: Sequence[int]) -> None:
        """Append ids (positions length..length+T-1) and compute the logits of the last one."""

    @abstractmethod
    def decode(self, token_id: int) -> None:
        """Append one token and compute its logits."""

    @abstractmethod
    def logits(self):
        """float32 logits [vocab_size] of the last position (padded rows included)."""

    @abstractmethod
    def begin_sampling(self, params: SamplingParams, history_ids: Sequence[int]) -> None:
        """Set the sampler for the next sample()/step() calls (penalties see history_ids)."""

    @abstractmethod
    def sample(self) -> int:
        """Choose the next token from the last logits; updates penalty counts."""

    def step(self, token_id: int) -> int:
        """decode(token_id) then sample(); a backend may fuse both (CUDA graph)."""
        self.decode(token_id)
        return self.sample()

    def launch_step(self, token_id: int) -> None:
        """Start step(token_id) without waiting for its result (finish_step() returns it), so
        the host can detokenize and call back while the GPU computes. Default: synchronous."""
        self._launched = self.step(token_id)

    def finish_step(self) -> int:
        """The token of the oldest step started by launch_step / launch_next."""
        return self._launched

    def launch_next(self) -> bool:
        """Queue the decode step after the one in flight, on the token that step produces
        (it never leaves the device), so the device never waits for the host between steps;
        finish_step() then returns the tokens in order. False (nothing queued) when the
        backend cannot: the default."""
        return False

    # --- multi-turn snapshots (GDN states cannot rewind, so they are copied) ---
    def snapshot(self):
        """An opaque copy of the state that restore() brings back."""
        raise NotImplementedError

    def restore(self, snap) -> None:
        raise NotImplementedError

    # --- switches and measurement (Triton backend; the reference has none) ---
    def configure(self, **switches: bool) -> None:
        """Apply run-time switches (fields of EngineOptions, see options.switch_fields); call on
        the thread that owns the backend. The reference backend records them and runs the same."""
        for name, on in check_switches(switches).items():
            setattr(self.options, name, on)

    def kernel_timings(self) -> Optional[list[dict]]:
        """Per-kernel table of the last timed steps, or None when timing is off / unsupported.
        Rows: {name, launches_per_token, us_per_token, share, gb_s}."""
        return None

    def plan_range(self) -> Optional[dict]:
        """The context range whose kernel plans the next decode step runs, where the backend
        keeps plans per range of positions (the Triton backend: {index, count, start, below,
        tuned}); None otherwise."""
        return None

    def memory_info(self) -> dict:
        """{'allocated_bytes':..., 'reserved_bytes':..., 'total_bytes':...} on GPU; {} on CPU."""
        device = getattr(self, "device", None)
        if device is None or device.type != "cuda":
            return {}
        import torch
        free, total = torch.cuda.mem_get_info(device)
        return {"allocated_bytes": torch.cuda.memory_allocated(device),
                "reserved_bytes": torch.cuda.memory_reserved(device), "total_bytes": total}

    def close(self) -> None:
        """Free device memory."""
