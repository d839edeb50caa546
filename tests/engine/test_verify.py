"""`tritonchat verify` (#61.1): every file hashed against its download record, every tensor checked
for NaN/inf; per-file ok / DAMAGED / unchecked, exit 1 when anything is damaged."""
import pytest

from tests.fakehub import FakeHub, hub_env  # noqa: F401  (hub_env: fixture)
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tritonchat.engine import cli, hub


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("verify"), layout="index")


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_verify_a_download(hub_env, tiny, capsys):
    hub_env.serve(_files(tiny))
    dest = hub.resolve_model(hub.DEFAULT_MODEL, retry=hub.RetryPolicy(attempts=2, backoff_s=0.01))
    assert cli.main(["verify"]) == 0
    out = capsys.readouterr().out
    assert "DAMAGED" not in out and "all finite" in out and "  ok        tokenizer.json" in out
    shard = (dest / "model.safetensors-00001-of-00001.safetensors").resolve()
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0x55                              # same size: only a hash can tell
    shard.write_bytes(bytes(data))
    assert cli.main(["verify"]) == 1
    captured = capsys.readouterr()
    assert "DAMAGED   model.safetensors-00001-of-00001.safetensors (its content does not match its hash)" in captured.out
    assert "download the model again" in captured.err


def test_verify_a_local_folder_without_a_record(tiny, tmp_path, capsys):
    import shutil
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    assert cli.main(["verify", "--model", str(folder)]) == 0
    assert "unchecked config.json (no download record)" in capsys.readouterr().out
    shard = folder / "model.safetensors-00001-of-00001.safetensors"
    t = load_file(str(shard))
    key = "model.language_model.layers.1.linear_attn.in_proj_qkv.weight"
    t[key][0, 0] = float("nan")
    save_file(t, str(shard), metadata={"format": "pt"})
    assert cli.main(["verify", "--model", str(folder)]) == 1
    assert f"the tensor '{key}' holds NaN or infinite values" in capsys.readouterr().out
    assert cli.main(["verify", "--model", str(tmp_path / "nope")]) == 2
