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


def test_call_sites_take_their_kernels_in_order():
    from tritonchat.engine.profile_step import attribute_sites, per_site
    sites = ["embedding_gather", "gemv_attn_qkv_norm", "attention_decode", "gemv_attn_o_proj",
             "lm_head_norm_argmax"]
    kernels = ["_embedding_gather_kernel", "_gemv_kernel", "_attn_decode_kernel",
               "_gemv_persistent_kernel", "_lm_head_kernel", "_argmax_keys_kernel"]
    assert attribute_sites(sites, kernels) == [
        "embedding_gather", "gemv_attn_qkv_norm", "attention_decode", "gemv_attn_o_proj",
        "lm_head_norm_argmax", "lm_head_norm_argmax"]
    assert attribute_sites(sites, kernels[:3]) is None            # too few kernels
    assert attribute_sites(sites[:3], kernels) is None             # kernels left over
    events = []
    for step in range(2):
        t = step * 100.0
        for k, name in enumerate(kernels):
            events.append((name, t + 10 * k, t + 10 * k + (k + 1)))
    rows = {r["site"]: r for r in per_site(events, sites, 2)}
    assert rows["attention_decode"]["kernels_per_step"] == 1
    assert rows["attention_decode"]["us_per_step"] == 3
    assert rows["lm_head_norm_argmax"]["kernels_per_step"] == 2
    assert rows["lm_head_norm_argmax"]["us_per_step"] == 5 + 6
    assert per_site(events[:-1], sites, 2) is None


def test_critical_path_shares_sum_to_the_span_under_overlap():
    from tritonchat.engine.profile_step import per_site
    sites = ["embedding_gather", "gemv_attn_qkv_norm", "gemv_attn_o_proj"]
    kernels = ["_embedding_gather_kernel", "_gemv_kernel", "_gemv_persistent_kernel"]
    events = []
    for step in range(3):
        t = step * 1000.0                 # a gap between replays: nobody's share
        # the second kernel launches early (PDL) and ends 6 us after the first; the third
        # starts after the second ended (a launch gap of 2 us, counted as its own)
        events += [(kernels[0], t, t + 4.0), (kernels[1], t + 1.0, t + 10.0),
                   (kernels[2], t + 12.0, t + 15.0)]
    rows = {r["site"]: r for r in per_site(events, sites, 3)}
    assert rows["embedding_gather"]["critical_us_per_step"] == 4.0
    assert rows["gemv_attn_qkv_norm"]["critical_us_per_step"] == 6.0
    assert rows["gemv_attn_qkv_norm"]["us_per_step"] == 9.0
    assert rows["gemv_attn_o_proj"]["critical_us_per_step"] == 3.0
    assert sum(r["critical_us_per_step"] for r in rows.values()) == 15.0 - 2.0


def test_prefill_gemm_flops_are_two_per_weight_per_row():
    # an independent count: every projection weight of the checkpoint (2-D, not the embedding,
    # which the LM head counts once) does one multiply-add per prompt row
    from tritonchat.engine.config import qwen35_08b_config
    from tritonchat.engine.profile_step import prefill_flops
    cfg = qwen35_08b_config()
    suffixes = ("proj.weight", "proj_qkv.weight", "proj_z.weight", "proj_b.weight", "proj_a.weight")
    params = sum(s[0] * s[1] for n, s in cfg.expected_shapes().items() if n.endswith(suffixes))
    for T in (1, 2048):
        f = prefill_flops(cfg, T)
        assert f["gemm"] == 2 * T * params
        assert f["lm_head"] == 2 * cfg.hidden_size * cfg.vocab_size


def test_prefill_attention_flops_count_the_causal_pairs():
    from tritonchat.engine.config import qwen35_08b_config
    from tritonchat.engine.profile_step import prefill_flops
    cfg = qwen35_08b_config()
    T, start = 37, 11
    pairs = sum(1 for t in range(T) for s in range(start + t + 1))     # keys 0..p for query p
    per_pair = 2 * 2 * cfg.head_dim * cfg.num_attention_heads          # q.k and p.v, every head
    assert prefill_flops(cfg, T, start)["attention"] == len(cfg.full_attention_layers) * per_pair * pairs


def test_family_table_groups_kernels_and_rates_them():
    from tritonchat.engine.profile_step import family_table, operator_family
    assert operator_family("_gemm_kernel") == "gemm"
    assert operator_family("_gdn_chunk_state_kernel") == "gdn_chunk"
    assert operator_family("_attention_prefill_kernel") == "attention"
    assert operator_family("void at::native::elementwise_kernel<...>") == "other"
    summary = {"kernels": [{"name": "_gemm_kernel", "per_step": 4, "us_per_step": 300.0},
                           {"name": "_gemm_splitk_reduce", "per_step": 2, "us_per_step": 100.0},
                           {"name": "_rms_norm_kernel", "per_step": 4, "us_per_step": 100.0}]}
    rows = {r["family"]: r for r in family_table(summary, {"gemm": 2e12})}
    assert rows["gemm"]["kernels"] == 6 and rows["gemm"]["ms"] == pytest.approx(0.4)
    assert rows["gemm"]["tflop_s"] == pytest.approx(2e12 / 400e-6 / 1e12)
    assert rows["gemm"]["share"] == pytest.approx(0.8)
    assert "tflop_s" not in rows["rms_norm"]
