"""The decode-step profile's arithmetic (the profiling itself needs a GPU: profile_step.main)."""
import pytest

from tritonchat.engine.profile_step import summarize


def test_summarize_counts_overlap_once_and_measures_gaps():
    # two steps; in each, b overlaps a (PDL), then a 3 us gap before c
    ev = [("a", 0, 10), ("b", 8, 12), ("c", 15, 20),
          ("a", 30, 40), ("b", 38, 42), ("c", 45, 50)]
    s = summarize(ev, steps=2)
    assert s["kernels_per_step"] == 3
    assert s["busy_us_per_step"] == pytest.approx((12 + 5 + 12 + 5) / 2)
    assert s["sum_kernel_us_per_step"] == pytest.approx((10 + 4 + 5) * 2 / 2)
    assert s["idle_gaps_per_step"] == pytest.approx(3 / 2)     # 12->15, 20->30, 42->45
    assert s["idle_us_per_step"] == pytest.approx((3 + 10 + 3) / 2)
    assert s["span_us_per_step"] == pytest.approx(25)
    top = s["kernels"][0]
    assert top["name"] == "a" and top["mean_us"] == 10 and top["per_step"] == 1


def test_summarize_empty():
    assert summarize([], 5)["kernels"] == []
