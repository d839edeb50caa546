"""The bench's TTFT table (the timing itself runs on the device): a warm-up, then the median of
several runs each from an empty cache, every run reported; lengths past the context refused."""

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
    from tritonchat.engine.config import qwen35_08b_config
    from tritonchat.engine.profile_step import prefill_flops
    cfg = qwen35_08b_config()
    be.max_context = 4096
    out = bench.prefill_table(be, cfg, [64, 8192], repeats=3)
    assert out["64"]["ttft_ms_runs"] == [10.0, 30.0, 20.0]
    assert abs(out["64"]["ttft_ms"] - 20.0) < 1e-9
    assert abs(out["64"]["prefill_tok_s"] - 64 / 0.020) < 1e-6
    assert abs(out["64"]["tflop_s"] - sum(prefill_flops(cfg, 64).values()) / 0.020 / 1e12) < 1e-9
    assert "error" in out["8192"]
    # warm-up once, then every measured run starts from an empty cache
    prefills = [c for c in be.calls if isinstance(c, tuple)]
    assert prefills == [("prefill", 64)] * 4
    assert be.calls.count("reset") >= 4 + 1


class _QueueBackend:
    """A device that computes token t -> t + 1 for each launched step, in order."""

    def __init__(self, can_queue):
        self.can_queue = can_queue
        self.queue, self.launched, self.most_in_flight = [], 0, 0

    def _push(self, tok):
        self.queue.append(tok + 1)
        self.launched += 1
        self.most_in_flight = max(self.most_in_flight, len(self.queue))

    def launch_step(self, tok):
        assert not self.queue, "launch_step with a step in flight: its token was not read"
        self._push(tok)

    def launch_next(self):
        if not self.can_queue or not self.queue:
            return False
        self._push(self.queue[-1])
        return True

    def finish_step(self):
        return self.queue.pop(0)


def test_decode_steps_queue_the_next_step_like_the_generator():
    """The long-context rows decode as the app does: the next step is queued before the host
    reads a token (two in flight), every step runs on the previous one's token, none is left
    in flight; a backend that cannot queue falls back to one step at a time."""
    for can_queue, most in ((True, 2), (False, 1)):
        be = _QueueBackend(can_queue)
        assert bench.decode_steps(be, 5, 10) == 15
        assert be.launched == 10 and not be.queue and be.most_in_flight == most
        be = _QueueBackend(can_queue)
        assert bench.decode_steps(be, 7, 1) == 8 and be.launched == 1 and not be.queue
