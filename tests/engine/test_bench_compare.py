"""`bench --compare`'s decode-mode entry (issue #59): the persistent step beside the per-operator
one, on a tiny checkpoint under the interpreter (the timing itself means something only on the
device): its tokens against the first configuration's, a fallback reported instead of raised,
and the entry in the human table."""
import pytest
import torch

from tests.fixtures.checkpoints import make_tiny_checkpoint
from tritonchat.engine import bench
from tritonchat.engine.config import load_config
from tritonchat.engine.options import EngineOptions
from tritonchat.engine.reference import torch_dtype
from tritonchat.engine.weights import load_weights

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter form; the device runs the bench")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bench-modes"), with_tokenizer=False)


@pytest.fixture
def backend(ckpt, monkeypatch):
    from tritonchat.engine.triton_backend import TritonBackend
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    cfg = load_config(ckpt)
    be = TritonBackend(cfg, load_weights(ckpt, cfg, device="cpu", dtype=torch_dtype("float32")),
                       EngineOptions(backend="triton", device="cpu", dtype="float32", max_context=64, graph=False))
    yield be
    be.close()


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def test_first_difference():
    assert bench.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_difference([7], [8]) == 0
    assert bench.first_difference([1, 2], [1, 2, 3]) == 2


def test_the_persistent_mode_is_an_entry_with_the_same_greedy_tokens(backend):
    ref = bench.decode_run(backend, PROMPT, 5)
    ref_tokens = ref.pop("token_ids")
    roof = 1000.0
    (r,) = bench.decode_mode_runs(backend, PROMPT, 5, roof, ref_tokens, split_k=True, graphs=(False,))
    assert r["decode_mode"] == "persistent" and r["split_k"] is True and r["graph"] is False
    assert r["new_tokens"] == 5 and r["decode_tok_s"] > 0
    assert r["fraction_of_roofline"] == pytest.approx(r["decode_tok_s"] / roof)
    assert r["tokens_equal_first_config"] is True and r["first_token_difference"] is None   # fp32
    assert "token_ids" not in r
    # the backend is back in the mode it came in, and its step decodes as before
    assert backend.options.decode_mode == "per_op" and type(backend.decode_step).__name__ == "DecodeStep"
    assert bench.decode_run(backend, PROMPT, 5)["token_ids"] == ref_tokens
    # differing tokens are reported with the first index where they part
    wrong = list(ref_tokens)
    wrong[3] += 1
    (r,) = bench.decode_mode_runs(backend, PROMPT, 5, roof, wrong, split_k=True, graphs=(False,))
    assert r["tokens_equal_first_config"] is False and r["first_token_difference"] == 3


def test_a_fallback_is_reported_not_raised(backend, monkeypatch, capsys):
    from tritonchat.engine import persistent_step as PS

    def refuse(self, *a, **kw):
        raise PS.PersistentUnavailable("its grid of 264 programs (2 an SM) cannot be resident at once")
    monkeypatch.setattr(PS.PersistentStep, "__init__", refuse)
    (r,) = bench.decode_mode_runs(backend, PROMPT, 4, 1000.0, [], split_k=False)
    assert r == {"decode_mode": "persistent", "split_k": False, "error": backend.decode_mode_error}
    assert "cannot be resident at once" in r["error"] and backend.options.decode_mode == "per_op"
    assert bench._decode_mode_line(r) == f"  decode persistent: did not run: {r['error']}"


def test_the_human_table_lists_the_decode_modes(backend, capsys):
    ref = bench.decode_run(backend, PROMPT, 4)
    ref_tokens = ref.pop("token_ids")
    roof = {"hbm_read_gb_s": 4000.0, "bytes_per_token": 1.5e9, "floor_ms": 0.375, "tok_s": 2666.0}
    run = dict(ref, split_k=True, graph=False, fraction_of_roofline=ref["decode_tok_s"] / roof["tok_s"])
    modes = bench.decode_mode_runs(backend, PROMPT, 4, roof["tok_s"], ref_tokens, split_k=True, graphs=(False,))
    report = {"gpu": "cpu", "backend": "triton", "dtype": "float32", "weights": "tiny", "roofline": roof,
              "decode_mode": "per_op", "runs": [run], "decode_mode_runs": modes,
              "gpu_memory": {"allocated_gib": 0.0, "peak_gib": 0.0}, "kernels": None}
    bench._print_table(report)
    out = capsys.readouterr().out
    assert "decode step: per_op" in out
    line = next(x for x in out.splitlines() if "decode persistent" in x)
    assert "split-K on  graph off" in line and "of roofline" in line and "greedy tokens equal" in line
