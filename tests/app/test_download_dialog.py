"""DownloadDialog against a fake engine.hub: plan, progress, cancel, resume, retry, offline.

The fake hub below mirrors engine.hub's API and really writes the files, in chunks, on a thread
(the real DownloadProcess uses a child process), so cancel leaves partial files and a new dialog
has to resume from them.  A second test drives the real engine.hub against tests/fakehub.py
when both exist.
"""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import importlib
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QDialog, QFileDialog

from tritonchat.app import download_dialog as dd
from tritonchat.app.download_dialog import DownloadDialog, format_bytes, format_duration
from tritonchat.engine.errors import DownloadError

REPO = "Qwen/Qwen3.5-0.8B"
PINNED = "0123456789abcdef0123456789abcdef01234567"
SHARD = "model.safetensors-00001-of-00001.safetensors"


def _real_hub():
    try:
        return importlib.import_module("tritonchat.engine.hub")
    except ImportError:
        return None


_hub = _real_hub()
if _hub is not None:          # use the real dataclasses so a field rename breaks this test
    DownloadPlan, DownloadProgress = _hub.DownloadPlan, _hub.DownloadProgress
else:
    @dataclass
    class DownloadPlan:
        repo_id: str
        revision: str
        files: list
        total_bytes: int
        have_bytes: int
        dest: Path

    @dataclass
    class DownloadProgress:
        stage: str
        done_bytes: int
        total_bytes: int
        speed_bps: float
        eta_s: float | None
        file: str
        message: str


class FakeHub:
    """State behind the fake hub module: the remote files and knobs for the next download."""

    CHUNK = 4000

    def __init__(self, cache: Path):
        self.cache = cache
        self.files = {"config.json": b"{" + b" " * 198 + b"}",
                      "tokenizer.json": bytes(range(256)) * 20,
                      SHARD: os.urandom(60_000)}
        self.offline = False
        self.plan_error: BaseException | None = None
        self.plan_gate: threading.Event | None = None    # plan_download waits on it when set
        self.pause_at: int | None = None     # the download waits here until `release` is set
        self.release = threading.Event()
        self.retry_at: int | None = None     # emit one "retry" event when this many bytes are done
        self.fail_at: int | None = None      # stop with an "error" event here (once)
        self.die_silently = False            # the child vanishes without a word
        self.starts: list[int] = []          # bytes already on disk at each start
        self.processes: list[FakeProcess] = []

    @property
    def dest(self) -> Path:
        return self.cache / "models--Qwen--Qwen3.5-0.8B" / "snapshots" / "fakecommit"

    @property
    def total(self) -> int:
        return sum(len(b) for b in self.files.values())

    def have(self) -> int:
        return sum(min((self.dest / n).stat().st_size, len(b)) if (self.dest / n).exists() else 0
                   for n, b in self.files.items())

    def module(self) -> types.ModuleType:
        hub = types.ModuleType("tritonchat.engine.hub")
        hub.DEFAULT_MODEL, hub.DEFAULT_REVISION = REPO, PINNED
        hub.DownloadPlan, hub.DownloadProgress = DownloadPlan, DownloadProgress
        hub.model_cache_dir = lambda: self.cache
        hub.local_model_dir = lambda repo_id=REPO, revision=PINNED, cache_dir=None: (
            self.dest if self.have() == self.total else None)
        hub.plan_download = self.plan_download
        hub.DownloadProcess = lambda repo_id=REPO, revision=PINNED, cache_dir=None: (
            FakeProcess(self))
        return hub

    def plan_download(self, repo_id=REPO, revision=PINNED, cache_dir=None):
        if self.plan_gate is not None:
            self.plan_gate.wait(10)
        if self.offline:
            try:
                raise ConnectionError("Failed to resolve 'huggingface.co'")
            except ConnectionError as exc:
                raise DownloadError(f"Could not download {repo_id} (no network).") from exc
        if self.plan_error is not None:
            raise self.plan_error
        files = [(n, len(b), None) for n, b in self.files.items()]
        return DownloadPlan(repo_id, revision, files, self.total, self.have(), self.dest)


class FakeProcess:
    """Same surface as hub.DownloadProcess; a thread appends chunks to the destination files."""

    def __init__(self, hub: FakeHub):
        self.hub = hub
        self.result_dir: Path | None = None
        self.error: str | None = None
        self.cancelled = False
        self._events: list = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        hub.processes.append(self)

    def start(self) -> None:
        self._thread.start()

    def poll(self) -> list:
        with self._lock:
            events, self._events = self._events, []
        return events

    def cancel(self) -> None:
        self.cancelled = True
        self.hub.release.set()
        self._thread.join(5)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _emit(self, stage, done, file="", message="", speed=1.5e6, eta=12.0) -> None:
        with self._lock:
            self._events.append(DownloadProgress(stage, done, self.hub.total, speed, eta,
                                                 file, message))

    def _run(self) -> None:
        hub = self.hub
        hub.dest.mkdir(parents=True, exist_ok=True)
        done = hub.have()
        hub.starts.append(done)
        if hub.die_silently:
            hub.die_silently = False
            self.error = "The download process was killed."
            return
        self._emit("download", done, eta=None, speed=0.0)
        for name, data in hub.files.items():
            path = hub.dest / name
            with open(path, "ab") as f:
                pos = f.tell()
                while pos < len(data):
                    if self.cancelled:
                        return
                    chunk = data[pos:pos + FakeHub.CHUNK]
                    f.write(chunk)
                    f.flush()
                    pos += len(chunk)
                    done += len(chunk)
                    self._emit("download", done, name)
                    if hub.retry_at is not None and done >= hub.retry_at:
                        hub.retry_at = None
                        self._emit("retry", done, name,
                                   "The connection stalled; retrying in 2 s (attempt 2 of 6).")
                    if hub.fail_at is not None and done >= hub.fail_at:
                        hub.fail_at = None
                        self.error = "The hub answered 503 for " + name + "."
                        self._emit("error", done, name, self.error)
                        return
                    if hub.pause_at is not None and done >= hub.pause_at:
                        hub.pause_at = None
                        hub.release.wait(10)
                    time.sleep(0.002)
        self._emit("verify", 0, SHARD, "Checking sha256 of 3 files")
        for name, data in hub.files.items():
            if (hub.dest / name).read_bytes() != data:
                self.error = f"{name} is corrupt."
                self._emit("error", done, name, self.error)
                return
        self.result_dir = hub.dest
        self._emit("done", done)


@pytest.fixture
def fake(tmp_path, monkeypatch) -> FakeHub:
    hub = FakeHub(tmp_path / "cache")
    monkeypatch.setitem(sys.modules, "tritonchat.engine.hub", hub.module())
    yield hub
    hub.release.set()
    for p in hub.processes:
        p.cancel()


def open_dialog(qtbot, state="ready") -> DownloadDialog:
    dlg = DownloadDialog(REPO, cache_dir=None)
    qtbot.addWidget(dlg)
    dlg.open()
    qtbot.waitUntil(lambda: dlg.state == state, timeout=5000)
    return dlg


def test_format_helpers():
    assert format_bytes(0) == "0 B"
    assert format_bytes(999) == "999 B"
    assert format_bytes(1000) == "1.00 kB"
    assert format_bytes(1_746_942_600) == "1.75 GB"
    assert format_bytes(12_345_678_901_234) == "12345.68 GB"
    assert format_duration(0) == "0 s"
    assert format_duration(59.4) == "59 s"
    assert format_duration(61) == "1 min 01 s"
    assert format_duration(3 * 3600 + 5 * 60 + 7) == "3 h 05 min"


def test_planning_does_not_block_the_gui(qtbot, fake):
    fake.plan_gate = threading.Event()
    t0 = time.monotonic()
    dlg = DownloadDialog(REPO)
    qtbot.addWidget(dlg)
    dlg.open()
    assert time.monotonic() - t0 < 2
    assert dlg.state == "planning"
    assert (dlg.progress.minimum(), dlg.progress.maximum()) == (0, 0)    # busy bar
    assert not dlg.download_button.isVisible()
    fake.plan_gate.set()
    qtbot.waitUntil(lambda: dlg.state == "ready", timeout=5000)


def test_plan_shows_size_and_destination(qtbot, fake):
    dlg = open_dialog(qtbot)
    assert dlg.revision == PINNED                    # the hub module's pinned commit, no other
    assert format_bytes(fake.total) in dlg.info_label.text()
    assert "3 files" in dlg.info_label.text()
    assert str(fake.dest) in dlg.dest_label.text()
    assert dlg.download_button.isVisible() and dlg.download_button.isEnabled()
    assert dlg.download_button.text() == "Download"
    assert dlg.progress.value() == 0
    assert fake.processes == []                      # nothing downloads before the click


def test_progress_is_shown_then_accepted(qtbot, fake):
    fake.pause_at = fake.total // 2
    dlg = open_dialog(qtbot)
    qtbot.mouseClick(dlg.download_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dlg.progress.value() >= 400, timeout=5000)
    assert dlg.state == "downloading"
    text = dlg.rate_label.text()
    assert f"of {format_bytes(fake.total)}" in text
    assert "1.50 MB/s" in text and "12 s left" in text
    assert dlg.file_label.text() == SHARD
    assert dlg.cancel_button.isVisible() and not dlg.download_button.isVisible()
    with qtbot.waitSignal(dlg.finished, timeout=10000) as blocker:
        fake.release.set()
    assert blocker.args == [QDialog.DialogCode.Accepted.value]
    assert dlg.result_dir == fake.dest
    assert dlg.progress.value() == 1000
    for name, data in fake.files.items():
        assert (fake.dest / name).read_bytes() == data


def test_exec_returns_accepted(qtbot, fake):
    dlg = DownloadDialog(REPO)
    qtbot.addWidget(dlg)

    def click_when_ready():
        if dlg.state == "ready":
            dlg.download_button.click()
        else:
            QTimer.singleShot(20, click_when_ready)

    QTimer.singleShot(20, click_when_ready)
    assert dlg.exec() == QDialog.DialogCode.Accepted.value
    assert dlg.result_dir == fake.dest


def test_cancel_keeps_partial_files_and_next_dialog_resumes(qtbot, fake):
    fake.pause_at = 30_000
    dlg = open_dialog(qtbot)
    dlg.download_button.click()
    qtbot.waitUntil(lambda: fake.have() >= 30_000, timeout=5000)
    with qtbot.waitSignal(dlg.finished, timeout=5000) as blocker:
        qtbot.mouseClick(dlg.cancel_button, Qt.MouseButton.LeftButton)
    assert blocker.args == [QDialog.DialogCode.Rejected.value]
    assert dlg.result_dir is None and dlg.state == "cancelled"
    (proc,) = fake.processes
    assert proc.cancelled and not proc.is_alive()
    partial = fake.have()
    assert 30_000 <= partial < fake.total                # partial files stay on disk

    fake.release.clear()
    again = open_dialog(qtbot)
    assert again.download_button.text() == "Resume download"
    assert format_bytes(partial) in again.info_label.text()
    assert f"remaining {format_bytes(fake.total - partial)}" in again.info_label.text()
    assert again.progress.value() == partial * 1000 // fake.total
    with qtbot.waitSignal(again.finished, timeout=10000) as blocker:
        again.download_button.click()
    assert blocker.args == [QDialog.DialogCode.Accepted.value]
    assert fake.starts == [0, partial]                   # resumed, not restarted from zero
    for name, data in fake.files.items():
        assert (fake.dest / name).read_bytes() == data


def test_closing_the_window_cancels_the_download(qtbot, fake):
    fake.pause_at = 10_000
    dlg = open_dialog(qtbot)
    dlg.download_button.click()
    qtbot.waitUntil(lambda: dlg.progress.value() > 0, timeout=5000)
    with qtbot.waitSignal(dlg.finished, timeout=5000):
        qtbot.keyClick(dlg, Qt.Key.Key_Escape)
    assert fake.processes[0].cancelled and not fake.processes[0].is_alive()


def test_retry_message_is_shown(qtbot, fake):
    fake.retry_at = 8_000
    fake.pause_at = 16_000
    dlg = open_dialog(qtbot)
    dlg.download_button.click()
    qtbot.waitUntil(lambda: "retrying" in dlg.notice_label.text(), timeout=5000)
    assert "attempt 2 of 6" in dlg.notice_label.text()
    assert not dlg.notice_label.isHidden()
    qtbot.waitUntil(lambda: dlg.progress.value() >= 16_000 * 1000 // fake.total, timeout=5000)
    assert "retrying" in dlg.notice_label.text()          # still readable after the stall
    with qtbot.waitSignal(dlg.finished, timeout=10000):
        fake.release.set()
    assert dlg.result() == QDialog.DialogCode.Accepted.value


def test_verify_stage_is_shown(qtbot, fake, monkeypatch):
    seen = []
    original = DownloadDialog._on_progress

    def spy(self, p):
        original(self, p)
        if p.stage == "verify":
            seen.append((self.state, self.info_label.text(), self.rate_label.text()))

    monkeypatch.setattr(DownloadDialog, "_on_progress", spy)
    dlg = open_dialog(qtbot)
    with qtbot.waitSignal(dlg.finished, timeout=10000):
        dlg.download_button.click()
    assert seen == [("verifying", "Verifying the downloaded files…", "Checking sha256 of 3 files")]


def test_download_error_then_try_again_resumes(qtbot, fake):
    fake.fail_at = 20_000
    dlg = open_dialog(qtbot)
    dlg.download_button.click()
    qtbot.waitUntil(lambda: dlg.state == "error", timeout=5000)
    assert "503" in dlg.notice_label.text() and "Try again" in dlg.notice_label.text()
    assert dlg.retry_button.isVisible() and dlg.cancel_button.text() == "Close"
    partial = fake.have()
    with qtbot.waitSignal(dlg.finished, timeout=10000):
        dlg.retry_button.click()
    assert dlg.result() == QDialog.DialogCode.Accepted.value
    assert fake.starts == [0, partial] and partial > 0


def test_child_dying_silently_is_an_error(qtbot, fake):
    fake.die_silently = True
    dlg = open_dialog(qtbot)
    dlg.download_button.click()
    qtbot.waitUntil(lambda: dlg.state == "error", timeout=5000)
    assert "killed" in dlg.notice_label.text()


def test_offline_says_no_network_and_where_to_put_files(qtbot, fake):
    fake.offline = True
    dlg = open_dialog(qtbot, state="failed")
    text = dlg.info_label.text()
    assert "no network" in text
    assert "tritonchat --model DIR" in text
    assert str(fake.cache) in text
    assert text.count(". ") == 0 and text.endswith(".")  # one sentence
    assert dlg.retry_button.isVisible() and not dlg.download_button.isVisible()
    assert dlg.folder_button.isVisible()
    assert "ConnectionError" in dlg.notice_label.toolTip()
    # Back online: Try again plans afresh.
    fake.offline = False
    dlg.retry_button.click()
    qtbot.waitUntil(lambda: dlg.state == "ready", timeout=5000)
    assert dlg.download_button.isVisible()


def test_hub_worded_offline_error_without_a_cause(qtbot, fake):
    # engine.hub raises its DownloadError `from None`: only the wording says "no network".
    fake.plan_error = DownloadError(f"Could not download {REPO} (no network); try again later.")
    dlg = open_dialog(qtbot, state="failed")
    assert dlg.info_label.text().startswith("There is no network connection to Hugging Face")


def test_other_plan_failure_shows_its_sentence(qtbot, fake):
    fake.plan_error = DownloadError("The revision nope does not exist on the hub.")
    dlg = open_dialog(qtbot, state="failed")
    text = dlg.info_label.text()
    assert text.startswith("The revision nope does not exist on the hub.")
    assert "no network" not in text and "--model DIR" in text


def test_not_enough_disk_space(qtbot, fake, monkeypatch):
    monkeypatch.setattr(dd, "free_bytes", lambda path: 500)
    dlg = open_dialog(qtbot)
    assert not dlg.download_button.isEnabled()
    assert "Only 500 B are free" in dlg.notice_label.text()
    monkeypatch.setattr(dd, "free_bytes", lambda path: 10**12)
    dlg.retry_button.click()
    qtbot.waitUntil(lambda: dlg.state == "ready" and dlg.download_button.isEnabled(), timeout=5000)


def test_use_a_folder_on_disk(qtbot, fake, tmp_path, monkeypatch):
    folder = tmp_path / "my-model"
    folder.mkdir()
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(folder))
    dlg = open_dialog(qtbot)
    dlg.folder_button.click()
    assert dlg.isVisible() and "not a model folder" in dlg.notice_label.text()
    for name in ("config.json", "tokenizer.json", SHARD):
        (folder / name).write_bytes(b"x")
    with qtbot.waitSignal(dlg.finished, timeout=2000):
        dlg.folder_button.click()
    assert dlg.result() == QDialog.DialogCode.Accepted.value
    assert dlg.result_dir == folder


def test_is_network_error():
    import socket
    assert dd.is_network_error(ConnectionRefusedError())
    assert dd.is_network_error(socket.gaierror(-2, "Name or service not known"))
    wrapped = DownloadError("x")
    wrapped.__cause__ = TimeoutError()
    assert dd.is_network_error(wrapped)
    assert not dd.is_network_error(DownloadError("The revision does not exist."))
    assert not dd.is_network_error(FileNotFoundError(2, "No such file"))
    import urllib.error
    assert dd.is_network_error(urllib.error.URLError(OSError("unreachable")))
    assert not dd.is_network_error(
        urllib.error.HTTPError("https://x", 404, "Not Found", {}, None))


# --- the real engine.hub (no network here: offline paths, and tests/fakehub.py if present) ---

def _real_hub_dialog(qtbot, cache):
    dlg = DownloadDialog(REPO, cache_dir=cache)
    qtbot.addWidget(dlg)
    dlg.open()
    qtbot.waitUntil(lambda: dlg.state in ("ready", "failed"), timeout=20000)
    return dlg


def test_real_hub_offline_mode(qtbot, tmp_path, monkeypatch):
    hub = pytest.importorskip("tritonchat.engine.hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dlg = _real_hub_dialog(qtbot, tmp_path / "cache")
    assert dlg.state == "failed"
    text = dlg.info_label.text()
    assert text.startswith(f"Could not download {REPO}") and "tritonchat --model DIR" in text
    assert str(tmp_path / "cache") in text
    assert hub.DownloadError is DownloadError


def test_real_hub_unreachable(qtbot, tmp_path, monkeypatch):
    import functools
    import socket
    hub = pytest.importorskip("tritonchat.engine.hub")
    with socket.socket() as s:                       # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(hub, "RetryPolicy",
                        functools.partial(hub.RetryPolicy, attempts=1, backoff_s=0.01))
    dlg = _real_hub_dialog(qtbot, tmp_path / "cache")
    assert dlg.state == "failed"
    text = dlg.info_label.text()
    assert text.startswith("There is no network connection to Hugging Face")
    assert "tritonchat --model DIR" in text and str(tmp_path / "cache") in text


@pytest.fixture
def real_hub_env(request):
    """tests/fakehub.py's hub_env (HF_ENDPOINT/HF_HUB_CACHE in temp), skipped until it exists."""
    pytest.importorskip("tritonchat.engine.hub")
    fakehub = pytest.importorskip("tests.fakehub")
    return fakehub, request.getfixturevalue("hub_env")


try:                          # register the fixture real_hub_env asks for by name
    from tests.fakehub import hub_env  # noqa: F401
except ImportError:
    pass


def test_real_hub_download_cancel_and_resume(qtbot, real_hub_env):
    fakehub, env = real_hub_env
    files = fakehub.fake_model_files(weights_bytes=600_000, seed=3)
    server = env.serve(files, throttle_bps=250_000)

    dlg = _real_hub_dialog(qtbot, env.cache)
    assert dlg.state == "ready", dlg.info_label.text()
    assert dlg.plan.have_bytes == 0
    assert str(env.cache) in dlg.dest_label.text()
    dlg.download_button.click()
    qtbot.waitUntil(lambda: dlg.progress.value() >= 250, timeout=30000)
    assert " of " in dlg.rate_label.text() and "/s" in dlg.rate_label.text()
    with qtbot.waitSignal(dlg.finished, timeout=10000):
        dlg.cancel_button.click()
    assert dlg.result() == QDialog.DialogCode.Rejected.value
    assert not dlg._proc.is_alive()

    server.throttle_bps = None
    again = _real_hub_dialog(qtbot, env.cache)
    assert again.state == "ready"
    have = again.plan.have_bytes
    assert 0 < have < again.plan.total_bytes
    assert again.download_button.text() == "Resume download"
    with qtbot.waitSignal(again.finished, timeout=60000):
        again.download_button.click()
    assert again.result() == QDialog.DialogCode.Accepted.value, again.notice_label.text()
    assert (again.result_dir / fakehub.SHARD).read_bytes() == files[fakehub.SHARD]
    # The shard resumed with a Range request instead of starting from zero.
    ranges = server.body_ranges(fakehub.SHARD)
    assert any(r and not r.startswith("bytes=0-") for r in ranges), ranges


def test_real_hub_retry_is_shown_and_download_verifies(qtbot, real_hub_env):
    fakehub, env = real_hub_env
    files = fakehub.fake_model_files(weights_bytes=400_000, seed=5)
    env.serve(files, drop_once=True)
    dlg = _real_hub_dialog(qtbot, env.cache)
    assert dlg.state == "ready", dlg.info_label.text()
    stages = []
    original = dlg._on_progress
    dlg._on_progress = lambda p: (stages.append(p.stage), original(p))
    with qtbot.waitSignal(dlg.finished, timeout=60000):
        dlg.download_button.click()
    assert dlg.result() == QDialog.DialogCode.Accepted.value, dlg.notice_label.text()
    assert "retrying" in dlg.notice_label.text()
    assert "retry" in stages and "verify" in stages and stages[-1] == "done"
    assert (dlg.result_dir / fakehub.SHARD).read_bytes() == files[fakehub.SHARD]


def test_real_hub_damaged_file_is_offered_for_download_again(qtbot, real_hub_env):
    # #61.1: a shard damaged at the same size was "already here" and kept; now the dialog names it
    # and Download again replaces it.
    fakehub, env = real_hub_env
    from tritonchat.engine import hub
    files = fakehub.fake_model_files(weights_bytes=200_000, seed=7)
    server = env.serve(files)
    dest = hub.resolve_model(hub.DEFAULT_MODEL, retry=hub.RetryPolicy(attempts=2, backoff_s=0.01))
    blob = (dest / fakehub.SHARD).resolve()
    data = bytearray(blob.read_bytes())
    data[1234] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert hub.local_model_dir() is None
    dlg = _real_hub_dialog(qtbot, env.cache)
    assert dlg.state == "ready", dlg.info_label.text()
    assert dlg.download_button.text() == "Download again"
    assert fakehub.SHARD in dlg.info_label.text() and "failed verification" in dlg.info_label.text()
    served = server.served[fakehub.SHARD]
    with qtbot.waitSignal(dlg.finished, timeout=60000):
        dlg.download_button.click()
    assert dlg.result() == QDialog.DialogCode.Accepted.value, dlg.notice_label.text()
    assert (dlg.result_dir / fakehub.SHARD).read_bytes() == files[fakehub.SHARD]
    assert server.served[fakehub.SHARD] == 2 * served


def test_a_failed_check_offers_download_again(qtbot, fake):
    fake.fail_at = 0
    dlg = open_dialog(qtbot)
    dlg._download_failed("Could not download Qwen/Qwen3.5-0.8B (tokenizer.json failed its sha256 check twice).")
    assert dlg.retry_button.text() == "Download again" and "Download again" in dlg.notice_label.text()
    dlg._download_failed("The download stopped unexpectedly (exit code 1).")
    assert dlg.retry_button.text() == "Try again"
