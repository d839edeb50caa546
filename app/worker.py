"""The engine thread: one QObject, moved to one QThread, makes every engine call.

The worker is a thin adapter over the Qt-free ChatSession: its slots run on the engine thread
(requests arrive as queued signals from the GUI), and it reports back through signals with plain
payloads (str, int, float, dict; dicts travel as `object` so Qt never converts them). Stop is a threading.Event inside each GenerateRequest that the
GUI sets directly: a queued "stop" signal would wait behind the running generation loop. The
engine never waits for the GUI: on_text / on_stats only emit signals.

The engine itself (torch, Triton) is imported on the engine thread at load time, so the window
appears before torch has finished importing and the GUI thread never touches CUDA.
"""
from __future__ import annotations

from . import refcount_guard  # noqa: F401  (first: PySide6 refcount bug on Python 3.11)

import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot

from tritonchat.engine.options import EngineOptions, SamplingParams, choice_fields, switch_fields

# (model_dir, options, progress) -> session with the ChatSession interface
SessionLoader = Callable[[str, EngineOptions, Callable[[str, float], None]], Any]


@dataclass
class GenerateRequest:
    """One answer to produce. The GUI keeps it to set stop_event; the worker only reads it."""

    request_id: int
    messages: list[dict]
    params: SamplingParams
    max_new_tokens: int
    enable_thinking: bool
    stop_event: threading.Event = field(default_factory=threading.Event)


def describe(exc: BaseException) -> tuple[str, str]:
    """(one sentence, details) for an exception, through app-B's mapping."""
    from .errors import describe_exception   # Qt widgets module: imported when first needed

    try:
        return describe_exception(exc)
    except Exception:                           # the mapping itself must never take the app down
        return (str(exc) or type(exc).__name__,
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def error_kind(exc: BaseException) -> str:
    """A short tag the GUI branches on: which error class (or 'oom' for out of memory)."""
    name = type(exc).__name__
    if "OutOfMemory" in name or "out of memory" in str(exc).lower():
        return "oom"
    return name


def split_k_note(session) -> str:
    """The engine's word on split-K where the tuned plan splits no shape on this GPU (then on and
    off run the same step): the session's or backend's `split_k_note`, else from a
    `split_k_effective` flag; empty while split-K changes something (or nobody says)."""
    for obj in (session, getattr(session, "backend", None)):
        if obj is None:
            continue
        note = getattr(obj, "split_k_note", "")
        if isinstance(note, str) and note:
            return note
        effective = getattr(obj, "split_k_effective", None)
        if effective is False:
            return "split-K: no shape splits on this GPU"
    return ""


def decode_mode_error(session) -> str:
    """The engine's one sentence on why the persistent decode step fell back to per-operator
    mode (the GPU cannot hold its grid co-resident): the backend's `decode_mode_error`; empty
    while the asked-for mode runs."""
    for obj in (session, getattr(session, "backend", None)):
        note = getattr(obj, "decode_mode_error", None) if obj is not None else None
        if isinstance(note, str) and note:
            return note
    return ""


def _default_loader(model_dir: str, options: EngineOptions, progress) -> Any:
    from tritonchat.engine.session import ChatSession

    return ChatSession.load(model_dir, options, progress=progress)


def default_options(**overrides) -> EngineOptions:
    """CUDA + Triton + bf16 where a GPU is, else the CPU reference engine (engine thread only)."""
    from tritonchat.engine.options import default_options as engine_defaults

    return engine_defaults(**overrides)


class EngineWorker(QObject):
    # --- reports to the GUI (all queued; payloads are plain values) ---
    loadProgress = Signal(str, float)         # stage ("weights", "kernels", "graph"), fraction
    loaded = Signal(object)                   # see _info()
    loadFailed = Signal(str, str, str)        # sentence, details, kind
    fellBack = Signal(str, str)               # sentence, details: Triton failed, reference runs
    textDelta = Signal(int, str, str)         # request id, thinking delta, answer delta
    statsUpdate = Signal(int, object)         # request id, on_stats payload
    finished = Signal(int, object)            # request id, reply payload (see _reply())
    failed = Signal(int, str, str, str)       # request id, sentence, details, kind
    configured = Signal(object)               # engine options after configure/set_max_context
    configureFailed = Signal(str, str)        # sentence, details
    fellBackMode = Signal(str)                # sentence: a decode mode asked for fell back
    timings = Signal(object)                  # {"kernels", "roofline", "memory", "timing"}
    tokenCount = Signal(int, int, int)        # tag, prompt tokens, max context
    shutDown = Signal()

    def __init__(self, loader: SessionLoader | None = None):
        super().__init__()
        self._loader = loader or _default_loader
        self.session: Any = None
        self.model_dir = ""

    # ------------------------------------------------------------------ load
    @Slot(str, object)
    def load(self, model_dir: str, settings: dict) -> None:
        """settings: "max_context", any switch of EngineOptions (options.switch_fields, e.g.
        "split_k", "graph", "timing") and any named-value setting (options.choice_fields:
        "decode_mode") from the app's preferences; backend/device/dtype come from what the
        machine has (or settings' "backend"/"device"/"dtype")."""
        if self.session is not None:
            self.session.close()
            self.session = None
        self.model_dir = model_dir
        try:
            options = default_options(**{k: settings[k] for k in ("backend", "device", "dtype")
                                         if settings.get(k)})
            for key in ["max_context"] + [f.name for f in switch_fields() + choice_fields()]:
                if settings.get(key) is not None:
                    setattr(options, key, settings[key])
            options.validate()
        except Exception as exc:   # engine import failed: same path as a failed load
            self.loadFailed.emit(*describe(exc), error_kind(exc))
            return
        progress = lambda stage, fraction: self.loadProgress.emit(str(stage), float(fraction))
        try:
            self.session = self._loader(model_dir, options, progress)
        except Exception as exc:
            from tritonchat.engine.errors import BackendUnavailableError

            if not (isinstance(exc, BackendUnavailableError) and options.backend == "triton"):
                self.loadFailed.emit(*describe(exc), error_kind(exc))
                return
            # Triton cannot run here (e.g. no C compiler): the reference engine still can.
            sentence, details = describe(exc)
            self.fellBack.emit(sentence, details)
            options.backend = "reference"
            try:
                self.session = self._loader(model_dir, options, progress)
            except Exception as exc2:
                self.loadFailed.emit(*describe(exc2), error_kind(exc2))
                return
        self.loaded.emit(self._info(model_dir))

    def _info(self, model_dir: str) -> dict:
        s = self.session
        caps = dict(s.capabilities())
        caps.setdefault("backend", s.options.backend)
        caps.setdefault("device", s.options.device)
        caps.setdefault("split_k_note", split_k_note(s))
        caps.setdefault("decode_mode_error", decode_mode_error(s))
        return {"model_dir": model_dir, "options": s.options.to_dict(),
                "capabilities": caps,
                "generation_defaults": s.generation_defaults.to_dict()}

    # ------------------------------------------------------------------ generate
    @Slot(object)
    def generate(self, req: GenerateRequest) -> None:
        if self.session is None:
            self.failed.emit(req.request_id, "The model is not loaded yet.", "", "NotLoaded")
            return
        rid = req.request_id
        if req.stop_event.is_set():     # stopped while queued: answer nothing, but answer
            self.finished.emit(rid, {"thinking": "", "answer": "", "thinking_seconds": 0.0,
                                     "stats": {"stop_reason": "stopped", "new_tokens": 0},
                                     "engine": self.session.options.to_dict()})
            return
        try:
            reply = self.session.generate(
                req.messages, req.params, max_new_tokens=req.max_new_tokens,
                enable_thinking=req.enable_thinking, stop_event=req.stop_event,
                on_text=lambda th, an: self.textDelta.emit(rid, th, an),
                on_stats=lambda st: self.statsUpdate.emit(rid, dict(st)))
        except Exception as exc:
            self.failed.emit(rid, *describe(exc), error_kind(exc))
            return
        self.finished.emit(rid, self._reply(reply))

    @staticmethod
    def _reply(reply) -> dict:
        result = reply.result
        return {"thinking": reply.thinking, "answer": reply.answer,
                "thinking_seconds": float(reply.thinking_seconds),
                "stats": result.stats.to_dict(), "engine": dict(result.engine)}

    # ------------------------------------------------------------------ switches
    @Slot(object)
    def configure(self, changes: dict) -> None:
        """changes: any switch of EngineOptions (options.switch_fields, bool), any named-value
        setting (options.choice_fields, str: sent only to an engine it applies to, as the
        reference engine has none) and max_context (int). A decode mode that fell back is
        reported (fellBackMode) with the engine's sentence; the options then read the mode
        that runs."""
        if self.session is None:
            return
        try:
            options = self.session.options
            switches = {f.name: changes[f.name] for f in switch_fields() if f.name in changes}
            switches.update({f.name: str(changes[f.name]) for f in choice_fields()
                             if f.name in changes and options.applies(f.name)})
            if switches:
                self.session.configure(**switches)
                asked = switches.get("decode_mode")
                if asked is not None and self.session.options.decode_mode != asked:
                    self.fellBackMode.emit(decode_mode_error(self.session)
                                           or f"The {asked} decode step could not start; decoding "
                                              f"{self.session.options.decode_mode}.")
            n = changes.get("max_context")
            if n and int(n) != self.session.options.max_context:
                try:
                    self.session.set_max_context(int(n))
                except (ValueError, NotImplementedError, AttributeError):
                    # this backend cannot resize its cache in place: build it again
                    self._reload(max_context=int(n))
                    return
        except Exception as exc:
            self.configureFailed.emit(*describe(exc))
        if self.session is not None:
            self.configured.emit(self.session.options.to_dict())

    def _reload(self, **option_changes) -> None:
        options = EngineOptions(**self.session.options.to_dict())
        for key, value in option_changes.items():
            setattr(options, key, value)
        self.session.close()
        self.session = None
        progress = lambda stage, fraction: self.loadProgress.emit(str(stage), float(fraction))
        try:
            self.session = self._loader(self.model_dir, options, progress)
        except Exception as exc:
            self.loadFailed.emit(*describe(exc), error_kind(exc))
            return
        self.loaded.emit(self._info(self.model_dir))

    @Slot()
    def read_timings(self) -> None:
        if self.session is None:
            return
        try:
            self.timings.emit({"kernels": self.session.kernel_timings(),
                               "roofline": self.session.roofline(),
                               "memory": dict(self.session.memory_info()),
                               "plan_range": self.session.plan_range(),
                               "timing": bool(self.session.options.timing)})
        except Exception as exc:
            self.configureFailed.emit(*describe(exc))

    @Slot(int, object, bool)
    def count_tokens(self, tag: int, messages: list, enable_thinking: bool) -> None:
        if self.session is None:
            return
        try:
            n = self.session.count_tokens(messages, enable_thinking)
        except Exception:
            return     # a meter that cannot update is not worth a dialog
        self.tokenCount.emit(tag, int(n), int(self.session.options.max_context))

    @Slot()
    def shutdown(self) -> None:
        if self.session is not None:
            try:
                self.session.close()
            finally:
                self.session = None
        self.shutDown.emit()


class EngineClient(QObject):
    """The GUI side: owns the engine thread and turns method calls into queued requests."""

    _load = Signal(str, object)
    _generate = Signal(object)
    _configure = Signal(object)
    _read_timings = Signal()
    _count_tokens = Signal(int, object, bool)
    _shutdown = Signal()

    def __init__(self, loader: SessionLoader | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("tritonchat-engine")
        self.worker = EngineWorker(loader)
        self.worker.moveToThread(self.thread)
        self._load.connect(self.worker.load)
        self._generate.connect(self.worker.generate)
        self._configure.connect(self.worker.configure)
        self._read_timings.connect(self.worker.read_timings)
        self._count_tokens.connect(self.worker.count_tokens)
        self._shutdown.connect(self.worker.shutdown)
        # the thread ends only after shutdown() ran: quit() from the GUI side could end the
        # event loop before the queued shutdown (and a pending generate) were processed
        self.worker.shutDown.connect(self.thread.quit, Qt.ConnectionType.DirectConnection)
        self.thread.start()
        self._next_id = 0
        self.current: GenerateRequest | None = None

    def load(self, model_dir: str, settings: dict) -> None:
        self._load.emit(str(model_dir), dict(settings))

    def generate(self, messages: list[dict], params: SamplingParams, max_new_tokens: int,
                 enable_thinking: bool) -> GenerateRequest:
        self._next_id += 1
        req = GenerateRequest(self._next_id, messages, params, int(max_new_tokens), bool(enable_thinking))
        self.current = req
        self._generate.emit(req)
        return req

    def stop(self) -> None:
        """Thread-safe: the generation loop sees the flag at its next token."""
        if self.current is not None:
            self.current.stop_event.set()

    def configure(self, **changes) -> None:
        self._configure.emit(dict(changes))

    def read_timings(self) -> None:
        self._read_timings.emit()

    def count_tokens(self, tag: int, messages: list[dict], enable_thinking: bool) -> None:
        self._count_tokens.emit(int(tag), list(messages), bool(enable_thinking))

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop any generation, close the session on its own thread, end the thread.
        Returns False when the engine thread did not end in time (e.g. still loading)."""
        self.stop()
        if not self.thread.isRunning():
            return True
        self._shutdown.emit()
        return bool(self.thread.wait(int(timeout_s * 1000)))
