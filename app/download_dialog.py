"""First-launch model download: size and destination first, then bytes, speed, ETA, Cancel.

The dialog never blocks the GUI thread: ``plan_download`` (a few HTTP requests) runs on a daemon
thread and the download itself in the child process of ``engine.hub.DownloadProcess``; one QTimer
polls both.  Cancel kills the child and leaves the partial files, so the next start resumes.

States: planning -> ready -> downloading (-> retry notices) -> verifying -> accepted;
planning -> failed (offline: where to put the files instead) -> planning again on "Try again".
"""
from __future__ import annotations

import errno
import html
import re
import importlib
import socket
import threading
import urllib.error
from concurrent.futures import Future
from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (QDialog, QFileDialog, QHBoxLayout, QLabel, QProgressBar,
                               QPushButton, QSizePolicy, QVBoxLayout)

from tritonchat.app.errors import describe_exception
from tritonchat.engine.errors import DownloadError
from tritonchat.engine.hub import free_bytes

POLL_MS = 200
_BAR_STEPS = 1000          # QProgressBar takes int; byte counts past 2 GiB would overflow it
_NETWORK_ERRNOS = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED, errno.ECONNRESET,
                   errno.ETIMEDOUT, errno.ENETDOWN}
# Exception class names (anywhere in the MRO) of requests / httpx / urllib3 / huggingface_hub that
# mean "the hub could not be reached"; matched by name so none of them has to be imported here.
_NETWORK_TYPES = {"ConnectionError", "ConnectError", "ConnectTimeout", "ReadTimeout", "Timeout",
                  "TimeoutError", "TimeoutException", "NewConnectionError", "MaxRetryError",
                  "NameResolutionError", "OfflineModeIsEnabled", "gaierror"}
REQUIRED_FILES = ("config.json", "tokenizer.json")


def _hub():
    # Looked up at call time: the engine module loads only when the dialog is used, and tests
    # can stand a fake hub in sys.modules.
    return importlib.import_module("tritonchat.engine.hub")


def format_bytes(n: float) -> str:
    """Decimal units, as Hugging Face and browsers show file sizes."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


# engine.hub words its DownloadError sentences "Could not download X (no network); ...".
_NETWORK_WORDS = re.compile(r"\bno network\b|connection (stalled|dropped)|"
                            r"could not be reached|cannot be reached", re.I)


_VERIFY_WORDS = re.compile(r"sha256 check|checksum|damaged|corrupt|instead of", re.I)


def is_network_error(exc: BaseException) -> bool:
    """True when ``exc`` or what it was raised from says the hub could not be reached."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        names = {c.__name__ for c in type(exc).__mro__}
        if names & _NETWORK_TYPES or isinstance(exc, (socket.gaierror, socket.timeout)):
            return True
        if isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS:
            return True
        if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
            return True                       # DNS, refused, unreachable: no HTTP answer at all
        if isinstance(exc, DownloadError) and _NETWORK_WORDS.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _run_in_thread(fn, *args) -> Future:
    """Run ``fn(*args)`` on a daemon thread (a hung request must not hold up quitting the app)."""
    future: Future = Future()

    def target() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:   # noqa: BLE001 - handed to the GUI thread to report
            future.set_exception(exc)

    threading.Thread(target=target, name="tritonchat-plan-download", daemon=True).start()
    return future


class DownloadDialog(QDialog):
    """Downloads ``repo_id`` at ``revision`` into the Hugging Face cache (or ``cache_dir``).

    exec() returns Accepted once the files are downloaded and verified (``result_dir`` is then
    the model folder), Rejected on Cancel or when the user gives up after a failure.
    """

    def __init__(self, repo_id: str, revision: str | None = None, cache_dir=None, parent=None):
        super().__init__(parent)
        self.repo_id = repo_id
        self.revision = revision or _hub().DEFAULT_REVISION
        self.cache_dir = cache_dir
        self.result_dir: Path | None = None
        self.plan = None                  # hub.DownloadPlan once planning succeeded
        self.state = "planning"
        self._plan_future: Future | None = None
        self._proc = None                 # hub.DownloadProcess while downloading

        self.setWindowTitle("Download the model")
        self.setModal(True)
        self.setMinimumWidth(560)

        self.heading = QLabel(f"<b>{html.escape(repo_id)}</b> is needed to chat.", self)
        self.heading.setTextFormat(Qt.TextFormat.RichText)
        self.info_label = self._plain_label()
        self.dest_label = self._plain_label()
        self.dest_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.progress = QProgressBar(self)
        self.progress.setRange(0, _BAR_STEPS)
        self.rate_label = self._plain_label()
        self.file_label = self._plain_label()
        self.file_label.setStyleSheet("color: palette(mid);")
        self.notice_label = self._plain_label()
        self.notice_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.folder_button = QPushButton("Use a folder on disk…", self)
        self.folder_button.setToolTip("Pick a folder that already holds the model's files")
        self.retry_button = QPushButton("Try again", self)
        self.download_button = QPushButton("Download", self)
        self.download_button.setDefault(True)
        self.cancel_button = QPushButton("Cancel", self)
        self.folder_button.clicked.connect(self.choose_folder)
        self.retry_button.clicked.connect(self.retry)
        self.download_button.clicked.connect(self.start_download)
        self.cancel_button.clicked.connect(self.reject)

        buttons = QHBoxLayout()
        buttons.addWidget(self.folder_button)
        buttons.addStretch(1)
        for b in (self.retry_button, self.download_button, self.cancel_button):
            buttons.addWidget(b)
        layout = QVBoxLayout(self)
        for w in (self.heading, self.info_label, self.dest_label, self.progress, self.rate_label,
                  self.file_label, self.notice_label):
            layout.addWidget(w)
        layout.addStretch(1)
        layout.addLayout(buttons)

        self._timer = QTimer(self)
        self._timer.setInterval(POLL_MS)
        self._timer.timeout.connect(self._poll)
        self._start_planning()

    def _plain_label(self) -> QLabel:
        label = QLabel(self)
        label.setTextFormat(Qt.TextFormat.PlainText)
        label.setWordWrap(True)
        label.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
        return label

    def _manual_dir(self) -> Path:
        """Where files copied by hand are picked up: the hub's manual snapshot, else the cache."""
        hub = _hub()
        cache = Path(self.cache_dir) if self.cache_dir is not None else hub.model_cache_dir()
        for name in ("manual_model_dir", "_manual_dir"):
            fn = getattr(hub, name, None)
            if callable(fn):
                return Path(fn(self.repo_id, cache))
        return cache

    def _show_notice(self, text: str, kind: str = "info") -> None:
        colour = {"info": "palette(window-text)", "warn": "#b26a00", "error": "#b3261e"}[kind]
        self.notice_label.setStyleSheet(f"color: {colour};")
        self.notice_label.setText(text)
        self.notice_label.setVisible(bool(text))

    def _set_buttons(self, *, download: bool = False, retry: bool = False,
                     cancel_text: str = "Cancel") -> None:
        self.download_button.setVisible(download)
        self.retry_button.setVisible(retry)
        self.folder_button.setVisible(self.state in ("ready", "failed"))
        self.cancel_button.setText(cancel_text)

    # --- planning ---------------------------------------------------------------------------

    def _start_planning(self) -> None:
        self.state = "planning"
        self.info_label.setText("Checking the model on Hugging Face…")
        self.dest_label.clear()
        self.progress.setRange(0, 0)                 # busy indicator
        self.progress.show()
        self.rate_label.clear()
        self.file_label.clear()
        self._show_notice("")
        self._set_buttons()
        try:
            self._plan_future = _run_in_thread(_hub().plan_download, self.repo_id, self.revision,
                                               self.cache_dir)
        except Exception as exc:                     # the hub module itself failed to import
            self._plan_failed(exc)
            return
        self._timer.start()

    def _plan_ready(self, plan) -> None:
        self.plan = plan
        self.state = "ready"
        self.progress.setRange(0, _BAR_STEPS)
        self._show_bar(plan.have_bytes, plan.total_bytes)
        missing = max(0, plan.total_bytes - plan.have_bytes)
        if missing == 0:
            self.info_label.setText(
                f"All {len(plan.files)} files ({format_bytes(plan.total_bytes)}) are already here; "
                "they only need to be verified.")
            self.download_button.setText("Verify")
        elif plan.have_bytes > 0:
            self.info_label.setText(
                f"{format_bytes(plan.total_bytes)} in {len(plan.files)} files; "
                f"{format_bytes(plan.have_bytes)} are already here, so the download resumes "
                f"with the remaining {format_bytes(missing)}.")
            self.download_button.setText("Resume download")
        else:
            self.info_label.setText(
                f"{format_bytes(plan.total_bytes)} to download in {len(plan.files)} files.")
            self.download_button.setText("Download")
        damaged = self._damaged(plan)
        if damaged:
            first = damaged[0]
            more = f" and {len(damaged) - 1} more" if len(damaged) > 1 else ""
            self.info_label.setText(
                f"{first.name}{more} on disk failed verification ({first.detail}); "
                f"Download again replaces {'them' if more else 'it'} with a fresh copy.")
            self.download_button.setText("Download again")
        self.dest_label.setText(f"Destination: {plan.dest}")
        self.rate_label.clear()
        self._set_buttons(download=True)
        free = free_bytes(Path(plan.dest))
        if free is not None and free < missing:
            self._show_notice(f"Only {format_bytes(free)} are free on that disk but "
                              f"{format_bytes(missing)} are needed: free some space and press "
                              "Try again.", "error")
            self.download_button.setEnabled(False)
            self._set_buttons(download=True, retry=True)
        else:
            self.download_button.setEnabled(True)
            self._show_notice("")

    def _damaged(self, plan) -> list:
        """Files of the planned snapshot whose download record says they are damaged."""
        check = getattr(_hub(), "damaged_files", None)
        if check is None or not Path(plan.dest).is_dir():
            return []
        try:
            return list(check(plan.dest))
        except Exception:                             # noqa: BLE001 - a check that fails is no verdict
            return []

    def _plan_failed(self, exc: BaseException) -> None:
        self.state = "failed"
        self.progress.hide()
        self.rate_label.clear()
        try:
            manual = str(self._manual_dir())
        except Exception:                             # noqa: BLE001 - hub unusable: no cache path
            manual = ""
        folder = f"the folder {manual}" if manual else "the Hugging Face cache folder"
        where = (f"start `tritonchat --model DIR` with a folder holding the model's files, or put "
                 f"them in {folder}")
        sentence, details = describe_exception(exc)
        if is_network_error(exc):
            self.info_label.setText(
                f"There is no network connection to Hugging Face, so {self.repo_id} cannot be "
                f"downloaded now: connect and press Try again, or {where}.")
        elif manual and manual in sentence:           # the hub's sentence already says where
            self.info_label.setText(f"{sentence} You can also start `tritonchat --model DIR` "
                                    "with a folder holding the model's files.")
        else:
            self.info_label.setText(f"{sentence} To use the model without downloading, {where}.")
        self.dest_label.clear()
        self.notice_label.setToolTip(details)
        self._show_notice("")
        self._set_buttons(retry=True, cancel_text="Close")

    # --- downloading ------------------------------------------------------------------------

    def start_download(self) -> None:
        """Start (or resume) the download in the child process."""
        if self.plan is None or self.state in ("downloading", "verifying"):
            return
        self._proc = _hub().DownloadProcess(self.repo_id, self.revision, self.cache_dir)
        self._proc.start()
        self.state = "downloading"
        self.info_label.setText(f"Downloading {format_bytes(self.plan.total_bytes)} from "
                                "Hugging Face; Cancel keeps what is done for next time.")
        self._show_notice("")
        self._set_buttons()
        self._timer.start()

    def retry(self) -> None:
        if self.state == "failed" or self.plan is None:
            self._start_planning()
        elif self.state == "error":
            self.start_download()                     # resumes from the partial files
        elif self.state == "ready":
            self._start_planning()                    # e.g. after freeing disk space

    def _show_bar(self, done: int, total: int) -> None:
        if total > 0:
            self.progress.setRange(0, _BAR_STEPS)
            self.progress.setValue(min(_BAR_STEPS, int(done * _BAR_STEPS // total)))
        else:
            self.progress.setRange(0, 0)

    def _on_progress(self, p) -> None:
        if p.stage in ("download", "retry"):
            self._show_bar(p.done_bytes, p.total_bytes)
            parts = [f"{format_bytes(p.done_bytes)} of {format_bytes(p.total_bytes)}"]
            if p.speed_bps > 0:
                parts.append(f"{format_bytes(p.speed_bps)}/s")
            parts.append(f"{format_duration(p.eta_s)} left" if p.eta_s is not None
                         else "estimating time left")
            self.rate_label.setText(" · ".join(parts))
            if p.file:
                self.file_label.setText(p.file)
            if p.stage == "retry":
                # Stays up until the next stage, so a brief stall is still readable afterwards.
                self._show_notice(p.message or "The connection stalled; retrying.", "warn")
        elif p.stage == "verify":
            self.state = "verifying"
            self._show_bar(p.done_bytes, p.total_bytes)
            self.info_label.setText("Verifying the downloaded files…")
            self.rate_label.setText(p.message)
            self.file_label.setText(p.file)
        elif p.stage == "done":
            self._finish()
        elif p.stage == "error":
            self._download_failed(p.message or (self._proc.error if self._proc else None))
        elif p.stage == "cancelled":
            self.reject()

    def _finish(self) -> None:
        self._timer.stop()
        result = getattr(self._proc, "result_dir", None)
        if result is None:
            result = _hub().local_model_dir(self.repo_id, self.revision, self.cache_dir)
        if result is None:
            self._download_failed("The download finished but the model folder was not found.")
            return
        self.result_dir = Path(result)
        self.state = "done"
        self._show_bar(1, 1)
        self.accept()

    def _download_failed(self, message: str | None) -> None:
        self._timer.stop()
        self._stop_process()
        self.state = "error"
        text = message or "The download stopped unexpectedly."
        if _VERIFY_WORDS.search(text):               # a file failed its check: fetch it whole again
            self.retry_button.setText("Download again")
            self._show_notice(f"{text} Press Download again to replace it.", "error")
        else:
            self.retry_button.setText("Try again")
            self._show_notice(f"{text} Press Try again to resume where it stopped.", "error")
        self._set_buttons(retry=True, cancel_text="Close")

    def _stop_process(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.cancel()

    def _poll(self) -> None:
        if self.state == "planning" and self._plan_future is not None:
            if not self._plan_future.done():
                return
            self._timer.stop()
            future, self._plan_future = self._plan_future, None
            exc = future.exception()
            if exc is None:
                self._plan_ready(future.result())
            else:
                self._plan_failed(exc)
            return
        if self._proc is None or self.state not in ("downloading", "verifying"):
            return
        for p in self._proc.poll():
            self._on_progress(p)
            if self.state not in ("downloading", "verifying"):
                return
        if not self._proc.is_alive():
            # The child is gone: drain what it said last, then decide from its outcome.
            for p in self._proc.poll():
                self._on_progress(p)
                if self.state not in ("downloading", "verifying"):
                    return
            if getattr(self._proc, "result_dir", None) is not None:
                self._finish()
            else:
                self._download_failed(self._proc.error)

    # --- leaving --------------------------------------------------------------------------

    def choose_folder(self) -> None:
        """Use a folder that already holds the model instead of downloading it."""
        folder = QFileDialog.getExistingDirectory(self, "Folder with the model's files")
        if not folder:
            return
        path = Path(folder)
        missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
        if not any(path.glob("*.safetensors")):
            missing.append("*.safetensors")
        if missing:
            self._show_notice(f"{path} is not a model folder: it has no {', '.join(missing)}.",
                              "error")
            return
        self._stop_process()
        self._timer.stop()
        self.result_dir = path
        self.state = "done"
        self.accept()

    def reject(self) -> None:
        """Cancel, Esc or the window's close button: stop the child, keep the partial files."""
        self._timer.stop()
        self._stop_process()
        if self.state != "done":
            self.state = "cancelled"
        super().reject()
