"""Config parsing and the checkpoint loader: both file layouts, both config forms, bad input."""
import json

import pytest
import torch

from tests.fixtures.checkpoints import make_tiny_checkpoint
from tritonchat.engine.config import load_config, parse_config, qwen35_08b_config
from tritonchat.engine.errors import ModelFilesError
from tritonchat.engine.weights import load_weights


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), with_tokenizer=False)


def test_true_shape_parameter_count():
    # spec section 10: 752,393,024 text parameters; the bytes per token of the roofline
    cfg = qwen35_08b_config()
    assert cfg.num_parameters() == 752_393_024
    assert cfg.full_attention_layers == [3, 7, 11, 15, 19, 23]
    assert cfg.conv_dim == 6144 and cfg.rotary_dim == 64


@pytest.mark.parametrize("multimodal", [True, False])
def test_both_config_forms(tmp_path, multimodal):
    p = make_tiny_checkpoint(tmp_path, multimodal=multimodal, with_tokenizer=False, linear_num_value_heads=4,
                             linear_value_head_dim=24)
    cfg = load_config(p)
    assert cfg.linear_num_value_heads == 4 and cfg.linear_value_head_dim == 24
    assert cfg.conv_dim == 2 * 2 * 16 + 4 * 24
    assert cfg.rotary_dim == 8 and cfg.rope_theta == 1e7 and cfg.tie_word_embeddings


@pytest.mark.parametrize("layout", ["single", "index", "sharded"])
def test_layouts_load_identically(tmp_path, ckpt, layout):
    cfg = load_config(ckpt)
    ref = load_weights(ckpt, cfg)
    p = make_tiny_checkpoint(tmp_path, layout=layout, with_tokenizer=False)
    w = load_weights(p, load_config(p))
    assert set(w) == set(ref)
    for k in ref:
        assert torch.equal(w[k], ref[k]), k


def test_fp32_tensors_and_tying(ckpt):
    cfg = load_config(ckpt)
    w = load_weights(ckpt, cfg, dtype=torch.bfloat16)
    assert w["layers.0.linear_attn.A_log"].dtype == torch.float32
    assert w["layers.0.linear_attn.norm.weight"].dtype == torch.float32
    assert w["layers.0.linear_attn.in_proj_qkv.weight"].dtype == torch.bfloat16
    assert w["lm_head.weight"] is w["embed_tokens.weight"]
    assert not any(k.startswith(("visual", "mtp")) for k in w)


def test_skips_visual_and_mtp(tmp_path):
    from safetensors.torch import load_file, save_file
    p = make_tiny_checkpoint(tmp_path, with_tokenizer=False)
    t = load_file(str(p / "model.safetensors"))
    t["mtp.fc.weight"] = torch.zeros(3, 3)
    t["mtp.layers.0.self_attn.q_proj.weight"] = torch.zeros(2, 2)
    save_file(t, str(p / "model.safetensors"))
    w = load_weights(p, load_config(p))
    assert "fc.weight" not in w and not any("mtp" in k for k in w)


# ---------------------------------------------------------------------------- bad input ----

def _raises(fn, *words):
    with pytest.raises(ModelFilesError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for word in words:
        assert word in msg, msg
    return msg


def test_missing_folder(tmp_path):
    _raises(lambda: load_weights(tmp_path / "nope", qwen35_08b_config()), "does not exist")


def test_missing_config(tmp_path):
    _raises(lambda: load_config(tmp_path), "config.json")


def test_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    _raises(lambda: load_config(tmp_path), "config.json", "not valid JSON")


def test_other_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    _raises(lambda: load_config(tmp_path), "llama")


def test_unknown_layer_type(ckpt, tmp_path):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"]["layer_types"][0] = "sliding_attention"
    with pytest.raises(ModelFilesError, match="sliding_attention"):
        parse_config(raw)


def test_missing_weights(tmp_path, ckpt):
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    _raises(lambda: load_weights(tmp_path, load_config(tmp_path)), "No weights")


def test_corrupt_weights(tmp_path, ckpt):
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    _raises(lambda: load_weights(tmp_path, load_config(tmp_path)), "model.safetensors", "corrupt")


def test_truncated_weights(tmp_path, ckpt):
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    data = (ckpt / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    _raises(lambda: load_weights(tmp_path, load_config(tmp_path)), "model.safetensors")


def test_shape_disagrees_with_config(tmp_path, ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"]["intermediate_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    _raises(lambda: load_weights(tmp_path, load_config(tmp_path)), "shape", "config.json")


def test_index_names_missing_shard(tmp_path):
    p = make_tiny_checkpoint(tmp_path, layout="index", with_tokenizer=False)
    (p / "model.safetensors-00001-of-00001.safetensors").unlink()
    _raises(lambda: load_weights(p, load_config(p)), "missing")


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file
    p = make_tiny_checkpoint(tmp_path, with_tokenizer=False)
    t = load_file(str(p / "model.safetensors"))
    del t["model.language_model.layers.1.linear_attn.A_log"]
    save_file(t, str(p / "model.safetensors"))
    _raises(lambda: load_weights(p, load_config(p)), "A_log")


@pytest.mark.parametrize("top, text, expected", [
    (False, True, False), (True, False, True),      # both present: the top level wins, as in transformers
    (None, True, True), (None, False, False), (None, None, False), (True, None, True),
])
def test_tie_word_embeddings_precedence(top, text, expected):
    """#58.12: what transformers' Qwen3_5Config (the model's config) decides."""
    from tests.fixtures.checkpoints import TINY_TEXT
    raw_text = {k: v for k, v in TINY_TEXT.items() if k != "tie_word_embeddings"}
    if text is not None:
        raw_text["tie_word_embeddings"] = text
    raw = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": raw_text}
    if top is not None:
        raw["tie_word_embeddings"] = top
    assert parse_config(raw).tie_word_embeddings is expected
    if top is not None:
        from transformers import Qwen3_5Config
        assert Qwen3_5Config(**{k: v for k, v in raw.items() if k != "architectures"}).tie_word_embeddings is expected


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_tensor_is_one_sentence_naming_it(tmp_path, value):
    """#61.1: a local folder with no download record, damaged in a tensor the old check skipped."""
    from safetensors.torch import load_file, save_file
    p = make_tiny_checkpoint(tmp_path, with_tokenizer=False)
    t = load_file(str(p / "model.safetensors"))
    key = "model.language_model.layers.2.mlp.down_proj.weight"
    t[key][3, 5] = value
    save_file(t, str(p / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFilesError) as e:
        load_weights(p, load_config(p), dtype=torch.bfloat16)
    msg = str(e.value)
    assert key in msg and "NaN or infinite" in msg and "\n" not in msg and msg.count(". ") == 0


def test_first_non_finite_is_exact_and_cheap():
    import time
    from tritonchat.engine.weights import first_non_finite
    ts = {f"w{k}": torch.randn(1 << 16).to(torch.bfloat16 if k % 2 else torch.float32) for k in range(64)}
    assert first_non_finite(ts) is None
    ts["w41"][7] = float("nan")
    assert first_non_finite(ts) == "w41"
    big = {"e": torch.randn(1 << 24, dtype=torch.bfloat16)}      # 16M values: the 0.8B embedding is 254M
    start = time.perf_counter()
    assert first_non_finite(big) is None
    assert time.perf_counter() - start < 0.5
