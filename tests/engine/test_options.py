"""engine/options.py: one place validates the engine's switches and the sampler's values."""
import math

import pytest

from tritonchat.engine.options import (EngineOptions, OptionError, SamplingParams, check_max_new_tokens,
                                       check_switches, choice_fields, stats_fields, switch_fields)


@pytest.mark.parametrize("field,value,words", [
    ("temperature", -0.1, "--temperature"), ("temperature", math.nan, "finite"),
    ("temperature", math.inf, "finite"), ("top_p", 0.0, "--top-p"), ("top_p", 1.5, "--top-p"),
    ("top_p", math.nan, "finite"), ("top_k", -1, "--top-k"), ("top_k", 2.5, "whole number"),
    ("min_p", -0.01, "--min-p"), ("min_p", 1.01, "--min-p"), ("repetition_penalty", 0.0, "> 0"),
    ("repetition_penalty", -1.0, "> 0"), ("presence_penalty", math.inf, "finite"),
    ("seed", 1.5, "whole number"), ("temperature", "hot", "number"),
])
def test_bad_sampling_values_are_one_sentence(field, value, words):
    with pytest.raises(OptionError, match=words.replace("(", r"\(")) as e:
        SamplingParams(**{field: value}).validate()
    assert "\n" not in str(e.value) and str(e.value).endswith(".")


def test_good_sampling_values_pass():
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0).validate()
    SamplingParams(temperature=2, top_k=50, top_p=0.01, min_p=1.0, presence_penalty=-1.5, seed=3).validate()


@pytest.mark.parametrize("n", [0, -3, 2.0, True])
def test_max_new_tokens_must_be_at_least_one(n):
    with pytest.raises(OptionError, match="--max-new-tokens"):
        check_max_new_tokens(n)


@pytest.mark.parametrize("kw,words", [
    (dict(backend="tpu"), "backend"), (dict(device="gpu"), "device"), (dict(device="cuda:x"), "device"),
    (dict(dtype="int8"), "dtype"), (dict(max_context=1), "at least 2"), (dict(max_context=2.5), "whole"),
    (dict(graph="yes"), "on or off"), (dict(decode_mode="megakernel"), "decode mode 'megakernel'"),
])
def test_bad_engine_options_are_one_sentence(kw, words):
    with pytest.raises(OptionError, match=words):
        EngineOptions(**kw).validate()


def test_context_beyond_the_model_is_refused_but_the_default_shrinks():
    with pytest.raises(OptionError, match="beyond this model's 4,096 positions"):
        EngineOptions(max_context=8192).check_context(4096)
    o = EngineOptions()
    o.check_context(4096)
    assert o.max_context == 4096


def test_every_switch_documents_itself():
    for f in switch_fields():
        m = f.metadata
        assert m["help"] and m["label"] and m["stats"] and m["scope"], f.name
        assert isinstance(f.default, bool)


def test_every_choice_documents_itself():
    """The named-value settings (decode_mode): help, label, stats key, scope and choices, the
    default among them, a round trip through the options' dict."""
    names = [f.name for f in choice_fields()]
    assert "decode_mode" in names and EngineOptions().decode_mode == "per_op"
    for f in choice_fields():
        m = f.metadata
        assert m["help"] and m["label"] and m["stats"] and m["scope"], f.name
        assert f.default in m["choices"] and not m.get("switch")
    o = EngineOptions(decode_mode="persistent").validate()
    assert EngineOptions.from_dict(o.to_dict()).decode_mode == "persistent"


def test_switches_outside_their_scope_read_off():
    ref = EngineOptions(backend="reference", device="cpu")
    assert not any(getattr(ref.effective(), f.name) for f in switch_fields())
    assert list(stats_fields(ref)) == []
    gpu = EngineOptions(backend="triton", device="cuda", graph=True)
    labels = dict(stats_fields(gpu))
    assert labels["split-K"] == labels["graph"] == labels["L2 states"] == "on"
    assert "launch cache" not in labels                      # only with the graph off
    eager = dict(stats_fields(EngineOptions(backend="triton", device="cuda", graph=False)))
    assert eager["launch cache"] == "on" and eager["graph"] == "off" and "L2 states" not in eager


def test_stats_fields_name_the_decode_mode():
    """The decode step's mode is a field of the stats line on the Triton engine (GPU or the
    interpreter), first as it is declared first; the reference engine claims none."""
    for device in ("cuda", "cpu"):
        o = EngineOptions(backend="triton", device=device, decode_mode="persistent", split_k=False)
        got = list(stats_fields(o))
        assert got[0] == ("decode", "persistent") and ("split-K", "off") in got
    assert dict(stats_fields(EngineOptions(backend="triton")))["decode"] == "per_op"
    assert "decode" not in dict(stats_fields(EngineOptions(backend="reference", decode_mode="persistent")))


def test_configure_names_are_checked():
    assert check_switches({"split_k": 0, "graph": None}) == {"split_k": False}
    with pytest.raises(OptionError, match="no engine switch named splitk"):
        check_switches({"splitk": True})
