"""A local stand-in for huggingface.co: enough of the hub for huggingface_hub and engine/hub.py.

One model repository served from memory on 127.0.0.1 (ThreadingHTTPServer, HTTP/1.1):

    GET  /api/models/<repo>[/revision/<rev>][?blobs=true]   model info: sha, siblings (+size, blobId, lfs)
    GET  /api/models/<repo>/tree/<rev>                       the file tree (what snapshot_download lists)
    HEAD/GET /<repo>/resolve/<rev>/<file>    small files: 200, ETag = git blob id, X-Repo-Commit
                                             LFS files: 302 to the CDN, X-Linked-Etag = sha256, X-Linked-Size
    HEAD/GET <cdn>/cdn/<sha256>              LFS bytes, Range answered with 206 / 416

The CDN is a second server on another port, so clients treat it as another host (as they treat the
real hub's signed CDN URLs: followed, but without the token). Errors carry the hub's X-Error-Code
(RepoNotFound, RevisionNotFound, EntryNotFound) so huggingface_hub maps them to its exceptions.

Faults, to test a downloader (all on LFS file bodies, the ones big enough to stall in real life):
    throttle_bps   bytes per second per response; an attribute, so a test can lift it between runs
    stall_after    once: the first LFS body stops after this many bytes and hangs until the client gives up
    drop_once      once: the first LFS body is cut (connection closed) half way
    corrupt        these files are always served with one byte flipped
    corrupt_once   these files are served with one byte flipped the first time only
    ignore_range   answer Range requests with the whole file (200), as some proxies do
    fail_first     the next N GETs of LFS bytes answer 503, as an overloaded CDN does

`requests` logs every request as (method, path, Range header), `authorization` the Authorization
header each server saw as (server "hub" | "cdn", path, header or None); `bodies` logs every body served as
[file, Range header, status, bytes sent so far]; `served[file]` sums the bytes sent per file.

Other tests reuse this module: `from tests.fakehub import FakeHub, fake_model_files, hub_env`
(importing the fixture `hub_env` into a test module registers it there).
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterable, Optional

import pytest

from tritonchat.engine.hub import DEFAULT_REVISION

DEFAULT_REPO = "Qwen/Qwen3.5-0.8B"
SHARD = "model.safetensors-00001-of-00001.safetensors"  # the official (odd) shard name
_CHUNK = 16 * 1024


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    sha = hashlib.sha256(data).hexdigest()
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()


def fake_model_files(weights_bytes: int = 4 << 20, *, seed: int = 0, shards: Optional[list[str]] = None,
                     extras: bool = True) -> dict[str, bytes]:
    """A Qwen3.5-shaped repository: the text model's files, random "weights", and files to skip."""
    rng = random.Random(seed)
    shards = shards or [SHARD]
    per_shard = weights_bytes // len(shards)
    files: dict[str, bytes] = {
        "config.json": json.dumps({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                                   "text_config": {"hidden_size": 1024, "num_hidden_layers": 24}}).encode(),
        "generation_config.json": json.dumps({"temperature": 1.0, "top_k": 20, "top_p": 0.95}).encode(),
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}).encode() * 40,
        "tokenizer_config.json": json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}).encode(),
        "chat_template.jinja": b"{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
        "vocab.json": json.dumps({"a": 0, "b": 1}).encode(),
        "merges.txt": b"#version: 0.2\na b\n",
        "model.safetensors.index.json": json.dumps({
            "metadata": {"total_size": per_shard * len(shards)},
            "weight_map": {f"model.language_model.layers.{i}.mlp.up_proj.weight": shards[i % len(shards)]
                           for i in range(max(4, len(shards)))},
        }).encode(),
    }
    for shard in shards:
        files[shard] = rng.randbytes(per_shard)
    if extras:  # what a text-only downloader must leave alone
        files.update({
            ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
            "README.md": b"# Qwen3.5-0.8B\n",
            "LICENSE": b"Apache License 2.0\n",
            "preprocessor_config.json": b"{}",
            "video_preprocessor_config.json": b"{}",
        })
    return files


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stalled handler must not hold up the test's exit

    def handle_error(self, request, client_address):  # a client hanging up is business as usual here
        pass


class FakeHub:
    def __init__(self, files: dict[str, bytes], repo_id: str = DEFAULT_REPO, *, stall_after: Optional[int] = None,
                 drop_once: bool = False, corrupt: Iterable[str] = (), corrupt_once: Iterable[str] = (),
                 throttle_bps: Optional[float] = None, ignore_range: bool = False, fail_first: int = 0,
                 lfs: Optional[Iterable[str]] = None, stall_s: float = 60.0, commit: Optional[str] = None):
        self.files = dict(files)
        self.repo_id = repo_id
        self.stall_after = stall_after
        self.drop_once = drop_once
        self.corrupt = set(corrupt)
        self.corrupt_once = set(corrupt_once)
        self.throttle_bps = throttle_bps
        self.ignore_range = ignore_range
        self.fail_first = fail_first
        self.stall_s = stall_s
        self.lfs = set(lfs) if lfs is not None else {n for n in self.files if n.endswith(".safetensors")}
        self.oid = {n: git_blob_id(d) for n, d in self.files.items()}
        self.sha256 = {n: hashlib.sha256(d).hexdigest() for n, d in self.files.items()}
        # the repo's head commit: by default the one the engine pins, so a download of the pinned
        # revision finds it (the head of main is that commit)
        self.commit = commit or DEFAULT_REVISION
        self.requests: list[tuple[str, str, Optional[str]]] = []
        self.authorization: list[tuple[str, str, Optional[str]]] = []
        self.bodies: list[list] = []  # [file, Range header, status, bytes sent so far]
        self.served: dict[str, int] = {n: 0 for n in self.files}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._stalled = self._dropped = False
        self._corrupted_once: set[str] = set()
        self._servers: list[_Server] = []

    # --- lifecycle

    def __enter__(self) -> "FakeHub":
        for role in ("hub", "cdn"):
            server = _Server(("127.0.0.1", 0), self._handler(role))
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
            self._servers.append(server)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closing.set()  # wakes stalled handlers
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn_endpoint(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    # --- what tests look at

    def body_ranges(self, name: str) -> list[Optional[str]]:
        """The Range header of every request that served (part of) name's bytes."""
        with self._lock:
            return [rng for file, rng, _, _ in self.bodies if file == name]

    def sibling(self, name: str, blobs: bool) -> dict:
        entry: dict = {"rfilename": name}
        if blobs:
            entry.update(size=len(self.files[name]), blobId=self.oid[name])
            if name in self.lfs:
                pointer = lfs_pointer(self.files[name])
                entry["blobId"] = git_blob_id(pointer)
                entry["lfs"] = {"sha256": self.sha256[name], "size": len(self.files[name]), "pointerSize": len(pointer)}
        return entry

    def tree_entry(self, name: str) -> dict:
        entry = {"type": "file", "oid": self.oid[name], "size": len(self.files[name]), "path": name}
        if name in self.lfs:
            pointer = lfs_pointer(self.files[name])
            entry["oid"] = git_blob_id(pointer)
            entry["lfs"] = {"oid": self.sha256[name], "size": len(self.files[name]), "pointerSize": len(pointer)}
        return entry

    def content(self, name: str, method: str) -> bytes:
        data = self.files[name]
        flip = name in self.corrupt
        if name in self.corrupt_once and method == "GET":
            with self._lock:
                flip = flip or name not in self._corrupted_once
                self._corrupted_once.add(name)
        if flip and data:
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
        return data

    # --- HTTP

    def _handler(self, role: str):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._route("GET")

            def do_HEAD(self) -> None:
                self._route("HEAD")

            def _route(self, method: str) -> None:
                with hub._lock:
                    hub.requests.append((method, self.path, self.headers.get("Range")))
                    hub.authorization.append((role, self.path, self.headers.get("Authorization")))
                raw_path, _, query = self.path.partition("?")
                params = urllib.parse.parse_qs(query)
                if method == "GET" and role == "cdn":
                    with hub._lock:
                        overloaded, hub.fail_first = hub.fail_first > 0, max(0, hub.fail_first - 1)
                    if overloaded:
                        return self._error(503, None, "Service unavailable")
                if role == "cdn":
                    match = re.fullmatch(r"/cdn/([0-9a-f]{64})", raw_path)
                    names = [n for n in hub.lfs if match and hub.sha256[n] == match.group(1)]
                    if not names:
                        return self._error(404, "EntryNotFound", "No such object")
                    return self._body(method, names[0], {"ETag": f'"{hub.sha256[names[0]]}"'})
                if raw_path.startswith("/api/models/"):
                    return self._api(method, raw_path[len("/api/models/"):], params)
                match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", raw_path)
                if match:
                    repo, rev, name = (urllib.parse.unquote(g) for g in match.groups())
                    return self._resolve(method, repo, rev, name)
                self._error(404, None, "Not found")

            def _check(self, repo: str, rev: str) -> bool:
                if repo != hub.repo_id:  # the real hub answers 401 to anonymous users for unknown repos
                    self._error(401, "RepoNotFound", "Repository not found")
                    return False
                if rev not in ("main", hub.commit):
                    self._error(404, "RevisionNotFound", "Invalid rev id")
                    return False
                return True

            def _api(self, method: str, rest: str, params: dict) -> None:
                tree = re.fullmatch(r"([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", rest)
                revision = re.fullmatch(r"([^/]+/[^/]+)/revision/([^/]+)", rest)
                plain = re.fullmatch(r"([^/]+/[^/]+)", rest)
                if tree:
                    repo, rev = (urllib.parse.unquote(g) for g in tree.groups()[:2])
                    if self._check(repo, rev):
                        self._json(method, [hub.tree_entry(n) for n in sorted(hub.files)])
                elif revision or plain:
                    repo = urllib.parse.unquote((revision or plain).group(1))
                    rev = urllib.parse.unquote(revision.group(2)) if revision else "main"
                    if self._check(repo, rev):
                        blobs = params.get("blobs", ["false"])[0].lower() == "true"
                        self._json(method, {
                            "_id": hub.commit[:24], "id": hub.repo_id, "modelId": hub.repo_id,
                            "author": hub.repo_id.split("/")[0], "sha": hub.commit, "private": False,
                            "gated": False, "disabled": False, "lastModified": "2026-01-01T00:00:00.000Z",
                            "tags": ["safetensors"], "library_name": "transformers",
                            "siblings": [hub.sibling(n, blobs) for n in sorted(hub.files)],
                        })
                else:
                    self._error(404, None, "Not found")

            def _resolve(self, method: str, repo: str, rev: str, name: str) -> None:
                if not self._check(repo, rev):
                    return
                commit = {"X-Repo-Commit": hub.commit}
                if name not in hub.files:
                    return self._error(404, "EntryNotFound", "Entry not found", commit)
                if name in hub.lfs:
                    pointer = lfs_pointer(hub.files[name])
                    self.send_response(302)
                    for key, value in {**commit, "Location": f"{hub.cdn_endpoint}/cdn/{hub.sha256[name]}",
                                       "ETag": f'"{git_blob_id(pointer)}"', "X-Linked-Etag": f'"{hub.sha256[name]}"',
                                       "X-Linked-Size": str(len(hub.files[name])), "Content-Length": "0"}.items():
                        self.send_header(key, value)
                    self.end_headers()
                    return
                self._body(method, name, {**commit, "ETag": f'"{hub.oid[name]}"'})

            def _body(self, method: str, name: str, headers: dict) -> None:
                data = hub.content(name, method)
                total, start, end, status = len(data), 0, len(data) - 1, 200
                requested = self.headers.get("Range")
                match = re.fullmatch(r"bytes=(\d+)-(\d*)", (requested or "").strip())
                if match and not hub.ignore_range:
                    start = int(match.group(1))
                    end = min(int(match.group(2)), total - 1) if match.group(2) else total - 1
                    if start >= total:
                        return self._error(416, None, "Range not satisfiable", {"Content-Range": f"bytes */{total}"})
                    status = 206
                body = data[start:end + 1]
                self.send_response(status)
                headers = {**headers, "Content-Length": str(len(body)), "Accept-Ranges": "bytes",
                           "Content-Type": "application/octet-stream"}
                if status == 206:
                    headers["Content-Range"] = f"bytes {start}-{end}/{total}"
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                if method == "GET":
                    self._stream(name, body, requested, status)

            def _stream(self, name: str, body: bytes, requested: Optional[str], status: int) -> None:
                fault, limit = None, len(body)
                with hub._lock:
                    if name in hub.lfs and hub.stall_after is not None and not hub._stalled and len(body) > hub.stall_after:
                        fault, limit, hub._stalled = "stall", hub.stall_after, True
                    elif name in hub.lfs and hub.drop_once and not hub._dropped and len(body) > 1:
                        fault, limit, hub._dropped = "drop", len(body) // 2, True
                record = [name, requested, status, 0]  # logged now: in request order, even while stalled
                with hub._lock:
                    hub.bodies.append(record)
                sent, t0 = 0, time.monotonic()
                try:
                    while sent < limit:
                        n = min(_CHUNK, limit - sent)
                        self.wfile.write(body[sent:sent + n])
                        sent += n
                        with hub._lock:
                            hub.served[name] += n
                            record[3] = sent
                        rate = hub.throttle_bps
                        if rate:
                            delay = t0 + sent / rate - time.monotonic()
                            if delay > 0 and hub._closing.wait(delay):
                                break
                    if fault == "stall":
                        hub._closing.wait(hub.stall_s)  # send nothing more until the client gives up
                except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
                    pass
                if fault or sent < len(body):
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

            def _json(self, method: str, payload) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if method == "GET":
                    self.wfile.write(data)

            def _error(self, status: int, code: Optional[str], message: str, headers: Optional[dict] = None) -> None:
                data = json.dumps({"error": message}).encode()
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(data)

        return Handler


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens (connection refused = no network)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@dataclass
class HubEnv:
    """The environment of one test: an empty hub cache, HF_ENDPOINT pointing at a fake (or nowhere)."""

    cache: Path
    monkeypatch: pytest.MonkeyPatch
    hubs: list[FakeHub] = field(default_factory=list)

    def serve(self, files: dict[str, bytes], repo_id: str = DEFAULT_REPO, **faults) -> FakeHub:
        hub = FakeHub(files, repo_id, **faults).__enter__()
        self.hubs.append(hub)
        self.monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        return hub

    def close(self) -> None:
        for hub in self.hubs:
            hub.close()


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """HF_HUB_CACHE in tmp_path and HF_ENDPOINT at a closed port until env.serve(files) starts a FakeHub."""
    cache = tmp_path / "hub-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for var in ("HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())  # nothing in a test may reach the real hub
    env = HubEnv(cache, monkeypatch)
    yield env
    env.close()
