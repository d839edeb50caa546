"""Shared fixtures for the app tests: offscreen Qt, a tiny checkpoint, a temp store and settings."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")   # before any Qt import
if "TRITONCHAT_LOG_DIR" not in os.environ:               # error boxes log here, not in ~/.local
    import tempfile

    os.environ["TRITONCHAT_LOG_DIR"] = tempfile.mkdtemp(prefix="tritonchat-test-logs-")

import pytest  # noqa: E402

import tritonchat.app.refcount_guard  # noqa: E402,F401  (PySide6 6.12 drops refs to True/None on 3.11)


@pytest.fixture(autouse=True)
def _delete_widgets_on_the_gui_thread():
    """After each test, really delete what it closed, here on the GUI thread.

    pytest-qt closes registered widgets with deleteLater(), but processEvents() does not run
    deferred deletes: they would wait for the next test's event loop, and Python's cyclic GC
    could meanwhile free a leftover wrapper on whatever thread allocates, e.g. the next test's
    engine thread, deleting widgets off the GUI thread."""
    yield
    from PySide6.QtCore import QCoreApplication, QEvent

    if QCoreApplication.instance() is not None:
        QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """One tiny random-weight Qwen3.5 checkpoint (with tokenizer) shared by the app tests."""
    from tests.fixtures.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen35") / "model")


@pytest.fixture
def store(tmp_path):
    from tritonchat.app.store import ChatStore

    s = ChatStore(tmp_path / "chats.sqlite3")
    yield s
    s.close()


@pytest.fixture
def qsettings(tmp_path):
    from tritonchat.app.settings import open_settings

    return open_settings(str(tmp_path / "settings.ini"))


class RecordingSession:
    """A real ChatSession with its calls recorded (engine thread appends, tests read after
    the matching signal). Optionally fails on purpose: `fail_generate` is raised by the next
    generate() after `fail_after_text` text callbacks (0: before any text)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple] = []
        self.fail_generate: BaseException | None = None
        self.fail_after_text = 0
        self.extra_kwargs: dict = {}     # e.g. ignore_eos=True: random weights may end at once

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, messages, params, **kw):
        self.calls.append(("generate", messages, params, {k: v for k, v in kw.items()
                                                          if k not in ("on_text", "on_stats", "stop_event")}))
        if self.fail_generate is not None:
            exc, self.fail_generate = self.fail_generate, None
            if self.fail_after_text:
                on_text = kw["on_text"]
                for i in range(self.fail_after_text):
                    on_text("", f"partial{i} ")
            raise exc
        return self.inner.generate(messages, params, **kw, **self.extra_kwargs)

    def configure(self, **kw):
        self.calls.append(("configure", kw))
        return self.inner.configure(**kw)

    def set_max_context(self, n):
        self.calls.append(("set_max_context", n))
        return self.inner.set_max_context(n)

    def of(self, name):
        return [c for c in self.calls if c[0] == name]


@pytest.fixture
def recording_loader():
    """A loader building real sessions wrapped in RecordingSession; .sessions lists them."""
    from tritonchat.engine.session import ChatSession

    def loader(model_dir, options, progress):
        s = RecordingSession(ChatSession.load(model_dir, options, progress=progress))
        loader.sessions.append(s)
        return s

    loader.sessions = []
    return loader


@pytest.fixture
def errors_shown(monkeypatch):
    """Record the error dialogs the main window would show (instead of a modal box)."""
    shown: list[tuple[str, str]] = []
    monkeypatch.setattr("tritonchat.app.main_window.show_error",
                        lambda parent, sentence, details="", title="tritonchat": shown.append((sentence, details)))
    return shown


@pytest.fixture
def make_window(qtbot, store, qsettings, tiny_model_dir, recording_loader, errors_shown):
    """make_window(**kw) -> a shown MainWindow on the tiny model with the model loaded.
    Defaults for tests: a fixed seed and short answers, unless kw says otherwise."""
    from tritonchat.app.main_window import MainWindow

    windows = []

    def make(model=None, *, load=True, seed="7", max_new_tokens=48, thinking=False, context=2048,
             ignore_eos=False, **kw):
        # a short context keeps the reference engine fast (its step cost grows with the cache)
        qsettings.setValue("engine/context_length", context)
        qsettings.setValue("generation/seed", seed)
        qsettings.setValue("generation/max_new_tokens", max_new_tokens)
        qsettings.setValue("generation/thinking", thinking)
        kw.setdefault("loader", recording_loader)
        w = MainWindow(str(model or tiny_model_dir), kw.pop("store", store), kw.pop("qsettings", qsettings), **kw)
        qtbot.addWidget(w)
        windows.append(w)
        w.show()
        if load:
            with qtbot.waitSignal(w.modelLoaded, timeout=60000):
                w.start()
            if ignore_eos:     # answers that run until stopped, whatever the random weights say
                recording_loader.sessions[-1].extra_kwargs["ignore_eos"] = True
        return w

    yield make
    import gc

    from PySide6.QtCore import QCoreApplication, QEvent

    for w in windows:
        w.close()
        assert w.engine.thread.wait(30000)
        w.deleteLater()
    windows.clear()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    gc.collect()                  # leftover wrappers go now, on the GUI thread


@pytest.fixture
def on_gui():
    """on_gui(signal, fn): call fn(*args) on the GUI thread for each emission of a worker signal.
    (A plain function connected to another thread's signal would run on that thread.)"""
    from PySide6.QtCore import QObject

    class Relay(QObject):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def call(self, *args):
            self.fn(*args)

    relays = []

    def connect(signal, fn):
        relay = Relay(fn)
        relays.append(relay)
        signal.connect(relay.call)
        return relay

    yield connect
    relays.clear()


class FakeSession:
    """A recorded fake engine behind the ChatSession interface: answers with canned text at
    once, counts tokens as words + 5 per message. For window tests where the real tiny model
    adds only time (loading it costs ~1 s, each answer more)."""

    def __init__(self, options):
        from tritonchat.engine.options import SamplingParams

        self.options = options
        self.generation_defaults = SamplingParams()
        self.answers = ["A fake answer."]
        self.calls: list[tuple] = []

    def capabilities(self):
        return {"triton": False, "cuda": False, "device_name": "", "reason": "fake engine"}

    def count_tokens(self, messages, enable_thinking):
        return sum(len(m["content"].split()) + 5 for m in messages) + 3

    def generate(self, messages, params, *, max_new_tokens, enable_thinking, stop_event=None,
                 on_text=None, on_stats=None, **kw):
        from types import SimpleNamespace

        self.calls.append(("generate", [dict(m) for m in messages]))
        text = self.answers[(len(self.of("generate")) - 1) % len(self.answers)]
        if on_text:
            on_text("", text)
        stats = {"new_tokens": len(text.split()), "stop_reason": "eos", "decode_tok_s": 100.0,
                 "ttft_ms": 1.0, "prefill_tok_s": 1000.0}
        result = SimpleNamespace(stats=SimpleNamespace(to_dict=lambda: dict(stats)),
                                 engine=dict(self.options.to_dict(), backend=self.options.backend))
        return SimpleNamespace(thinking="", answer=text, thinking_seconds=0.0, result=result)

    def configure(self, **kw):
        self.calls.append(("configure", kw))

    def set_max_context(self, n):
        self.options.max_context = int(n)

    def kernel_timings(self):
        return None

    def roofline(self):
        return None

    def plan_range(self):
        return None

    def memory_info(self):
        return {}

    def close(self):
        pass

    def of(self, name):
        return [c for c in self.calls if c[0] == name]


@pytest.fixture
def fake_loader():
    """A loader of FakeSessions (no model is read); .sessions lists them."""
    def loader(model_dir, options, progress):
        s = FakeSession(options)
        loader.sessions.append(s)
        return s

    loader.sessions = []
    return loader


@pytest.fixture
def make_fake_window(qtbot, store, qsettings, tmp_path, fake_loader, errors_shown):
    """make_fake_window(**kw) -> a shown MainWindow on the fake engine, loaded."""
    from PySide6.QtCore import QCoreApplication, QEvent

    from tritonchat.app.main_window import MainWindow

    windows = []
    model = tmp_path / "fake-model"
    model.mkdir(exist_ok=True)

    def make(context=4096, **kw):
        qsettings.setValue("engine/context_length", context)
        kw.setdefault("loader", fake_loader)
        w = MainWindow(str(model), kw.pop("store", store), kw.pop("qsettings", qsettings), **kw)
        qtbot.addWidget(w)
        windows.append(w)
        w.show()
        with qtbot.waitSignal(w.modelLoaded, timeout=20000):
            w.start()
        return w

    yield make
    for w in windows:
        w.close()
        assert w.engine.thread.wait(30000)
        w.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
