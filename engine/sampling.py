"""Next-token selection in PyTorch (the reference backend, and the oracle of the GPU sampler).

Order, as in Hugging Face's logits processors: padded vocabulary rows masked; repetition penalty
(prompt + generated: logit / r if > 0 else logit * r); presence penalty (generated tokens only:
logit - p once per distinct token); temperature; top-k; top-p (smallest set whose probability
reaches p, at least one token); min-p (keep probs >= min_p * max prob); then a draw.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .options import SamplingParams


class TokenHistory:
    """Which tokens appeared in the prompt and which were generated (for the penalties)."""

    def __init__(self, vocab_size: int, prompt_ids: Sequence[int], device):
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)        # prompt + generated
        self.generated = torch.zeros(vocab_size, dtype=torch.bool, device=device)   # generated only
        if len(prompt_ids):
            ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device)
            self.seen[ids.clamp(0, vocab_size - 1)] = True

    def add(self, token_id: int) -> None:
        self.seen[token_id] = True
        self.generated[token_id] = True


def processed_logits(logits: torch.Tensor, params: SamplingParams, history: Optional[TokenHistory],
                     valid_vocab: int) -> torch.Tensor:
    """float32 logits after masking, penalties and temperature (the values top-k/p act on)."""
    x = logits.float().clone()
    x[valid_vocab:] = float("-inf")
    if history is not None:
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            sel = x[history.seen]
            x[history.seen] = torch.where(sel > 0, sel / r, sel * r)
        if params.presence_penalty != 0.0:
            x[history.generated] -= params.presence_penalty
    if not params.is_greedy:
        x = x / params.temperature
    return x


def filtered_probs(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after top-k, top-p and min-p (renormalised)."""
    probs = torch.softmax(x, dim=-1)
    keep = torch.isfinite(x)
    if params.top_k and params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        keep &= x >= kth
    if params.top_p < 1.0:
        p = torch.where(keep, probs, torch.zeros_like(probs))
        p = p / p.sum()
        sorted_p, order = torch.sort(p, descending=True)
        before = torch.cumsum(sorted_p, 0) - sorted_p          # mass strictly before each token
        keep_sorted = before < params.top_p
        keep_sorted[0] = True
        keep_top_p = torch.zeros_like(keep)
        keep_top_p[order] = keep_sorted
        keep &= keep_top_p
    if params.min_p > 0.0:
        p = torch.where(keep, probs, torch.zeros_like(probs))
        keep &= p >= params.min_p * p.max()
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def sample_next(logits: torch.Tensor, params: SamplingParams, history: Optional[TokenHistory],
                valid_vocab: int, generator: Optional[torch.Generator] = None) -> int:
    x = processed_logits(logits, params, history, valid_vocab)
    if params.is_greedy:
        return int(torch.argmax(x).item())
    probs = filtered_probs(x, params)
    return int(torch.multinomial(probs, 1, generator=generator).item())
