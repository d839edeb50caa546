"""`tritonchat generate` end to end, and every bad input: one sentence on stderr, exit code 2."""
import json
import os
import subprocess
import sys

import pytest

from tests.fixtures.checkpoints import make_tiny_checkpoint


def run_cli(*args, env=None):
    e = dict(os.environ, HF_HUB_OFFLINE="1")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "tritonchat.app.launcher", *args], capture_output=True, text=True,
                          timeout=300, env=e)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cli"), layout="index")


def test_generate_json(model_dir):
    r = run_cli("generate", "--model", str(model_dir), "--prompt", "Hi", "--chat", "--system", "Be kind.",
                "--greedy", "--max-new-tokens", "7", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("token_ids", "text", "prompt_tokens", "new_tokens", "ttft_ms", "decode_tok_s", "stop_reason",
                "backend", "device", "dtype"):
        assert key in d, key
    assert d["new_tokens"] == 7 == len(d["token_ids"]) and d["stop_reason"] == "max_tokens"
    assert d["backend"] == "reference" and d["device"] == "cpu" and d["dtype"] == "float32"


def test_prompt_ids_verbatim_and_reproducible(model_dir):
    args = ("generate", "--model", str(model_dir), "--prompt-ids", "5,6,7", "--max-new-tokens", "6",
            "--seed", "4", "--temperature", "0.9", "--top-p", "0.9", "--min-p", "0.01", "--presence-penalty", "0.5",
            "--repetition-penalty", "1.1", "--ignore-eos", "--json")
    a, b = run_cli(*args), run_cli(*args)
    assert a.returncode == 0, a.stderr
    da, db = json.loads(a.stdout.splitlines()[-1]), json.loads(b.stdout.splitlines()[-1])
    assert da["prompt_tokens"] == 3 and da["token_ids"] == db["token_ids"]


def _bad(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_bad_inputs(model_dir, tmp_path):
    _bad(run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "x"), "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _bad(run_cli("generate", "--model", str(empty), "--prompt", "x"), "no config.json")
    # config that is not JSON
    bad = tmp_path / "badcfg"
    bad.mkdir()
    for f in model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text("{oops")
    _bad(run_cli("generate", "--model", str(bad), "--prompt", "x"), "config.json")
    # another architecture
    (bad / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    _bad(run_cli("generate", "--model", str(bad), "--prompt", "x"), "llama")
    # truncated weights
    (bad / "config.json").write_text((model_dir / "config.json").read_text())
    shard = bad / "model.safetensors-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    _bad(run_cli("generate", "--model", str(bad), "--prompt", "x"), "safetensors")
    # missing tokenizer
    notok = tmp_path / "notok"
    notok.mkdir()
    for f in model_dir.iterdir():
        if f.name != "tokenizer.json":
            (notok / f.name).write_bytes(f.read_bytes())
    _bad(run_cli("generate", "--model", str(notok), "--prompt", "x"), "tokenizer.json")
    # shape that disagrees with the config
    raw = json.loads((model_dir / "config.json").read_text())
    raw["text_config"]["hidden_size"] = 72
    (bad / "config.json").write_text(json.dumps(raw))
    shard.write_bytes((model_dir / shard.name).read_bytes())
    _bad(run_cli("generate", "--model", str(bad), "--prompt", "x"), "shape")
    # prompt longer than the context
    _bad(run_cli("generate", "--model", str(model_dir), "--prompt", "word " * 40, "--context", "16"), "context")
    # ids outside the vocabulary / malformed
    _bad(run_cli("generate", "--model", str(model_dir), "--prompt-ids", "1,99999"), "vocabulary")
    _bad(run_cli("generate", "--model", str(model_dir), "--prompt-ids", "1,a"), "comma-separated")
    _bad(run_cli("generate", "--model", str(model_dir), "--prompt", "x", "--device", "cuda")
         if not _has_cuda() else run_cli("generate", "--model", str(model_dir), "--prompt", "x", "--top-p", "2"),
         "")


def _has_cuda():
    import torch
    return torch.cuda.is_available()


def test_debug_shows_traceback(tmp_path):
    r = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "x", "--debug")
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_terminal_chat(model_dir):
    e = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "tritonchat.engine.cli", "chat", "--model", str(model_dir),
                        "--max-new-tokens", "5", "--seed", "1", "--system", "Be brief."],
                       input="Hello there\n/reset\nSecond question\n/quit\n", capture_output=True, text=True,
                       timeout=300, env=e)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("tokens, TTFT") == 2          # two answers with their stats line


def test_offline_hub_id_is_one_sentence(tmp_path):
    r = run_cli("generate", "--model", "Qwen/Qwen3.5-0.8B", "--prompt", "x", "--offline",
                env={"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "home")})
    _bad(r, "Qwen/Qwen3.5-0.8B")


def test_bench_without_gpu_is_one_sentence():
    if _has_cuda():
        pytest.skip("has a GPU")
    _bad(run_cli("bench", "--random-weights"), "CUDA")


def test_triton_backend_on_cpu_under_the_interpreter(model_dir):
    if _has_cuda():
        pytest.skip("has a GPU")
    r = run_cli("generate", "--model", str(model_dir), "--prompt-ids", "5,6,7", "--greedy", "--max-new-tokens", "3",
                "--ignore-eos", "--backend", "triton", "--device", "cpu", "--json", env={"TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.splitlines()[-1])
    ref = run_cli("generate", "--model", str(model_dir), "--prompt-ids", "5,6,7", "--greedy", "--max-new-tokens", "3",
                  "--ignore-eos", "--backend", "reference", "--json")
    assert d["backend"] == "triton" and d["token_ids"] == json.loads(ref.stdout.splitlines()[-1])["token_ids"]
    # without the interpreter the Triton backend on the CPU is refused in one sentence
    _bad(run_cli("generate", "--model", str(model_dir), "--prompt", "x", "--backend", "triton", "--device", "cpu",
                 env={"TRITON_INTERPRET": "0"}), "Triton")


def test_every_engine_switch_is_a_flag_of_generate_chat_and_bench():
    """Each switch of EngineOptions is a --flag on|off of generate, chat and bench (generated from
    the dataclass), and reaches the options; unset flags keep the dataclass defaults."""
    from tritonchat.engine.cli import build_parser, engine_options
    from tritonchat.engine.options import EngineOptions, switch_fields
    p = build_parser()
    names = [f.name for f in switch_fields()]
    assert {"split_k", "graph", "pdl", "pdl_early", "l2_state", "context_ranges", "launch_cache",
            "prefill_graph", "timing"} <= set(names)
    default = engine_options(p.parse_args(["generate", "--device", "cpu", "--prompt", "hi"]))
    assert all(getattr(default, n) == getattr(EngineOptions(), n) for n in names)
    for cmd in (["generate", "--prompt", "hi"], ["chat"], ["bench"]):
        flipped = [a for n in names for a in ("--" + n.replace("_", "-"),
                                               "off" if getattr(EngineOptions(), n) else "on")]
        opts = engine_options(p.parse_args(cmd[:1] + ["--device", "cpu"] + flipped + cmd[1:]))
        assert all(getattr(opts, n) != getattr(EngineOptions(), n) for n in names), cmd


def test_a_missing_model_folder_is_refused_at_once_before_torch_or_qt(tmp_path):
    """generate, bench and the app (no sub-command) answer a --model path that is not a model
    folder in one sentence, fast (the check runs before torch or Qt load), naming the program
    once."""
    import time
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = str(tmp_path / "missing")
    for args, words in ((["generate", "--model", missing, "--prompt", "x"], "does not exist"),
                        (["bench", "--model", missing], "does not exist"),
                        (["--model", missing], "does not exist"),
                        (["--model", str(empty)], "no config.json")):
        t0 = time.perf_counter()
        r = run_cli(*args, env={"QT_QPA_PLATFORM": "offscreen"})
        assert time.perf_counter() - t0 < 10
        _bad(r, words)
        assert r.stderr.count("tritonchat") == 1, r.stderr
    # in-process: the check itself imports neither torch nor PySide6
    import subprocess, sys
    code = ("import sys; from tritonchat.engine import cli; "
            f"rc = cli.main(['generate', '--model', {str(tmp_path / 'missing')!r}, '--prompt', 'x']); "
            "assert 'torch' not in sys.modules and 'PySide6' not in sys.modules, sorted(sys.modules); "
            "sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr
