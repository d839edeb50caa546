"""A chat session: tokenizer + chat template + backend + generation loop, Qt-free.

The desktop app's worker thread is a thin adapter over this class, and the CLI's `chat` uses it
too, so what the app measures is what `tritonchat bench` measures.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .api import GenerationResult
from .options import EngineOptions, SamplingParams
from .backend import Backend
from .errors import ContextFullError
from .generation import Generator
from .loader import load_backend
from .options import cuda_available
from .thinking import ThinkingSplitter
from .tokenizer import ChatTokenizer


@dataclass
class Reply:
    thinking: str
    answer: str
    thinking_seconds: float
    result: GenerationResult


def sampling_defaults(generation_config: dict) -> SamplingParams:
    """The checkpoint's recommended sampling (generation_config.json), else the 0.8B card's."""
    g = generation_config or {}
    p = SamplingParams(temperature=1.0, top_k=20, top_p=1.0, min_p=0.0, presence_penalty=0.0,
                       repetition_penalty=1.0)
    for key in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
        if isinstance(g.get(key), (int, float)):
            setattr(p, key, float(g[key]))
    if isinstance(g.get("top_k"), int):
        p.top_k = int(g["top_k"])
    if g.get("do_sample") is False:
        p.greedy = True
    return p


class ChatSession:
    def __init__(self, backend: Backend, tokenizer: ChatTokenizer, model_dir: Optional[Path] = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_dir = Path(model_dir) if model_dir else None
        self.generator = Generator(backend, tokenizer.stop_ids)
        self.generation_defaults = sampling_defaults(tokenizer.generation_config)
        self._roofline: Optional[dict] = None

    @classmethod
    def load(cls, model_dir, options: EngineOptions,
             progress: Optional[Callable[[str, float], None]] = None) -> "ChatSession":
        from .errors import ModelFilesError
        if not Path(model_dir).is_dir():
            raise ModelFilesError(f"Model folder {model_dir} does not exist.")
        tokenizer = ChatTokenizer.from_dir(model_dir)
        _, backend = load_backend(model_dir, options, valid_vocab=tokenizer.vocab_size, progress=progress)
        if getattr(backend, "device", None) is not None and backend.device.type == "cuda" \
                and hasattr(backend, "warm_up"):
            backend.warm_up(progress)          # compile + capture now, not in the first answer
        return cls(backend, tokenizer, model_dir)

    # ---- information ----
    @property
    def options(self) -> EngineOptions:
        return self.backend.options

    def capabilities(self) -> dict:
        cuda = cuda_available()
        triton = self.backend.name == "triton"
        if triton:
            reason = ""
        elif not cuda:
            reason = "No CUDA GPU: the reference engine runs on the CPU, and split-K / CUDA Graph need the Triton backend on a GPU."
        else:
            reason = "The reference backend is running; split-K and CUDA Graph belong to the Triton backend."
        name = ""
        if cuda:
            import torch
            name = torch.cuda.get_device_name(0)
        return {"triton": triton, "cuda": cuda, "device_name": name, "reason": reason}

    def count_tokens(self, messages: list[dict], enable_thinking: bool) -> int:
        return len(self.tokenizer.encode_chat(messages, add_generation_prompt=True, enable_thinking=enable_thinking))

    def kernel_timings(self) -> Optional[list[dict]]:
        return self.backend.kernel_timings()

    def plan_range(self) -> Optional[dict]:
        return self.backend.plan_range()

    def roofline(self) -> Optional[dict]:
        return self._roofline

    def memory_info(self) -> dict:
        return self.backend.memory_info()

    # ---- switches ----
    def configure(self, **switches: bool) -> None:
        """Switches of EngineOptions (options.switch_fields) applied without a reload."""
        self.backend.configure(**switches)
        timing = switches.get("timing")
        if timing and self._roofline is None and getattr(self.backend, "measure_roofline", None):
            self._roofline = self.backend.measure_roofline()

    def set_max_context(self, n: int) -> None:
        if n == self.backend.options.max_context:
            return
        set_ctx = getattr(self.backend, "set_max_context", None)
        if set_ctx is None:
            raise ValueError("this backend cannot change its context length")
        set_ctx(int(n))
        self.generator.forget()

    def reset(self) -> None:
        self.generator.forget()

    # ---- one reply ----
    def generate(self, messages: list[dict], params: SamplingParams, *, max_new_tokens: int,
                 enable_thinking: bool, stop_event: Optional[threading.Event] = None,
                 on_text: Optional[Callable[[str, str], None]] = None,
                 on_stats: Optional[Callable[[dict], None]] = None,
                 text_interval_s: float = 0.03, stats_interval_s: float = 0.1,
                 ignore_eos: bool = False) -> Reply:
        tok = self.tokenizer
        prompt = tok.encode_chat(messages, add_generation_prompt=True, enable_thinking=enable_thinking)
        history = tok.encode_chat(messages, add_generation_prompt=False, enable_thinking=enable_thinking)
        split_at = len(history) if prompt[: len(history)] == history else None
        max_ctx = self.backend.max_context
        if len(prompt) >= max_ctx:
            raise ContextFullError(
                f"This conversation is {len(prompt)} tokens long but the context holds {max_ctx}; "
                "start a new chat or raise the context length in Settings.")

        decoder = tok.stream_decoder()
        splitter = ThinkingSplitter(tok.opens_thinking(enable_thinking))
        pending = ["", ""]
        clock = {"text": time.perf_counter(), "stats": time.perf_counter(), "first": None,
                 "think_start": None, "think_end": None, "n": 0}
        t_start = time.perf_counter()

        def emit_text() -> None:
            if on_text and (pending[0] or pending[1]):
                on_text(pending[0], pending[1])
            pending[0] = pending[1] = ""

        def stats_payload(now: float) -> dict:
            n = clock["n"]
            first = clock["first"]
            tok_s = (n - 1) / (now - first) if first is not None and n > 1 and now > first else 0.0
            return {"new_tokens": n, "decode_tok_s": tok_s,
                    "ttft_ms": (first - t_start) * 1e3 if first is not None else None,
                    "context_tokens": len(prompt) + n, "max_context": max_ctx,
                    "kernels": self.backend.kernel_timings() if self.backend.options.timing else None}

        def on_token(token_id: int) -> None:
            now = time.perf_counter()
            if clock["first"] is None:
                clock["first"] = now
            clock["n"] += 1
            text = decoder.push(token_id)
            if text:
                th, an = splitter.push(text)
                if th and clock["think_start"] is None:
                    clock["think_start"] = now
                if an and clock["think_start"] is not None and clock["think_end"] is None:
                    clock["think_end"] = now
                pending[0] += th
                pending[1] += an
            if now - clock["text"] >= text_interval_s:
                emit_text()
                clock["text"] = now
            if on_stats and now - clock["stats"] >= stats_interval_s:
                on_stats(stats_payload(now))
                clock["stats"] = now

        result = self.generator.generate(prompt, params, max_new_tokens=max_new_tokens, stop_event=stop_event,
                                         ignore_eos=ignore_eos, on_token=on_token, split_at=split_at)
        tail = decoder.flush()
        th, an = splitter.push(tail) if tail else ("", "")
        th2, an2 = splitter.flush()
        pending[0] += th + th2
        pending[1] += an + an2
        now = time.perf_counter()
        if clock["think_start"] is not None and clock["think_end"] is None:
            clock["think_end"] = now
        emit_text()
        if on_stats:
            on_stats(stats_payload(now))
        result.text = tok.decode(result.token_ids)
        think_s = (clock["think_end"] - clock["think_start"]) if clock["think_start"] is not None else 0.0
        return Reply(thinking=splitter.thinking, answer=splitter.answer, thinking_seconds=think_s, result=result)

    def close(self) -> None:
        self.backend.close()
