"""The PyTorch sampler on synthetic logits."""
import math

import torch

from tritonchat.engine.options import SamplingParams
from tritonchat.engine.sampling import TokenHistory, filtered_probs, processed_logits, sample_next

V = 16


def _draws(logits, params, n=4000, valid=V, history=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(logits))
    for _ in range(n):
        counts[sample_next(logits, params, history, valid, g)] += 1
    return counts / n


def test_greedy_and_padded_rows_masked():
    x = torch.arange(V, dtype=torch.float32)
    assert sample_next(x, SamplingParams(greedy=True), None, V) == V - 1
    assert sample_next(x, SamplingParams(greedy=True), None, V - 3) == V - 4      # padded rows never win
    assert sample_next(x, SamplingParams(temperature=0.0), None, V) == V - 1
    freq = _draws(x, SamplingParams(temperature=5.0, top_k=0), n=500, valid=V - 3)
    assert freq[V - 3:].sum() == 0


def test_top_k_one_is_greedy_and_top_k_limits_support():
    x = torch.randn(V, generator=torch.Generator().manual_seed(1))
    assert (_draws(x, SamplingParams(top_k=1), n=50)[x.argmax()] == 1.0)
    freq = _draws(x, SamplingParams(top_k=3, temperature=2.0), n=1000)
    top3 = set(torch.topk(x, 3).indices.tolist())
    assert set(torch.nonzero(freq).flatten().tolist()) <= top3


def test_temperature_distribution_matches_softmax():
    x = torch.randn(V, generator=torch.Generator().manual_seed(2))
    p = torch.softmax(x / 0.7, 0)
    freq = _draws(x, SamplingParams(temperature=0.7, top_k=0), n=6000)
    # chi-square style bound: 4 standard deviations per bin
    sd = torch.sqrt(p * (1 - p) / 6000)
    assert torch.all((freq - p).abs() <= 4 * sd + 1e-3)


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    x = probs.log()
    fp = filtered_probs(x, SamplingParams(top_p=0.8, top_k=0))
    # 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is needed too; 0.1 and 0.05 are cut
    assert torch.nonzero(fp).flatten().tolist() == [0, 1, 2]
    assert math.isclose(fp.sum().item(), 1.0, rel_tol=1e-6)
    assert torch.allclose(fp[:3], probs[:3] / probs[:3].sum())
    # at least one token survives a tiny top_p
    assert torch.nonzero(filtered_probs(x, SamplingParams(top_p=1e-6, top_k=0))).flatten().tolist() == [0]


def test_min_p_relative_to_max():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    fp = filtered_probs(probs.log(), SamplingParams(min_p=0.2, top_k=0))
    assert torch.nonzero(fp).flatten().tolist() == [0, 1, 2]      # 0.08 < 0.2 * 0.5


def test_repetition_and_presence_penalties():
    x = torch.tensor([2.0, -1.0, 1.0, 0.5])
    h = TokenHistory(4, [0, 1], "cpu")
    y = processed_logits(x, SamplingParams(greedy=True, repetition_penalty=2.0), h, 4)
    assert y.tolist() == [1.0, -2.0, 1.0, 0.5]                     # prompt tokens penalised, HF style
    h.add(2)
    y = processed_logits(x, SamplingParams(greedy=True, presence_penalty=0.75), h, 4)
    assert y.tolist() == [2.0, -1.0, 0.25, 0.5]                    # presence: generated tokens only


def test_seed_reproducible():
    x = torch.randn(V, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=1.0, top_k=0, seed=7)
    a = [sample_next(x, p, None, V, torch.Generator().manual_seed(7)) for _ in range(1)]
    b = [sample_next(x, p, None, V, torch.Generator().manual_seed(7)) for _ in range(1)]
    assert a == b
    ga, gb = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert [sample_next(x, p, None, V, ga) for _ in range(20)] == [sample_next(x, p, None, V, gb) for _ in range(20)]
