"""Plain data passed between the engine, the CLI and the app (no torch, no Qt)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class SamplingParams:
    """How the next token is chosen. greedy=True (or temperature == 0) means argmax."""

    temperature: float = 1.0
    top_k: int = 20            # 0 = off
    top_p: float = 1.0         # 1.0 = off
    min_p: float = 0.0         # 0.0 = off
    presence_penalty: float = 0.0      # subtracted once from logits of every token already generated
    repetition_penalty: float = 1.0    # HF style: logit/r if > 0 else logit*r, over prompt + generated
    seed: Optional[int] = None
    greedy: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature <= 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineOptions:
    """How the engine is built. Switchable at run time: split_k, graph, timing, l2_state,
    context_ranges, launch_cache."""

    backend: str = "reference"      # "reference" | "triton"
    device: str = "cpu"             # "cpu" | "cuda"
    dtype: str = "float32"          # "bfloat16" | "float16" | "float32"
    max_context: int = 32768
    split_k: bool = True
    graph: bool = True
    timing: bool = False            # per-kernel GPU timing (Triton backend only)
    l2_state: bool = True           # GDN states kept in a persisting L2 window (graph decode, CUDA)
    context_ranges: bool = True     # the decode table's plans per range of positions (Triton)
    launch_cache: bool = True       # graph off: replay the step's recorded launches (Triton, CUDA)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_ms: float = 0.0            # from the call to the first sampled token available on the host
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0       # tokens after the first / time after the first
    decode_ms_per_token: float = 0.0
    total_ms: float = 0.0
    stop_reason: str = ""           # "eos" | "max_tokens" | "context_full" | "stopped"
    cached_tokens: int = 0          # prompt tokens reused from the cache (not prefilled again)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)   # new tokens only (stop token excluded)
    text: str = ""
    stats: GenerationStats = field(default_factory=GenerationStats)
    engine: dict = field(default_factory=dict)           # EngineOptions.to_dict() it ran with

    def to_dict(self) -> dict:
        d = {"token_ids": self.token_ids, "text": self.text}
        d.update(self.stats.to_dict())
        d.update({k: v for k, v in self.engine.items()})
        return d
