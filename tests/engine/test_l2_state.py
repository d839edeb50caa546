"""The GDN recurrent states in one buffer and the persisting-L2 window over it (engine/l2_state.py):
the buffer's views on every machine; the driver calls, the window on every kernel node of the
captured step, the tokens unchanged and the fallback when the driver refuses, on the GPU."""
import pytest
import torch

from tests.fixtures.checkpoints import make_tiny_checkpoint
from tritonchat.engine import l2_state as L2
from tritonchat.engine.options import EngineOptions, SamplingParams
from tritonchat.engine.config import FULL_ATTENTION, load_config
from tritonchat.engine.generation import Generator
from tritonchat.engine.reference import ModelState
from tritonchat.engine.weights import load_weights

CUDA = torch.cuda.is_available()
GREEDY = SamplingParams(greedy=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("l2"), with_tokenizer=False)


def test_recurrent_states_are_views_of_one_buffer(ckpt):
    cfg = load_config(ckpt)
    st = ModelState(cfg, 32, "cpu", torch.float32)
    gdn = [i for i, kind in enumerate(cfg.layer_types) if kind != FULL_ATTENTION]
    assert sorted(st.rec) == gdn and len(gdn) >= 2
    assert st.rec_buf.shape == (len(gdn), cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                cfg.linear_value_head_dim)
    assert st.rec_buf.dtype == torch.float32 and st.rec_buf.is_contiguous()
    for j, i in enumerate(gdn):
        r = st.rec[i]
        assert r.is_contiguous() and r.shape == st.rec_buf.shape[1:]
        assert r.data_ptr() == st.rec_buf[j].data_ptr()
    # the layers' states do not overlap, and snapshot / restore / zero_ act through the views
    for j, i in enumerate(gdn):
        st.rec[i].fill_(j + 1)
    assert [int(st.rec_buf[j].unique().item()) for j in range(len(gdn))] == list(range(1, len(gdn) + 1))
    snap = st.snapshot()
    st.zero_()
    assert not st.rec_buf.any()
    st.restore(snap)
    assert int(st.rec_buf[-1, 0, 0, 0].item()) == len(gdn)


def test_driver_missing_is_one_sentence(monkeypatch):
    """Without the CUDA driver library every call raises L2StateError with one sentence (the
    engine then decodes without the window)."""
    import ctypes

    def no_lib(name, *a, **kw):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(L2, "_lib", None)
    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    for call in (lambda: L2.device_limits(0), lambda: L2.set_persisting_limit(1 << 20),
                 lambda: L2.set_graph_window(1, 0, 1 << 20)):
        with pytest.raises(L2.L2StateError) as e:
            call()
        msg = str(e.value)
        assert msg.startswith("The CUDA driver library") and msg.endswith(".") and "\n" not in msg


def test_engine_option_and_cli_flag():
    from tritonchat.engine.cli import build_parser
    assert EngineOptions().l2_state is True
    args = build_parser().parse_args(["bench", "--random-weights", "--l2-state", "off"])
    assert args.l2_state == "off"
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--l2-state", "off"])
    assert args.l2_state == "off"


def test_torch_without_keep_graph_says_so_and_gives_the_l2_back(monkeypatch, capsys):
    """A PyTorch whose CUDAGraph has no keep_graph cannot take the window: the engine says so
    once, captures a plain graph and sets no L2 aside (the backend's own window logic, on a
    stand-in for the device state; the driver calls recorded)."""
    import types

    from tritonchat.engine import graph as G
    from tritonchat.engine.triton_backend import TritonBackend

    limits = []
    monkeypatch.setattr(L2, "device_limits", lambda index: (32 << 20, 64 << 20))
    monkeypatch.setattr(L2, "set_persisting_limit", limits.append)

    class OldGraph:                                  # torch < 2.7
        def __init__(self):
            self.plain = True

    monkeypatch.setattr(torch.cuda, "CUDAGraph", OldGraph)
    be = types.SimpleNamespace(options=EngineOptions(l2_state=True), device=torch.device("cuda", 0),
                               state=types.SimpleNamespace(rec_buf=torch.zeros(4, 8, 8)),
                               _l2_error=None, _l2_limit=0, l2_state_nodes=7)
    be.l2_state_window = types.MethodType(TritonBackend.l2_state_window, be)
    be.l2_state_failed = types.MethodType(TritonBackend.l2_state_failed, be)
    g, window = G._graph_for_window(be)
    assert isinstance(g, OldGraph) and window is None
    assert limits == [1024 + L2.SLACK_BYTES, 0] and be._l2_limit == 0 and be.l2_state_nodes == 0
    assert be.options.l2_state is False             # the switch says what runs
    err = capsys.readouterr().err
    assert err.count("cannot be kept in L2") == 1 and "keep_graph" in err
    g, window = G._graph_for_window(be)             # the next capture: no new attempt, silent
    assert window is None and limits == [1024 + L2.SLACK_BYTES, 0]
    assert "cannot be kept in L2" not in capsys.readouterr().err
    be.options.l2_state = True                      # switched on again: still refused, reads off
    g, window = G._graph_for_window(be)
    assert window is None and be.options.l2_state is False and limits == [1024 + L2.SLACK_BYTES, 0]


# ------------------------------------------------------------------------------------ GPU ----

def _tri(path, **opts):
    from tritonchat.engine.triton_backend import TritonBackend
    cfg = load_config(path)
    return TritonBackend(cfg, load_weights(path, cfg, device="cuda", dtype=torch.bfloat16),
                         EngineOptions(backend="triton", device="cuda", dtype="bfloat16",
                                       max_context=256, **opts))


@pytest.mark.gpu
def test_gpu_window_on_every_kernel_node_and_tokens_unchanged(ckpt, monkeypatch):
    max_persist, max_window = L2.device_limits(torch.cuda.current_device())
    if max_persist == 0:
        pytest.skip("this GPU has no persisting L2")
    kept = {}
    real = L2.set_graph_window

    def spy(raw, base, nbytes, hit):
        n = real(raw, base, nbytes, hit)
        kept["windows"] = L2.graph_windows(raw)      # read back before instantiation
        return n

    monkeypatch.setattr(L2, "set_graph_window", spy)
    tri = _tri(ckpt, graph=True)
    prompt = list(range(5, 30))
    gen = Generator(tri, [])
    on = gen.generate(prompt, GREEDY, max_new_tokens=40)
    buf = tri.state.rec_buf
    nbytes = buf.numel() * 4
    assert tri.l2_state_nodes > 0 and len(kept["windows"]) == tri.l2_state_nodes
    for w in kept["windows"]:
        assert w is not None
        base, n, hit, prop = w
        assert base == buf.data_ptr() and n == min(nbytes, max_window)
        assert prop == 2 and 0.0 < hit <= 1.0                    # persisting
    graph_obj = tri.graph
    more = gen.generate(prompt + on.token_ids + [9], GREEDY, max_new_tokens=8)
    assert tri.graph is graph_obj and more.token_ids       # the position advances, no re-capture
    # switched off: re-captured without the window, the same tokens
    kept.clear()
    tri.configure(l2_state=False)
    gen.forget()
    off = gen.generate(prompt, GREEDY, max_new_tokens=40)
    assert off.token_ids == on.token_ids
    assert tri.l2_state_nodes == 0 and "windows" not in kept and tri.l2_set_aside == 0
    tri.close()


@pytest.mark.gpu
def test_gpu_window_failure_says_so_once_and_decodes(ckpt, monkeypatch, capsys):
    def refuse(*a, **kw):
        raise L2.L2StateError("cuGraphKernelNodeSetAttribute failed (CUresult 1).")

    monkeypatch.setattr(L2, "set_graph_window", refuse)
    tri = _tri(ckpt, graph=True)
    prompt = list(range(5, 30))
    res = Generator(tri, []).generate(prompt, GREEDY, max_new_tokens=20)
    assert len(res.token_ids) == 20 and tri.graph is not None and tri.options.graph
    assert tri.l2_state_nodes == 0 and not tri.options.l2_state
    err = capsys.readouterr().err
    assert err.count("cannot be kept in L2") == 1 and "CUresult 1" in err
    # later captures do not try again (and stay silent)
    tri.configure(graph=False)
    tri.configure(graph=True)
    res2 = Generator(tri, []).generate(prompt, GREEDY, max_new_tokens=20)
    assert res2.token_ids == res.token_ids
    assert "cannot be kept in L2" not in capsys.readouterr().err
    tri.close()
