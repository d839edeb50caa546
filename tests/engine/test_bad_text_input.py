"""#61.3: text that is not valid UTF-8 reaches the model as U+FFFD (or is refused with a sentence),
in `chat`, `generate --prompt` and the engine API alike; it never ends the chat loop."""
import os
import subprocess
import sys

import pytest

from tests.fixtures.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("badtext"))


def _chat(model_dir, stdin: bytes, errors: str):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING=f"utf-8:{errors}")
    return subprocess.run([sys.executable, "-m", "tritonchat.engine.cli", "chat", "--model", str(model_dir),
                           "--max-new-tokens", "3", "--seed", "1"],
                          input=stdin, capture_output=True, timeout=300, env=env)


def test_chat_survives_bytes_that_are_not_utf8(model_dir):
    # Bad bytes arrive as lone surrogates (surrogateescape) or as a decode error (strict): both
    # cases keep the loop going; the second question is still answered.
    stdin = b"caf\xe9 \xff\xfe\n" + "ok \ud83d".encode("utf-8", "surrogatepass") + b"\nSecond\n/quit\n"
    r = _chat(model_dir, stdin, "surrogateescape")
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert r.stderr.count(b"tokens, TTFT") == 3
    assert r.stderr.count(b"not valid UTF-8") == 2           # one note per repaired line
    r = _chat(model_dir, stdin, "strict")
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0, err
    assert err.count("not valid UTF-8") == 2 and err.count("tokens, TTFT") == 3


def test_generate_prompt_with_bad_bytes(model_dir):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "tritonchat.engine.cli", "generate", "--model", os.fsencode(model_dir),
                        "--prompt", b"caf\xe9 \xed\xa0\x80", "--chat", "--max-new-tokens", "2", "--seed", "1"],
                       capture_output=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
