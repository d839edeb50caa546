"""What a generation returns, passed between the engine, the CLI and the app (no torch, no Qt).

The options going in are in engine/options.py."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
