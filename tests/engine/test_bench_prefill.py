"""The bench's TTFT table (the timing itself runs on the device): a warm-up, then the median of
several runs each from an empty cache, every run reported; lengths past the context refused."""
import types

import torch

from tritonchat.engine import bench


class _FakeBackend:
    max_context = 4096

    def __init__(self):
        self.calls = []

    def reset(self):
        self.calls.append("reset")

    def prefill(self, ids):
        self.calls.append(("prefill", len(ids)))

    def begin_sampling(self, params, history):
        self.calls.append("begin")

    def sample(self):
        self.calls.append("sample")
        return 0


def test_prefill_table_reports_the_median_of_the_runs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ticks = iter([0.0, 0.010, 1.0, 1.030, 2.0, 2.020])          # runs of 10, 30, 20 ms
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks))
    be = _FakeBackend()
    cfg = types.SimpleNamespace(vocab_size=1000)
    out = bench.prefill_table(be, cfg, [64, 8192], repeats=3)
    assert out["64"]["ttft_ms_runs"] == [10.0, 30.0, 20.0]
    assert abs(out["64"]["ttft_ms"] - 20.0) < 1e-9
    assert abs(out["64"]["prefill_tok_s"] - 64 / 0.020) < 1e-6
    assert "error" in out["8192"]
    # warm-up once, then every measured run starts from an empty cache
    prefills = [c for c in be.calls if isinstance(c, tuple)]
    assert prefills == [("prefill", 64)] * 4
    assert be.calls.count("reset") >= 4 + 1
