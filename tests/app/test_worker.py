"""The engine worker: its slots against a real tiny session, and the thread it runs on."""
from __future__ import annotations

import threading

import pytest

from tritonchat.app.worker import EngineClient, EngineWorker, GenerateRequest, error_kind
from tritonchat.engine.options import SamplingParams
from tritonchat.engine.errors import BackendUnavailableError, ContextFullError


class Recorder:
    """Collects every signal of a worker (connected directly: the tests call slots in-thread)."""

    NAMES = ("loadProgress", "loaded", "loadFailed", "fellBack", "textDelta", "statsUpdate", "finished",
             "failed", "configured", "configureFailed", "timings", "tokenCount", "shutDown")

    def __init__(self, worker):
        self.events: list[tuple] = []
        for name in self.NAMES:
            getattr(worker, name).connect(lambda *a, n=name: self.events.append((n, *a)))

    def of(self, name):
        return [e[1:] for e in self.events if e[0] == name]


def real_loader(calls=None):
    from tritonchat.engine.session import ChatSession

    def load(model_dir, options, progress):
        if calls is not None:
            calls.append(options.to_dict())
        return ChatSession.load(model_dir, options, progress=progress)
    return load


@pytest.fixture
def worker(tiny_model_dir):
    w = EngineWorker(real_loader())
    rec = Recorder(w)
    w.load(str(tiny_model_dir), {"max_context": 1024, "split_k": False, "graph": True, "l2_state": False,
                                 "context_ranges": False, "launch_cache": False})
    yield w, rec
    w.shutdown()


def request(text="hi", n=8, thinking=False, seed=5):
    return GenerateRequest(1, [{"role": "user", "content": text}], SamplingParams(seed=seed), n, thinking)


def test_load_reports_progress_and_info(worker):
    w, rec = worker
    info = rec.of("loaded")[0][0]
    assert info["options"]["backend"] == "reference" and info["options"]["max_context"] == 1024
    assert info["options"]["split_k"] is False and info["options"]["l2_state"] is False
    assert info["options"]["context_ranges"] is False and info["options"]["launch_cache"] is False
    assert info["capabilities"]["triton"] is False and info["capabilities"]["reason"]
    assert set(info["generation_defaults"]) >= {"temperature", "top_k", "top_p"}
    stages = [s for s, _ in rec.of("loadProgress")]
    assert "weights" in stages and rec.of("loadProgress")[-1][1] == 1.0


def test_generate_streams_then_finishes(worker):
    w, rec = worker
    w.generate(request(n=12))
    texts = rec.of("textDelta")
    (rid, reply), = rec.of("finished")
    assert rid == 1 and texts and all(t[0] == 1 for t in texts)
    assert "".join(t[2] for t in texts) == reply["answer"]
    assert reply["stats"]["new_tokens"] <= 12 and reply["engine"]["backend"] == "reference"
    assert rec.of("statsUpdate")[-1][1]["max_context"] == 1024


def test_stop_before_it_starts_answers_stopped(worker):
    w, rec = worker
    req = request(n=50)
    req.stop_event.set()
    w.generate(req)
    (rid, reply), = rec.of("finished")
    assert reply["stats"]["stop_reason"] == "stopped" and reply["answer"] == ""


def test_stop_during_generation(worker):
    w, rec = worker
    req = request(n=4000)
    w.textDelta.connect(lambda *a: req.stop_event.set())
    w.generate(req)
    (rid, reply), = rec.of("finished")
    assert reply["stats"]["stop_reason"] == "stopped" and reply["stats"]["new_tokens"] < 4000


def test_context_full_is_reported_not_raised(worker):
    w, rec = worker
    w.generate(request(text="word " * 2000))
    (rid, sentence, details, kind), = rec.of("failed")
    assert kind == "ContextFullError" and "context" in sentence.lower()
    assert rec.of("finished") == []


def test_configure_and_timings_and_count(worker):
    w, rec = worker
    w.configure({"split_k": True, "graph": False, "timing": True})
    assert rec.of("configured")[-1][0]["max_context"] == 1024
    w.read_timings()
    (info,), = rec.of("timings")
    assert info["kernels"] is None and info["memory"] == {} and "roofline" in info
    assert info["plan_range"] is None          # the reference keeps no plans per context range
    w.count_tokens(7, [{"role": "user", "content": "hello"}], False)
    (tag, n, max_ctx), = rec.of("tokenCount")
    assert tag == 7 and n > 0 and max_ctx == 1024


def test_context_change_resizes_in_place(worker):
    w, rec = worker
    loads_before = len(rec.of("loaded"))
    backend = w.session.backend
    w.configure({"max_context": 768})
    assert len(rec.of("loaded")) == loads_before            # no reload: the cache is re-allocated
    assert w.session.backend is backend and w.session.options.max_context == 768


def test_context_change_rebuilds_a_backend_that_cannot_resize(worker, monkeypatch):
    from tritonchat.engine.reference import ReferenceBackend
    monkeypatch.delattr(ReferenceBackend, "set_max_context")
    w, rec = worker
    loads_before = len(rec.of("loaded"))
    w.configure({"max_context": 512})
    assert len(rec.of("loaded")) == loads_before + 1
    assert w.session.options.max_context == 512
    assert rec.of("loaded")[-1][0]["options"]["split_k"] is False     # other options kept


def test_not_loaded_yet(qtbot):
    w = EngineWorker(real_loader())
    rec = Recorder(w)
    w.generate(request())
    assert rec.of("failed")[0][3] == "NotLoaded"
    w.configure({"split_k": True})
    w.read_timings()
    w.count_tokens(1, [], False)
    assert rec.of("configured") == [] and rec.of("timings") == [] and rec.of("tokenCount") == []


def test_triton_unavailable_falls_back_to_the_reference(tiny_model_dir):
    calls = []
    inner = real_loader(calls)

    def loader(model_dir, options, progress):
        if options.backend == "triton":
            calls.append(options.to_dict())
            raise BackendUnavailableError("Triton cannot compile its kernels here.", details="no cc")
        return inner(model_dir, options, progress)

    w = EngineWorker(loader)
    rec = Recorder(w)
    w.load(str(tiny_model_dir), {"backend": "triton", "max_context": 256})
    assert [c["backend"] for c in calls] == ["triton", "reference"]
    assert rec.of("fellBack")[0][0].startswith("Triton cannot compile")
    assert rec.of("loaded")[0][0]["options"]["backend"] == "reference"
    w.shutdown()


def test_load_failure_is_a_sentence(tmp_path):
    w = EngineWorker(real_loader())
    rec = Recorder(w)
    w.load(str(tmp_path), {})
    (sentence, details, kind), = rec.of("loadFailed")
    assert sentence and details and w.session is None and rec.of("loaded") == []


def test_error_kind():
    assert error_kind(RuntimeError("CUDA out of memory. Tried to allocate")) == "oom"
    assert error_kind(ContextFullError("x")) == "ContextFullError"


def test_client_runs_the_engine_on_its_own_thread(qtbot, tiny_model_dir, on_gui):
    threads = {}
    inner = real_loader()

    def loader(model_dir, options, progress):
        threads["load"] = threading.current_thread()
        return inner(model_dir, options, progress)

    client = EngineClient(loader)
    events = []
    for name in ("loaded", "textDelta", "finished"):
        on_gui(getattr(client.worker, name), lambda *a, n=name: events.append((n, *a)))
    try:
        client.load(str(tiny_model_dir), {"max_context": 1024})
        qtbot.waitUntil(lambda: any(e[0] == "loaded" for e in events), timeout=60000)
        assert threads["load"] is not threading.main_thread()
        # a long answer is stopped from the GUI thread through the request's event
        client.generate([{"role": "user", "content": "go"}], SamplingParams(seed=1), 100000, False)
        qtbot.waitUntil(lambda: any(e[0] == "textDelta" for e in events), timeout=60000)
        client.stop()
        qtbot.waitUntil(lambda: any(e[0] == "finished" for e in events), timeout=60000)
        reply = next(e[2] for e in events if e[0] == "finished")
        assert reply["stats"]["stop_reason"] == "stopped" and reply["stats"]["new_tokens"] < 100000
        # a generation still queued or running does not keep close() waiting
        client.generate([{"role": "user", "content": "again"}], SamplingParams(seed=2), 100000, False)
    finally:
        assert client.close(timeout_s=30)
    assert not client.thread.isRunning() and client.worker.session is None


@pytest.mark.gpu
def test_worker_on_the_triton_backend(tiny_model_dir):
    """On a CUDA machine with PySide6: the app's engine path with Triton, timing and switches."""
    w = EngineWorker(real_loader())
    rec = Recorder(w)
    w.load(str(tiny_model_dir), {"max_context": 1024, "split_k": True, "graph": True, "timing": False})
    assert rec.of("loadFailed") == [] and rec.of("fellBack") == []
    info = rec.of("loaded")[0][0]
    assert info["options"]["backend"] == "triton" and info["capabilities"]["triton"] is True
    assert {"weights", "kernels", "graph"} <= {s for s, _ in rec.of("loadProgress")}   # warm-up at load
    w.configure({"timing": True, "split_k": False, "graph": False})
    assert rec.of("configured")[-1][0]["split_k"] is False and rec.of("configured")[-1][0]["graph"] is False
    w.generate(request(n=24))
    (rid, reply), = rec.of("finished")
    assert reply["engine"]["split_k"] is False and reply["stats"]["new_tokens"] > 0
    w.read_timings()
    (timings,), = rec.of("timings")
    assert timings["memory"]["total_bytes"] > 0
    pr = timings["plan_range"]                  # None where the table has no ranges for this shape
    assert pr is None or (pr["count"] >= 2 and 0 <= pr["index"] < pr["count"])
    rows = timings["kernels"]
    assert rows and all({"name", "launches_per_token", "us_per_token", "share", "gb_s"} <= set(r) for r in rows)
    assert abs(sum(r["share"] for r in rows) - 1.0) < 0.05
    w.shutdown()


def _refuse_persistent(monkeypatch):
    """The persistent step cannot run here (on a GPU: its grid cannot be co-resident)."""
    from tritonchat.engine import persistent_step as PS

    def refuse(self, *a, **kw):
        raise PS.PersistentUnavailable("its grid of 264 programs (2 an SM) cannot be resident at once")
    monkeypatch.setattr(PS.PersistentStep, "__init__", refuse)


TRITON_CPU = {"backend": "triton", "device": "cpu", "max_context": 128, "graph": False}


def test_decode_mode_reaches_the_triton_engine_and_its_fallback_is_said(tiny_model_dir, monkeypatch):
    """issue #59: decode_mode at load and by configure, on the Triton engine (the interpreter
    here); a persistent step that cannot run is reported with the engine's one sentence and
    the options read the mode that runs."""
    calls = []
    w = EngineWorker(real_loader(calls))
    rec = Recorder(w)
    sentences = []
    w.fellBackMode.connect(sentences.append)
    try:
        w.load(str(tiny_model_dir), dict(TRITON_CPU, decode_mode="persistent"))
        assert rec.of("loadFailed") == [] and calls[-1]["decode_mode"] == "persistent"
        info = rec.of("loaded")[0][0]
        assert info["options"]["decode_mode"] == "persistent" and info["capabilities"]["decode_mode_error"] == ""
        assert type(w.session.backend.decode_step).__name__ == "PersistentStep"
        w.configure({"decode_mode": "per_op"})
        assert rec.of("configured")[-1][0]["decode_mode"] == "per_op" and sentences == []
        assert type(w.session.backend.decode_step).__name__ == "DecodeStep"
        _refuse_persistent(monkeypatch)
        w.configure({"decode_mode": "persistent"})
        assert rec.of("configureFailed") == []
        assert rec.of("configured")[-1][0]["decode_mode"] == "per_op"
        (sentence,) = sentences
        assert "cannot be resident at once" in sentence and sentence.endswith("decoding per operator.")
        # a load asking for it reports the same sentence in its capabilities
        w.load(str(tiny_model_dir), dict(TRITON_CPU, decode_mode="persistent"))
        info = rec.of("loaded")[-1][0]
        assert info["options"]["decode_mode"] == "per_op"
        assert "cannot be resident at once" in info["capabilities"]["decode_mode_error"]
    finally:
        w.shutdown()


def test_decode_mode_is_not_sent_to_the_reference_engine(worker):
    """The reference engine has no decode modes: the setting is kept by the app, not sent
    (its configure would refuse the name)."""
    w, rec = worker
    sent = []
    configure = w.session.configure
    w.session.configure = lambda **kw: (sent.append(kw), configure(**kw))
    w.configure({"decode_mode": "persistent", "split_k": True})
    assert sent == [{"split_k": True}] and rec.of("configureFailed") == []
    assert rec.of("configured")[-1][0]["backend"] == "reference"


def test_an_unknown_decode_mode_at_load_is_a_sentence(tiny_model_dir):
    w = EngineWorker(real_loader())
    rec = Recorder(w)
    w.load(str(tiny_model_dir), {"decode_mode": "fast"})
    ((sentence, _details, _kind),) = rec.of("loadFailed")
    assert "decode mode 'fast'" in sentence and "per_op or persistent" in sentence
