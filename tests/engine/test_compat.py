"""engine/compat.py: a Triton without a feature turns that option off with one sentence."""
from tritonchat.engine import compat
from tritonchat.engine.options import EngineOptions


def test_missing_pdl_turns_pdl_off_with_one_sentence(monkeypatch):
    monkeypatch.setattr(compat, "has_pdl", lambda: False)
    opts, notes = compat.check_gpu_stack(EngineOptions(backend="triton", device="cpu"))
    assert not opts.pdl and not opts.pdl_early
    assert len(notes) == 1 and "PDL is off" in notes[0]


def test_an_untested_gpu_stack_is_named(monkeypatch):
    monkeypatch.setattr(compat, "GPU_TESTED", {("0.1", "0.1")})
    monkeypatch.setattr(compat, "has_pdl", lambda: True)
    opts, notes = compat.check_gpu_stack(EngineOptions(backend="triton", device="cuda"))
    assert opts.pdl and len(notes) == 1 and "has not been run on a GPU" in notes[0]
    _, notes = compat.check_gpu_stack(EngineOptions(backend="triton", device="cpu"))
    assert notes == []                                  # the interpreter: no GPU claim


def test_pyproject_bounds_torch_and_triton_from_above():
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text()
    for name in ("torch", "triton"):
        spec = re.search(rf'"{name}([<>=!~][^"]*)"', text).group(1)
        assert "<" in spec, f"{name} has no upper bound: {spec}"
