"""Fetch the Qwen3.5 text model from the Hugging Face hub into the standard hub cache.

Why not `huggingface_hub.snapshot_download`: recent huggingface_hub (2.4 checked) writes every file
to a process-unique `<etag>.<random>.incomplete` that is deleted on failure and never looked at
again (its resume only spans retries inside one call), so a download that is cancelled, killed or
crashes restarts from zero. Here each file is fetched by our own resumable HTTP GET into
`blobs/<etag>.incomplete` (a stable name), with Range requests, exponential backoff on stalls and
drops, and a size + sha256 check (git blob id for small files) before it is published. The
download of a 1.7 GB shard therefore survives the GUI's cancel (which kills the child process).

What lands on disk is exactly the layout huggingface_hub writes, so either side finds the other's
downloads and `snapshot_download(..., local_files_only=True)` works offline afterwards:

    <cache>/models--Qwen--Qwen3.5-0.8B/
        blobs/<sha256 of LFS files | git blob id of small files>
        snapshots/<commit>/<file>  ->  ../../blobs/<etag>
        refs/main                  (the commit; written last, once every file is in)

The file listing comes from the hub's JSON API (`/api/models/<id>/revision/<rev>?blobs=true`, the
call behind `HfApi.model_info(files_metadata=True)`): it gives the commit, each file's size, git
blob id and, for LFS files, the sha256 we verify against. All HTTP goes through urllib so the
behaviour does not depend on which HTTP stack a given huggingface_hub version uses (requests,
httpx, httpx2) and never involves hf_xet. huggingface_hub is only asked, lazily, for the user's token.

No Qt, no platformdirs at import time: the engine imports this module on machines without them.
"""
from __future__ import annotations

import errno
import fnmatch
import hashlib
import http.client
import json
import math
import multiprocessing
import os
import queue as queue_module
import re
import shutil
import ssl
import sys
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from .errors import DownloadError

DEFAULT_MODEL = "Qwen/Qwen3.5-0.8B"
# The one place the model revision is pinned: the commit of Qwen/Qwen3.5-0.8B whose files every
# user gets (the snapshot the model's users run; its config, tokenizer and template are the ones
# docs/ and the tests follow). Downloads, the cache lookup and the GUI all follow this constant.
DEFAULT_REVISION = "2fc06364715b967f1860aea9cf38778875588b17"
DEFAULT_ENDPOINT = "https://huggingface.co"

# What the text model needs, matched against top-level repo paths (fnmatch, case-sensitive).
# The shards an index names are added to these at plan time, whatever their names.
TEXT_MODEL_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors*",  # model.safetensors, and Qwen's model.safetensors-00001-of-00001.safetensors
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "vocab.json",  # only without tokenizer.json (the engine reads tokenizer.json when it is there)
    "merges.txt",
)
_SLOW_TOKENIZER_FILES = ("vocab.json", "merges.txt")

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_ETAG_RE = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")  # git blob id or sha256: safe as a file name
_FIRST_CONTACT_ATTEMPTS = 2  # an offline machine hears "no network" in ~3 s, not after the full backoff
_CHUNK = 1 << 20  # bytes per read: at most one syscall each, so progress stays smooth on slow links
_SPEED_WINDOW_S = 5.0  # speed = bytes received over the last few seconds
_EVENT_INTERVAL_S = 0.1  # "download" events at most 10 per second (the GUI polls, the CLI redraws)
_MANUAL_SNAPSHOT = "manual"  # snapshots/manual: where a user can drop files fetched elsewhere


# ------------------------------------------------------------------------------------------------
# Public data


@dataclass
class DownloadPlan:
    """What a download will fetch: the text model's files at one commit, and where they go."""

    repo_id: str
    revision: str
    files: list[tuple[str, int, Optional[str]]]  # (name, size, sha256 of LFS files else None)
    total_bytes: int
    have_bytes: int  # already on disk: finished blobs plus partial .incomplete files
    dest: Path  # the snapshot folder the model will live in
    commit: str = ""
    etags: dict[str, str] = field(default_factory=dict)  # name -> blob name: sha256 (LFS) or git blob id
    cache_dir: Optional[Path] = None


@dataclass
class DownloadProgress:
    stage: str  # "download" | "retry" | "verify" | "done" | "error" | "cancelled"
    done_bytes: int = 0  # bytes of the planned files on disk (resumed bytes included)
    total_bytes: int = 0
    speed_bps: float = 0.0  # bytes per second received over the last few seconds
    eta_s: Optional[float] = None  # None while the speed is unknown
    file: str = ""  # the file being fetched or checked
    message: str = ""  # one line for the user (retry reason, error sentence, destination)


@dataclass(frozen=True)
class RetryPolicy:
    """How hard a download tries before giving up.

    A failure that received bytes resets the count: a slow flaky link still finishes.
    """

    attempts: int = 6  # consecutive failed attempts (no byte received) before giving up
    backoff_s: float = 1.0  # wait before the first retry, doubled after every failure
    max_backoff_s: float = 60.0
    stall_s: float = 30.0  # no byte for this long = the connection stalled

    def delay(self, failures: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** (failures - 1))


# ------------------------------------------------------------------------------------------------
# Where models live


def _expand(path: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(path)))


def model_cache_dir() -> Path:
    """The Hugging Face hub cache, found as huggingface_hub finds it, so that either side reuses the
    other's downloads: HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return _expand(os.environ[var])
    if os.environ.get("HF_HOME"):
        return _expand(os.environ["HF_HOME"]) / "hub"
    return _huggingface_default_cache()


def _huggingface_default_cache() -> Path:
    """Where huggingface_hub caches when neither HF_HUB_CACHE nor HF_HOME is set."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return _expand(base) / "huggingface" / "hub"


def _legacy_cache() -> Optional[Path]:
    """Where tritonchat used to download (the platformdirs user cache): still searched, never written."""
    try:
        import platformdirs  # lazy: absent on the GPU box
    except ImportError:
        return Path.home() / ".cache" / "tritonchat" / "hub"
    return Path(platformdirs.user_cache_dir("tritonchat", appauthor=False)) / "hub"


def _search_caches() -> list[Path]:
    """The hub cache first, then (no HF_* variable set) tritonchat's old cache folder."""
    caches = [model_cache_dir()]
    if not any(os.environ.get(v) for v in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME")):
        legacy = _legacy_cache()
        if legacy is not None and legacy not in caches:
            caches.append(legacy)
    return caches


def _repo_folder(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def _manual_dir(repo_id: str, cache: Path) -> Path:
    return cache / _repo_folder(repo_id) / "snapshots" / _MANUAL_SNAPSHOT


def is_local_dir(model: str) -> bool:
    """True for an existing folder or anything written like a path (/..., ./..., ../..., ~/...)."""
    if model.startswith(("/", ".", "~")) or "\\" in model or re.match(r"^[A-Za-z]:", model):
        return True
    return Path(model).expanduser().is_dir()


def _index_shards(data: bytes) -> list[str]:
    """The shard files a *.safetensors.index.json names (its weight_map values)."""
    index = json.loads(data)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError("no weight_map in the safetensors index")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not isinstance(shard, str) or not shard or shard.startswith("/") or ".." in shard.split("/"):
            raise ValueError(f"bad shard name {shard!r} in the safetensors index")
    return shards


def _snapshot_complete(folder: Path) -> bool:
    """A folder the loader can use: config, a tokenizer, and every weight file (dangling links fail)."""
    if not (folder / "config.json").is_file():
        return False
    if not ((folder / "tokenizer.json").is_file() or ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file())):
        return False
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if not indexes:
        return any(p.is_file() for p in folder.glob("*.safetensors"))
    for index in indexes:
        try:
            shards = _index_shards(index.read_bytes())
        except (OSError, ValueError):
            return False
        if not all((folder / shard).is_file() for shard in shards):
            return False
    return True


def _read_ref(repo_dir: Path, revision: str) -> Optional[str]:
    try:
        commit = (repo_dir / "refs" / revision).read_text().strip()
    except OSError:
        return None
    return commit or None


def _complete_snapshot(repo_dir: Path, revision: str) -> Optional[Path]:
    snapshots = repo_dir / "snapshots"
    if _COMMIT_RE.match(revision):
        # a pinned commit means exactly that commit, or the files a user put in snapshots/manual
        candidates = [snapshots / revision, snapshots / _MANUAL_SNAPSHOT]
    else:
        commit = _read_ref(repo_dir, revision)
        candidates = [snapshots / commit] if commit else []
        # Without a complete snapshot for the ref, any complete one beats nothing: an older
        # commit, or files a user copied into snapshots/manual.
        if snapshots.is_dir():
            others = [p for p in snapshots.iterdir() if p.is_dir() and p not in candidates]
            candidates += sorted(others, key=lambda p: p.stat().st_mtime, reverse=True)
    for folder in candidates:
        if _snapshot_complete(folder) and not damaged_files(folder):
            return folder
    return None


def _damaged_snapshot(repo_id: str, revision: str) -> Optional[tuple[Path, list[FileCheck]]]:
    """A complete-looking snapshot whose download record says some files are damaged."""
    for cache in _search_caches():
        repo_dir = cache / _repo_folder(repo_id)
        snapshots = repo_dir / "snapshots"
        commit = revision if _COMMIT_RE.match(revision) else _read_ref(repo_dir, revision)
        if commit and _snapshot_complete(snapshots / commit):
            damaged = damaged_files(snapshots / commit)
            if damaged:
                return snapshots / commit, damaged
    return None


def describe_damage(folder: Path, damaged: list[FileCheck]) -> str:
    first = damaged[0]
    more = f" and {len(damaged) - 1} more" if len(damaged) > 1 else ""
    return f"{first.name} in {folder} is damaged ({first.detail}){more}"


def local_model_dir(repo_id: str = DEFAULT_MODEL, revision: str = DEFAULT_REVISION, cache_dir=None) -> Optional[Path]:
    """The snapshot folder of a complete local copy of repo_id, or None. Never touches the network."""
    caches = [Path(cache_dir)] if cache_dir is not None else _search_caches()
    for cache in caches:
        found = _complete_snapshot(cache / _repo_folder(repo_id), revision)
        if found is not None:
            return found
    return None


# ------------------------------------------------------------------------------------------------
# Failures: a short reason phrase, turned into one user sentence at the public boundary


class _Failed(Exception):
    """A download that cannot go on. reason is a phrase without a period (it goes in parentheses)."""

    def __init__(self, reason: str, details: Optional[str] = None, sentence: Optional[str] = None):
        super().__init__(reason)
        self.reason = reason
        self.details = details
        self.sentence = sentence  # a whole sentence of its own, when "could not download" is the wrong frame


_CHOOSE_CACHE = "choose another folder with HF_HUB_CACHE (or HF_HOME), or pass --model DIR with a folder holding the model"


def _unwritable(cache: Path, e: OSError) -> _Failed:
    why = e.strerror or type(e).__name__
    return _Failed(f"{cache} cannot be written", f"{type(e).__name__}: {e}",
                   sentence=f"The model cache {cache} cannot be written ({why.lower()}); {_CHOOSE_CACHE}.")


def _disk_full(cache: Path, need: int, e: Optional[OSError] = None) -> _Failed:
    free = free_bytes(cache)
    have = f"has {format_size(free)} free but " if free is not None else "is full and "
    return _Failed(f"the disk holding {cache} is full", str(e) if e else None,
                   sentence=f"The disk holding {cache} {have}the model needs {format_size(need)} more; "
                            f"free some space, or {_CHOOSE_CACHE}.")


def free_bytes(path: Path) -> Optional[int]:
    """Free space on the disk that `path` (which may not exist yet) would be created on."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


_UNWRITABLE_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}


class _Transient(Exception):
    """A failure worth retrying; progressed says the attempt received bytes first."""

    def __init__(self, reason: str, progressed: bool = False, details: Optional[str] = None):
        super().__init__(reason)
        self.reason = reason
        self.progressed = progressed
        self.details = details


def _sentence(repo_id: str, reason: str, cache: Path, *, cli: bool) -> str:
    manual = _manual_dir(repo_id, cache)
    if cli:
        return (f"Could not download {repo_id} ({reason}); download it elsewhere and put its files in "
                f"{manual} or pass --model /path/to/folder.")
    return (f"Could not download {repo_id} ({reason}); try again later, or download it elsewhere and "
            f"put its files in {manual}.")


def _download_error(repo_id: str, failure: _Failed, cache: Path, *, cli: bool) -> DownloadError:
    if failure.sentence:
        return DownloadError(failure.sentence, failure.details)
    return DownloadError(_sentence(repo_id, failure.reason, cache, cli=cli), failure.details)


def _offline_env() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now: huggingface_hub reads it once at import."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def _retrying(attempt: Callable[[], object], policy: RetryPolicy, on_retry: Callable[[str, float, int], None]):
    """Run attempt() until it returns; _Transient failures wait policy.delay() and try again."""
    failures = 0
    while True:
        try:
            return attempt()
        except _Transient as t:
            failures = 1 if t.progressed else failures + 1
            if failures > policy.attempts:
                raise _Failed(t.reason, t.details) from None
            wait = policy.delay(failures)
            on_retry(t.reason, wait, failures)
            time.sleep(wait)


# ------------------------------------------------------------------------------------------------
# HTTP (urllib)


def _origin(url: str) -> tuple[str, str, Optional[int]]:
    parts = urllib.parse.urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or default


class _HubRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects, but never send the hub token to another host (a CDN's signed URL)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            new.remove_header("Authorization")
        return new


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("tritonchat")
    except Exception:  # running from a source tree that was never installed
        return "dev"


def _token() -> Optional[str]:
    """The user's hub token (HF_TOKEN or `hf auth login`), for gated or private models; None if none.

    Not build_hf_headers(): recent versions make a network call from it (agent detection).
    """
    if os.environ.get("HF_HUB_DISABLE_IMPLICIT_TOKEN", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return None
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:  # no huggingface_hub, or a token setup it rejects: go anonymous
        return os.environ.get("HF_TOKEN") or None


def _ssl_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    try:  # the hub's own clients trust certifi's bundle; some Pythons ship without system roots
        import certifi

        context.load_verify_locations(certifi.where())
    except (ImportError, OSError):
        pass
    return context


class _Hub:
    """The hub's HTTP endpoints we use, with the user's token and one shared opener."""

    def __init__(self, endpoint: Optional[str] = None, timeout: float = 30.0):
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self.timeout = timeout
        self.headers = {
            "User-Agent": f"tritonchat/{_version()}; python/{sys.version.split()[0]}",
            "Accept-Encoding": "identity",  # sizes and hashes are of the files' own bytes
        }
        token = _token()
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self._opener = urllib.request.build_opener(_HubRedirects(), urllib.request.HTTPSHandler(context=_ssl_context()))

    def info_url(self, repo_id: str, revision: str) -> str:
        return f"{self.endpoint}/api/models/{repo_id}/revision/{urllib.parse.quote(revision, safe='')}?blobs=true"

    def file_url(self, repo_id: str, commit: str, name: str) -> str:
        return f"{self.endpoint}/{repo_id}/resolve/{urllib.parse.quote(commit, safe='')}/{urllib.parse.quote(name)}"

    def open(self, url: str, offset: int = 0):
        """GET url (from byte offset); raises _Transient / _Failed with a reason phrase."""
        request = urllib.request.Request(url, headers=dict(self.headers))
        if offset:
            request.add_header("Range", f"bytes={offset}-")
        try:
            return self._opener.open(request, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            e.close()
            raise self._http_failure(e, url) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise _connection_failure(e) from None

    def _http_failure(self, e: urllib.error.HTTPError, url: str) -> Exception:
        code, kind = e.code, e.headers.get("X-Error-Code", "") if e.headers else ""
        details = f"HTTP {code} {kind} for {e.url or url}".strip()
        if code in (408, 429) or code >= 500:
            return _Transient(f"the hub answered HTTP {code}", details=details)
        if code == 403 and _origin(e.url or url) != _origin(self.endpoint):
            return _Transient("the download link expired", details=details)  # a CDN's signed URL: ask the hub again
        if kind == "GatedRepo":
            return _Failed("the model is gated: accept its terms on the hub and log in with `hf auth login`", details)
        if kind == "RepoNotFound":
            return _Failed("the hub has no model by that name", details)
        if kind == "RevisionNotFound":
            return _Failed("the hub has no such revision", details)
        if code == 404:
            return _Failed("the hub has no such file", details)
        if code in (401, 403):
            return _Failed(f"the hub refused access with HTTP {code}: log in with `hf auth login`", details)
        return _Failed(f"the hub answered HTTP {code}", details)


def _connection_failure(e: BaseException) -> Exception:
    reason = getattr(e, "reason", e) if isinstance(e, urllib.error.URLError) else e
    details = f"{type(reason).__name__}: {reason}"
    if isinstance(reason, ssl.SSLCertVerificationError):
        return _Failed("the hub's certificate could not be verified", details)
    if isinstance(reason, TimeoutError):  # socket.timeout: no byte for stall_s seconds
        return _Transient("the connection stalled", details=details)
    if isinstance(reason, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, ssl.SSLError,
                           http.client.HTTPException)):
        return _Transient("the connection dropped", details=details)
    if isinstance(reason, OSError):  # refused, unreachable, no DNS: nothing to talk to
        return _Transient("no network", details=details)
    return _Transient("the connection dropped", details=details)


def _read_all(hub: _Hub, url: str) -> bytes:
    with hub.open(url) as response:
        try:
            return response.read()
        except (OSError, http.client.HTTPException) as e:
            raise _connection_failure(e) from None


# ------------------------------------------------------------------------------------------------
# Progress accounting


class _Progress:
    """Bytes on disk for the planned files, the recent speed, and throttled events."""

    def __init__(self, total: int, done: int, emit: Callable[[DownloadProgress], None]):
        self.total, self.done, self.emit = total, done, emit
        self.file = ""
        self._received = 0  # bytes received this session (resumed bytes excluded from the speed)
        self._samples: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])
        self._last_event = 0.0

    def speed(self) -> float:
        now = time.monotonic()
        while len(self._samples) > 1 and now - self._samples[0][0] > _SPEED_WINDOW_S:
            self._samples.popleft()
        t0, b0 = self._samples[0]
        return (self._received - b0) / (now - t0) if now > t0 and self._received > b0 else 0.0

    def add(self, n: int) -> None:
        """n bytes landed on disk (negative: a partial or corrupt file was thrown away)."""
        self.done += n
        if n > 0:
            self._received += n
            self._samples.append((time.monotonic(), self._received))
        if time.monotonic() - self._last_event >= _EVENT_INTERVAL_S:
            self.event("download")

    def event(self, stage: str, message: str = "") -> None:
        self._last_event = time.monotonic()
        speed = self.speed() if stage == "download" else 0.0
        eta = (self.total - self.done) / speed if speed > 0 else None
        self.emit(DownloadProgress(stage, self.done, self.total, speed, eta, self.file, message))

    def on_retry(self, reason: str, wait: float, failures: int) -> None:
        shown = f"{wait:.1f}" if wait < 10 else f"{wait:.0f}"
        self.event("retry", f"{reason[:1].upper()}{reason[1:]}; retrying in {shown} s (attempt {failures + 1}).")


def _no_progress(_: DownloadProgress) -> None:
    pass


# ------------------------------------------------------------------------------------------------
# Planning


def _top_level_matches(name: str) -> bool:
    return "/" not in name and any(fnmatch.fnmatchcase(name, pattern) for pattern in TEXT_MODEL_FILES)


def _blob_path(cache: Path, repo_id: str, etag: str) -> Path:
    return cache / _repo_folder(repo_id) / "blobs" / etag


def _have_bytes(blob: Path, size: int) -> int:
    if blob.is_file() and blob.stat().st_size == size:
        return size
    part = blob.with_name(blob.name + ".incomplete")
    return min(part.stat().st_size, size) if part.is_file() else 0


def _plan(repo_id: str, revision: str, cache: Path, policy: RetryPolicy, progress: _Progress) -> DownloadPlan:
    if _offline_env():
        raise _Failed("offline mode is on: HF_HUB_OFFLINE is set")
    hub = _Hub(timeout=policy.stall_s)
    progress.file = ""
    first_contact = replace(policy, attempts=min(policy.attempts, _FIRST_CONTACT_ATTEMPTS))
    raw = _retrying(lambda: _read_all(hub, hub.info_url(repo_id, revision)), first_contact, progress.on_retry)
    try:
        info = json.loads(raw)
        commit = info["sha"]
        siblings = {s["rfilename"]: s for s in info["siblings"]}
    except (ValueError, KeyError, TypeError) as e:
        raise _Failed("the hub sent a file listing we could not read", repr(e)) from None
    if not isinstance(commit, str) or not _COMMIT_RE.match(commit):
        raise _Failed("the hub sent a file listing we could not read", f"commit {commit!r}")

    def etag_size_sha(name: str) -> tuple[str, int, Optional[str]]:
        entry, lfs = siblings[name], siblings[name].get("lfs")
        etag, size, sha256 = (lfs["sha256"], int(lfs["size"]), lfs["sha256"]) if lfs else (entry["blobId"], int(entry["size"]), None)
        if not (isinstance(etag, str) and _ETAG_RE.match(etag)) or size < 0:
            raise ValueError(f"bad id or size for {name}: {etag!r}, {size}")
        return etag, size, sha256

    try:
        names = sorted(n for n in siblings if _top_level_matches(n))
        indexes = [n for n in names if n.endswith(".safetensors.index.json")]
        if indexes:
            shards: set[str] = set()
            for index in indexes:
                etag, _, _ = etag_size_sha(index)
                blob = _blob_path(cache, repo_id, etag)
                data = blob.read_bytes() if blob.is_file() else _retrying(
                    lambda: _read_all(hub, hub.file_url(repo_id, commit, index)), policy, progress.on_retry)
                try:
                    shards.update(_index_shards(data))
                except ValueError as e:
                    raise _Failed(f"{index} on the hub is not a valid safetensors index", str(e)) from None
            missing = sorted(shards - siblings.keys())
            if missing:
                raise _Failed(f"{indexes[0]} names {missing[0]} but the repository has no such file")
            # With an index, the weights are exactly the shards it names (a stray consolidated copy is skipped).
            names = sorted({n for n in names if not n.endswith(".safetensors")} | shards)
        if "tokenizer.json" in names:
            names = [n for n in names if n not in _SLOW_TOKENIZER_FILES]
        if "config.json" not in names:
            raise _Failed("the repository has no config.json")
        if not any(n.endswith(".safetensors") for n in names):
            raise _Failed("the repository has no safetensors weights")
        described = {n: etag_size_sha(n) for n in names}
    except (KeyError, TypeError, ValueError) as e:
        raise _Failed("the hub sent a file listing we could not read", repr(e)) from None

    order = sorted(names, key=lambda n: (described[n][1], n))  # small files first: the shard is the long wait
    files = [(n, described[n][1], described[n][2]) for n in order]
    etags = {n: described[n][0] for n in order}
    total = sum(size for _, size, _ in files)
    have = sum(_have_bytes(_blob_path(cache, repo_id, etags[n]), size) for n, size, _ in files)
    dest = cache / _repo_folder(repo_id) / "snapshots" / commit
    return DownloadPlan(repo_id, revision, files, total, have, dest, commit, etags, cache)


def plan_download(repo_id: str = DEFAULT_MODEL, revision: str = DEFAULT_REVISION, cache_dir=None, *,
                  retry: Optional[RetryPolicy] = None) -> DownloadPlan:
    """Ask the hub what the text model's files are (names, sizes, sha256) and what is already here.

    Raises DownloadError (one sentence) when offline, when the hub cannot be reached (a few seconds
    of retries), or when the repository does not look like a model.
    """
    cache = Path(cache_dir) if cache_dir is not None else model_cache_dir()
    try:
        return _plan(repo_id, revision, cache, retry or RetryPolicy(), _Progress(0, 0, _no_progress))
    except _Failed as failure:
        raise _download_error(repo_id, failure, cache, cli=False) from None


# ------------------------------------------------------------------------------------------------
# Downloading


def _git_blob_id(path: Path) -> str:
    """The id git gives a file's content: sha1 of "blob <size>\\0" + content (the hub's ETag of small files)."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    return _hash_file(path, digest)


def _hash_file(path: Path, digest) -> str:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK * 8):
            digest.update(chunk)
    return digest.hexdigest()


def _verify(part: Path, size: int, sha256: Optional[str], etag: str) -> Optional[str]:
    """Why part is not the file the hub described, or None when it is."""
    actual = part.stat().st_size
    if actual != size:
        return f"came with {actual} bytes instead of {size}"
    if sha256 is not None:
        return None if _hash_file(part, hashlib.sha256()) == sha256.lower() else "failed its sha256 check"
    return None if _git_blob_id(part) == etag.lower() else "failed its checksum"


def _fetch_once(hub: _Hub, url: str, part: Path, size: int, progress: _Progress) -> None:
    """One GET appending to part from its current length; _Transient if it ends short."""
    have = part.stat().st_size if part.exists() else 0
    if have > size:  # longer than the file can be: nothing in it is trustworthy
        part.unlink()
        progress.add(-size)
        have = 0
    if have == size:
        return
    received = 0
    with hub.open(url, offset=have) as response:
        start = 0
        if have and response.status == 206:
            match = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
            start = int(match.group(1)) if match else -1
        if start != have:
            # The server ignored the Range (or answered another one): keep nothing, take its bytes from 0.
            if start != 0:
                raise _Transient("the server sent a byte range we did not ask for")
            progress.add(-have)
            have = 0
        with open(part, "ab" if have else "wb") as out:
            while True:
                try:
                    chunk = response.read1(_CHUNK)
                except (OSError, http.client.HTTPException) as e:  # only the socket: a full disk is no retry
                    failure = _connection_failure(e)
                    if isinstance(failure, _Transient):
                        failure.progressed = received > 0
                    raise failure from None
                if not chunk:
                    break
                out.write(chunk)
                received += len(chunk)
                progress.add(len(chunk))
    if have + received < size:
        raise _Transient("the connection dropped", progressed=received > 0)


def _link(blob: Path, pointer: Path) -> None:
    """snapshots/<commit>/<name> -> ../../blobs/<etag>, as huggingface_hub lays it out."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if pointer.is_file() and pointer.resolve() == blob.resolve():
        return
    if pointer.exists() or pointer.is_symlink():
        pointer.unlink()
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except OSError:  # no symlinks (Windows without developer mode): a hard link, else a copy
        try:
            os.link(blob, pointer)
        except OSError:
            shutil.copyfile(blob, pointer)


def _write_ref(repo_dir: Path, revision: str, commit: str) -> None:
    if _COMMIT_RE.match(revision) or _read_ref(repo_dir, revision) == commit:
        return
    ref = repo_dir / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(ref.name + f".{os.getpid()}.tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref)


def _lock(cache: Path, repo_id: str, etag: str):
    """The lock huggingface_hub takes for the same blob, so two downloaders never share a part file."""
    from filelock import FileLock  # a huggingface_hub dependency

    path = cache / ".locks" / _repo_folder(repo_id) / f"{etag}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path))


def _fetch_file(plan: DownloadPlan, hub: _Hub, name: str, size: int, sha256: Optional[str],
                policy: RetryPolicy, progress: _Progress, stamps: dict) -> None:
    cache = plan.cache_dir or model_cache_dir()
    etag = plan.etags[name]
    blob = _blob_path(cache, plan.repo_id, etag)
    part = blob.with_name(blob.name + ".incomplete")
    pointer = plan.dest / name
    progress.file = name
    if blob.is_file() and blob.stat().st_size == size:
        # On disk at the right size: trusted only with our record of it, else hashed once now (a blob
        # damaged at the same size, or one another tool wrote). A damaged one is fetched again.
        if _stamp_matches(stamps.get(name), blob, etag):
            _link(blob, pointer)
            return
        progress.event("verify", f"Checking {name}.")
        problem = _verify(blob, size, sha256, etag)
        if problem is None:
            _link(blob, pointer)
            stamps[name] = _stamp_entry(blob, etag, sha256)
            return
        progress.event("retry", f"{name} on disk {problem}; downloading it again.")
        progress.add(-size)
        blob.unlink()
        stamps.pop(name, None)
    blob.parent.mkdir(parents=True, exist_ok=True)
    from filelock import Timeout

    lock = _lock(cache, plan.repo_id, etag)
    try:
        lock.acquire(timeout=1.0)
    except Timeout:
        raise _Failed(f"another program is downloading {name} into {cache} right now") from None
    try:
        url = hub.file_url(plan.repo_id, plan.commit, name)
        _fetch_verified(hub, url, name, size, sha256, etag, policy, progress, blob, part)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _disk_full(cache, max(0, progress.total - progress.done), e) from None
        raise
    finally:
        lock.release()
    _link(blob, pointer)
    stamps[name] = _stamp_entry(blob, etag, sha256)


def _fetch_verified(hub: _Hub, url: str, name: str, size: int, sha256: Optional[str], etag: str,
                    policy: RetryPolicy, progress: _Progress, blob: Path, part: Path) -> None:
    """part -> blob once its size and hash match; one more full fetch after a mismatch."""
    if blob.is_file() and blob.stat().st_size != size:
        blob.unlink()  # a truncated blob from some earlier accident
    for fetch in (1, 2):
        _retrying(lambda: _fetch_once(hub, url, part, size, progress), policy, progress.on_retry)
        progress.event("verify", f"Checking {name}.")
        problem = _verify(part, size, sha256, etag)
        if problem is None:
            os.replace(part, blob)
            return
        progress.add(-part.stat().st_size)
        part.unlink()
        if fetch == 2:
            raise _Failed(f"{name} {problem} twice", f"{name}: {problem}")
        progress.event("retry", f"{name} {problem}; downloading it again.")


def _download(plan: DownloadPlan, policy: RetryPolicy, progress: _Progress) -> Path:
    cache = plan.cache_dir or model_cache_dir()
    try:
        return _download_into(plan, policy, progress, cache)
    except OSError as e:
        if e.errno in _UNWRITABLE_ERRNOS:
            raise _unwritable(cache, e) from None
        if e.errno == errno.ENOSPC:
            raise _disk_full(cache, max(0, plan.total_bytes - progress.done), e) from None
        raise


def _check_writable(folder: Path) -> None:
    """OSError now, before any byte is fetched, when folder cannot take new files."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".tritonchat-write-test-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


def _download_into(plan: DownloadPlan, policy: RetryPolicy, progress: _Progress, cache: Path) -> Path:
    repo_dir = cache / _repo_folder(plan.repo_id)
    _check_writable(repo_dir / "blobs")
    need = max(0, plan.total_bytes - plan.have_bytes)
    free = free_bytes(repo_dir)
    if free is not None and free < need:
        raise _disk_full(cache, need)
    hub = _Hub(timeout=policy.stall_s)
    progress.total, progress.done = plan.total_bytes, plan.have_bytes
    progress.event("download", f"Downloading {len(plan.files)} files ({format_size(plan.total_bytes)}) to {plan.dest}.")
    stamps = _read_stamps(plan.dest)
    try:
        for name, size, sha256 in plan.files:
            _fetch_file(plan, hub, name, size, sha256, policy, progress, stamps)
    finally:
        _write_stamps(plan.dest, stamps)
    _write_ref(repo_dir, plan.revision, plan.commit)
    progress.file = ""
    progress.done = progress.total
    return plan.dest


# ------------------------------------------------------------------------------------------------
# Verification records: each file checked against the hub's sha256 / git blob id once, after its
# download; at load only its size and mtime are compared with the record (cheap). `verify` hashes.
#
#     <cache>/models--Qwen--Qwen3.5-0.8B/.tritonchat/verified-<commit>.json
#         {"files": {"<name>": {"size", "mtime_ns", "etag", "sha256", "verified_at"}}}
#
# Beside refs/, blobs/ and snapshots/, where huggingface_hub looks at nothing.

_STAMP_DIR = ".tritonchat"


def _stamp_path(snapshot: Path) -> Path:
    return snapshot.parent.parent / _STAMP_DIR / f"verified-{snapshot.name}.json"


def _read_stamps(snapshot: Path) -> dict:
    try:
        data = json.loads(_stamp_path(snapshot).read_text(encoding="utf-8"))
        files = data["files"]
        return {k: v for k, v in files.items() if isinstance(v, dict)} if isinstance(files, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _write_stamps(snapshot: Path, stamps: dict) -> None:
    """Best effort: a read-only cache keeps working, it is only checked in full more often."""
    path = _stamp_path(snapshot)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"files": stamps}, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def _stamp_entry(blob: Path, etag: str, sha256: Optional[str]) -> dict:
    st = blob.stat()
    if sha256 is None:  # a small file, checked by its git blob id: its sha256 is cheap
        sha256 = _hash_file(blob, hashlib.sha256())
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "etag": etag, "sha256": sha256.lower(),
            "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _stamp_matches(entry: Optional[dict], path: Path, etag: Optional[str] = None) -> bool:
    if not entry or (etag is not None and entry.get("etag") != etag):
        return False
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_size == entry.get("size") and st.st_mtime_ns == entry.get("mtime_ns")


@dataclass
class FileCheck:
    name: str
    status: str  # "ok" | "damaged" | "unverified" (no record and no hub id to check against)
    detail: str = ""


def _expected_of(path: Path, entry: Optional[dict]) -> tuple[Optional[int], Optional[str], Optional[str]]:
    """(size, sha256, git blob id) a file should have: from our record, else from the name of the
    blob a hub-cache pointer resolves to (huggingface_hub names blobs by their sha256 / blob id)."""
    if entry:
        return entry.get("size"), entry.get("sha256"), entry.get("etag") if len(entry.get("etag") or "") == 40 else None
    target = path.resolve().name if path.is_symlink() else ""
    if _ETAG_RE.match(target):
        return None, (target if len(target) == 64 else None), (target if len(target) == 40 else None)
    return None, None, None


def _check_file(folder: Path, name: str, entry: Optional[dict], full: bool) -> FileCheck:
    path = folder / name
    if not path.is_file():
        return FileCheck(name, "damaged", "missing")
    size, sha256, blob_id = _expected_of(path, entry)
    actual = path.stat().st_size
    if size is not None and actual != size:
        return FileCheck(name, "damaged", f"{actual} bytes instead of {size}")
    if sha256 is None and blob_id is None:
        return FileCheck(name, "unverified", "no download record")
    if not full and _stamp_matches(entry, path):
        return FileCheck(name, "ok", "size and record match")
    if sha256 is not None:
        good = _hash_file(path, hashlib.sha256()) == sha256
    else:
        good = _git_blob_id(path) == blob_id
    return FileCheck(name, "ok", "hash matches") if good else FileCheck(name, "damaged", "its content does not match its hash")


def check_snapshot(folder, *, full: bool = False) -> list[FileCheck]:
    """Every file of a model folder against what it should be.

    full=False (at load): size and mtime against the download record, a hash only for a file whose
    mtime changed since it was verified. full=True (`tritonchat verify`): every file hashed.
    Files in a folder with no record and no hub blob names are "unverified".
    """
    folder = Path(folder)
    stamps = _read_stamps(folder)
    names = sorted(set(stamps) | {p.name for p in folder.iterdir() if p.is_file()}) if folder.is_dir() else []
    checks = [_check_file(folder, n, stamps.get(n), full) for n in names]
    refreshed = False
    for c in checks:  # a file whose mtime moved but whose hash still matches: record that
        entry = stamps.get(c.name)
        if c.status == "ok" and entry and c.detail == "hash matches" and not _stamp_matches(entry, folder / c.name):
            st = (folder / c.name).stat()
            entry.update(size=st.st_size, mtime_ns=st.st_mtime_ns,
                         verified_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            refreshed = True
    if refreshed:
        _write_stamps(folder, stamps)
    return checks


def damaged_files(folder) -> list[FileCheck]:
    """The cheap load-time check: the files of folder its download record says are damaged."""
    return [c for c in check_snapshot(folder) if c.status == "damaged"]


def _done(plan: DownloadPlan, progress: _Progress) -> None:
    progress.event("done", f"Downloaded {plan.repo_id} to {plan.dest}.")


def download(plan: DownloadPlan, *, progress: Optional[Callable[[DownloadProgress], None]] = None,
             retry: Optional[RetryPolicy] = None) -> Path:
    """Fetch what plan lists, in this process; returns the snapshot folder. DownloadError on failure."""
    tracker = _Progress(plan.total_bytes, plan.have_bytes, progress or _no_progress)
    try:
        dest = _download(plan, retry or RetryPolicy(), tracker)
        _done(plan, tracker)
        return dest
    except _Failed as failure:
        error = _download_error(plan.repo_id, failure, plan.cache_dir or model_cache_dir(), cli=False)
        tracker.event("error", str(error))
        raise error from None


def resolve_model(model: str, *, offline: bool = False, progress: Optional[Callable[[DownloadProgress], None]] = None,
                  retry: Optional[RetryPolicy] = None) -> Path:
    """The folder to load model from: a local folder as given, else the hub id's cached or downloaded snapshot.

    Downloads (in this process, progress events to `progress`) only when no complete copy is cached.
    Offline (the flag or HF_HUB_OFFLINE=1) or a failed download raises DownloadError, one sentence
    saying where to put the files instead.
    """
    if is_local_dir(model):
        return Path(model).expanduser()  # existence is the loader's to check, with its own message
    repo_id, revision = model, DEFAULT_REVISION
    found = local_model_dir(repo_id, revision)
    if found is not None:
        return found
    cache = model_cache_dir()
    emit = progress or _no_progress
    tracker = _Progress(0, 0, emit)
    damage = _damaged_snapshot(repo_id, revision)
    try:
        if damage is not None:
            if offline or _offline_env():
                raise _Failed("damaged", sentence=f"{describe_damage(*damage)}; go online to download it again "
                                                  f"(it is replaced), or pass --model DIR.")
            tracker.event("retry", f"{describe_damage(*damage)}; downloading it again.")
        if offline:
            raise _Failed("offline mode is on")
        plan = _plan(repo_id, revision, cache, retry or RetryPolicy(), tracker)
        dest = _download(plan, retry or RetryPolicy(), tracker)
        _done(plan, tracker)
        return dest
    except _Failed as failure:
        error = _download_error(repo_id, failure, cache, cli=True)
        tracker.event("error", str(error))
        raise error from None
    except KeyboardInterrupt:
        tracker.event("cancelled", "Download cancelled; run again to resume where it stopped.")
        raise


# ------------------------------------------------------------------------------------------------
# The download in a child process (the GUI's path: cancel = kill the child, partial files stay)


def _watch_parent() -> None:
    """Exit when the parent dies (a crashed GUI must not leave a download running forever)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _child_main(repo_id: str, revision: str, cache: str, policy: RetryPolicy, events) -> None:
    # Our transfers are plain HTTP already; this keeps any hub code in this process off hf_xet too.
    os.environ["HF_HUB_DISABLE_XET"] = "1"
    _watch_parent()
    progress = _Progress(0, 0, lambda event: events.put(("event", event)))
    try:
        plan = _plan(repo_id, revision, Path(cache), policy, progress)
        dest = _download(plan, policy, progress)
        events.put(("result", str(dest)))  # before "done": the parent stops reading at "done"
        _done(plan, progress)
    except _Failed as failure:
        progress.event("error", failure.sentence or _sentence(repo_id, failure.reason, Path(cache), cli=False))
    except Exception as e:  # a bug: still one sentence for the GUI, the traceback on stderr
        traceback.print_exc()
        progress.event("error", _sentence(repo_id, f"unexpected {type(e).__name__}", Path(cache), cli=False))


class DownloadProcess:
    """A download running in a spawned child process; the GUI polls it on a timer.

    Single use: start() once; to retry or resume, make a new one (it continues the partial files).
    """

    def __init__(self, repo_id: str = DEFAULT_MODEL, revision: str = DEFAULT_REVISION, cache_dir=None, *,
                 retry: Optional[RetryPolicy] = None):
        self.repo_id, self.revision = repo_id, revision
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.retry = retry or RetryPolicy()
        self.result_dir: Optional[Path] = None
        self.error: Optional[str] = None
        self._process = None
        self._events = None
        self._finished = False
        self._pending: list[DownloadProgress] = []
        self._last = DownloadProgress("download")

    def start(self) -> None:
        if self._process is not None:
            raise RuntimeError("a DownloadProcess starts once; create a new one to download again")
        context = multiprocessing.get_context("spawn")  # no fork: the parent may hold Qt, CUDA and threads
        cache = self.cache_dir or model_cache_dir()  # decided here so parent and child agree
        self._events = context.Queue()
        self._process = context.Process(target=_child_main, name="tritonchat-download", daemon=True,
                                        args=(self.repo_id, self.revision, str(cache), self.retry, self._events))
        self._process.start()

    def _drain(self, wait_s: float = 0.0) -> list[DownloadProgress]:
        out: list[DownloadProgress] = []
        while not self._finished:
            try:
                kind, payload = self._events.get(timeout=wait_s) if wait_s else self._events.get_nowait()
            except (queue_module.Empty, EOFError, OSError):
                break
            if kind == "result":
                self.result_dir = Path(payload)
                continue
            out.append(payload)
            self._last = payload
            if payload.stage == "error":
                self.error = payload.message
            if payload.stage in ("done", "error"):
                self._finish()
        return out

    def poll(self) -> list[DownloadProgress]:
        """Events since the last poll, without blocking."""
        events, self._pending = self._pending, []
        if self._process is None or self._finished:
            return events
        events += self._drain()
        if not self._finished and not self._process.is_alive():
            events += self._drain(wait_s=0.2)  # what it sent just before exiting
            if not self._finished:
                code = self._process.exitcode
                self.error = (f"The download stopped unexpectedly (exit code {code}); "
                              f"start it again to resume where it stopped.")
                events.append(DownloadProgress("error", self._last.done_bytes, self._last.total_bytes,
                                               file=self._last.file, message=self.error))
                self._finish()
        return events

    def cancel(self) -> None:
        """Kill the child; partial files stay for the next download to resume. poll() then says "cancelled"."""
        if self._process is None or self._finished:
            return
        self._pending += self._drain()  # before the kill, while every message is whole
        if self._finished:
            return
        self._process.terminate()
        self._process.join(5.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)
        self._pending.append(DownloadProgress("cancelled", self._last.done_bytes, self._last.total_bytes,
                                              file=self._last.file,
                                              message="Download cancelled; it resumes where it stopped next time."))
        self._finish()

    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def _finish(self) -> None:
        self._finished = True
        if self._process is not None:
            self._process.join(5.0)
        if self._events is not None:
            self._events.close()


# ------------------------------------------------------------------------------------------------
# Text for people


def format_size(n: float) -> str:
    """Decimal units, as the hub shows sizes: 1.75 GB, 786.4 MB, 12 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def format_eta(seconds: Optional[float]) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _bar_line(event: DownloadProgress, width: int = 24) -> str:
    fraction = event.done_bytes / event.total_bytes if event.total_bytes else 0.0
    fraction = min(max(fraction, 0.0), 1.0)
    filled = int(fraction * width)
    speed = f"{format_size(event.speed_bps)}/s" if event.speed_bps > 0 else "-- B/s"
    return (f"Downloading {fraction * 100:5.1f}% [{'#' * filled}{'.' * (width - filled)}] "
            f"{format_size(event.done_bytes)} / {format_size(event.total_bytes)}  {speed}  ETA {format_eta(event.eta_s)}")


def cli_progress_printer(stream=None) -> Callable[[DownloadProgress], None]:
    """A progress callback drawing one self-updating line (a terminal) or a line every few seconds (a log).

    Errors only end the line: the caller prints the DownloadError that follows.
    """
    out = stream if stream is not None else sys.stderr
    try:
        tty = bool(out.isatty())
    except (AttributeError, ValueError):
        tty = False
    interval = 0.1 if tty else 5.0
    state = {"last": -math.inf, "width": 0}

    def write_bar(line: str) -> None:
        out.write("\r" + line.ljust(state["width"]))
        state["width"] = len(line)

    def end_line() -> None:
        if state["width"]:
            out.write("\n")
            state["width"] = 0

    def show(event: DownloadProgress) -> None:
        now = time.monotonic()
        if event.stage == "download":
            if event.message:  # the opening line: how much, and where to
                end_line()
                out.write(event.message + "\n")
            elif now - state["last"] < interval:
                return
            state["last"] = now
            if tty:
                write_bar(_bar_line(event))
            else:
                out.write(_bar_line(event) + "\n")
        elif event.stage == "done":
            if tty:
                write_bar(_bar_line(event))
                end_line()
            out.write(event.message + "\n" if event.message else "")
        elif event.stage == "verify":
            return  # quick next to the transfer; the bar stays
        elif event.stage == "error":
            end_line()  # the caller prints the DownloadError itself
        else:  # retry, cancelled: a line of its own, the bar resumes below
            end_line()
            out.write(event.message + "\n")
            state["last"] = -math.inf
        out.flush()

    return show
