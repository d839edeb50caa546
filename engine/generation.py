"""The generation loop: prefill (reusing the cached prefix), then one token per step until a stop
id, the token budget, the context end, or a stop request. Backend-agnostic; no Qt."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .api import GenerationResult, GenerationStats
from .options import SamplingParams, check_max_new_tokens
from .backend import Backend
from .errors import ContextFullError

MAX_SNAPSHOTS = 4


@dataclass
class _Snapshot:
    ids: list[int]
    state: object


class Generator:
    """Drives one backend and remembers which tokens its state holds, so a new prompt that
    extends them prefills only the new tokens; regenerate/edit restore a snapshot taken right
    after an earlier prompt (GDN states cannot rewind) instead of re-prefilling everything."""

    def __init__(self, backend: Backend, stop_ids: Sequence[int] = ()):
        self.backend = backend
        self.stop_ids = set(int(i) for i in stop_ids)
        self.cached_ids: list[int] = []          # tokens whose state the backend holds now
        self._snapshots: list[_Snapshot] = []
        self.snapshots_enabled = True

    # ---- cache bookkeeping ----
    def forget(self) -> None:
        self.backend.reset()
        self.cached_ids = []
        self._snapshots.clear()

    @staticmethod
    def _is_prefix(a: Sequence[int], b: Sequence[int]) -> bool:
        return len(a) <= len(b) and list(b[: len(a)]) == list(a)

    def _prepare(self, prompt: list[int]) -> int:
        """Bring the backend state to a prefix of `prompt`; return how many tokens are reused.
        At least the last prompt token is always prefilled (its logits are needed)."""
        if self.cached_ids and self._is_prefix(self.cached_ids, prompt) and len(self.cached_ids) < len(prompt):
            return len(self.cached_ids)
        best = None
        for s in self._snapshots:
            if len(s.ids) < len(prompt) and self._is_prefix(s.ids, prompt) and (best is None or len(s.ids) > len(best.ids)):
                best = s
        if best is not None:
            self.backend.restore(best.state)
            self.cached_ids = list(best.ids)
            # KV entries past this length will be overwritten: later snapshots are invalid
            self._snapshots = [s for s in self._snapshots if len(s.ids) <= len(best.ids)]
            return len(best.ids)
        self.backend.reset()
        self.cached_ids = []
        self._snapshots.clear()
        return 0

    def _remember(self, ids: list[int]) -> None:
        if not self.snapshots_enabled:
            return
        try:
            snap = self.backend.snapshot()
        except NotImplementedError:
            return
        self._snapshots = [s for s in self._snapshots if s.ids != ids][-(MAX_SNAPSHOTS - 1):]
        self._snapshots.append(_Snapshot(list(ids), snap))

    # ---- the loop ----
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, max_new_tokens: int,
                 stop_event: Optional[threading.Event] = None, ignore_eos: bool = False,
                 on_token: Optional[Callable[[int], None]] = None,
                 split_at: Optional[int] = None) -> GenerationResult:
        """split_at: where the generation prompt starts (the chat history before it is shared by
        the next turn, regenerate and edit); the state there is snapshotted for reuse."""
        params.validate()
        check_max_new_tokens(max_new_tokens)
        prompt = [int(i) for i in prompt_ids]
        be = self.backend
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= be.max_context:
            raise ContextFullError(
                f"The prompt has {len(prompt)} tokens but the context holds {be.max_context}; "
                "shorten it, start a new chat or raise the context length.")
        stats = GenerationStats(prompt_tokens=len(prompt))
        out: list[int] = []
        t0 = time.perf_counter()
        reused = self._prepare(prompt)
        stats.cached_tokens = reused
        try:
            if split_at is not None and reused < split_at < len(prompt):
                be.prefill(prompt[reused:split_at])
                self._remember(prompt[:split_at])
                be.prefill(prompt[split_at:])
            else:
                be.prefill(prompt[reused:])
        except Exception:
            self.forget()                      # a failed prefill leaves a half-written state
            raise
        self.cached_ids = list(prompt)
        self._remember(prompt)
        be.begin_sampling(params, prompt)
        tok = be.sample()
        t_first = time.perf_counter()
        stats.ttft_ms = (t_first - t0) * 1e3
        new_prefilled = len(prompt) - reused
        stats.prefill_tok_s = new_prefilled / max(t_first - t0, 1e-9)
        stop_reason = "max_tokens"
        steps = 0                                  # decode steps after the first token
        ahead = False                              # the step that consumes tok is already queued
        while True:
            if tok in self.stop_ids and not ignore_eos:
                stop_reason = "eos"
                break
            out.append(tok)
            if len(out) >= max_new_tokens:
                stop_reason = "max_tokens"
            elif stop_event is not None and stop_event.is_set():
                stop_reason = "stopped"
            elif not ahead and be.length >= be.max_context:
                stop_reason = "context_full"
            else:
                stop_reason = ""
                if not ahead:
                    be.launch_step(tok)       # the GPU decodes tok while the host streams it
                # and the step after it is queued at once, on the token the GPU is computing
                # (it stays on the device), so the GPU never waits for this loop: not for the
                # last token of the budget, nor past the context
                ahead = (len(out) + 1 < max_new_tokens and be.length < be.max_context
                         and be.launch_next())
            if on_token is not None:
                on_token(tok)
            if stop_reason:
                break
            nxt = be.finish_step()
            steps += 1
            self.cached_ids.append(out[-1])
            tok = nxt
            if stop_event is not None and stop_event.is_set():   # set while tok was streamed
                stop_reason = "stopped"
                break
        t_end = time.perf_counter()
        if ahead:
            # a step queued ahead consumed tok (an end-of-turn id, or the token after a stop
            # request), which is not shown: its own token is dropped, the state holds tok
            be.finish_step()
            self.cached_ids.append(tok)
        stats.new_tokens = len(out)
        stats.total_ms = (t_end - t0) * 1e3
        if steps > 0 and t_end > t_first:
            stats.decode_tok_s = steps / (t_end - t_first)
            stats.decode_ms_per_token = (t_end - t_first) * 1e3 / steps
        stats.stop_reason = stop_reason
        return GenerationResult(token_ids=out, stats=stats, engine=dict(be.options.to_dict(), backend=be.name))
