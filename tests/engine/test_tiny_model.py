"""`tritonchat make-tiny`: a tiny random model in the official layout, made without transformers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tritonchat.engine.options import EngineOptions, SamplingParams
from tritonchat.engine.tiny_model import QWEN35_ADDED_TOKENS, is_tiny_model, make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("make-tiny") / "model")


def test_official_layout(tiny):
    names = {p.name for p in tiny.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"} <= names
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and cfg["model_type"] == "qwen3_5"
    assert cfg["text_config"]["model_type"] == "qwen3_5_text" and "vision_config" in cfg
    from safetensors import safe_open
    with safe_open(str(tiny / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.language_model.layers.0.linear_attn.A_log").get_dtype() == "F32"
        assert f.get_slice("model.language_model.embed_tokens.weight").get_dtype() == "BF16"
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in keys
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in keys
    assert all(k.startswith("model.language_model.") for k in keys)
    tok_cfg = json.loads((tiny / "tokenizer_config.json").read_text())
    added = {v["content"]: v["special"] for v in tok_cfg["added_tokens_decoder"].values()}
    assert added == dict(QWEN35_ADDED_TOKENS)
    assert "<|im_start|>" in tok_cfg["chat_template"] and tok_cfg["eos_token"] == "<|im_end|>"
    assert is_tiny_model(tiny)


def test_loads_with_the_reference_engine_and_generates(tiny):
    from tritonchat.engine.session import ChatSession

    s = ChatSession.load(tiny, EngineOptions(backend="reference", device="cpu", dtype="float32",
                                             max_context=512))
    try:
        reply = s.generate([{"role": "user", "content": "Hello there"}], SamplingParams(seed=1),
                           max_new_tokens=6, enable_thinking=False, ignore_eos=True)
        assert reply.result.stats.new_tokens == 6
        assert s.tokenizer.stop_ids and s.generation_defaults.top_p == 0.95
    finally:
        s.close()


def test_refuses_a_folder_with_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    r = subprocess.run([sys.executable, "-m", "tritonchat.engine.cli", "make-tiny", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "is not empty" in r.stderr
    assert "Traceback" not in r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_needs_no_transformers_and_no_tests_package(tmp_path):
    """make-tiny in a child where importing transformers or tests fails."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('transformers', 'tests'):\n"
            "            raise ImportError('blocked ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from tritonchat.engine.cli import main\n"
            f"sys.exit(main(['make-tiny', {str(tmp_path / 'm')!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path), env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert "tritonchat --model" in r.stdout and (tmp_path / "m" / "model.safetensors").is_file()
