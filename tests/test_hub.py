"""engine/hub.py against the fake hub of tests/fakehub.py: download, resume, retry, verify, offline."""
from __future__ import annotations

import errno
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fakehub import SHARD, FakeHub, fake_model_files, hub_env  # noqa: F401  (hub_env: fixture)
from tritonchat.engine import hub
from tritonchat.engine.errors import DownloadError
from tritonchat.engine.hub import (
    DEFAULT_MODEL,
    TEXT_MODEL_FILES,
    DownloadProcess,
    DownloadProgress,
    RetryPolicy,
    cli_progress_printer,
    is_local_dir,
    local_model_dir,
    model_cache_dir,
    plan_download,
    resolve_model,
)

FAST = RetryPolicy(attempts=3, backoff_s=0.02, stall_s=5.0)
SKIPPED = {".gitattributes", "README.md", "LICENSE", "preprocessor_config.json", "video_preprocessor_config.json",
           "vocab.json", "merges.txt"}  # the slow tokenizer's files: tokenizer.json is there
REPO_DIR = "models--Qwen--Qwen3.5-0.8B"


def text_files(files: dict[str, bytes]) -> dict[str, bytes]:
    return {n: d for n, d in files.items() if n not in SKIPPED}


def assert_snapshot(folder: Path, expected: dict[str, bytes]) -> None:
    on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert on_disk == set(expected)
    for name, data in expected.items():
        assert (folder / name).read_bytes() == data, name


def one_sentence(message: str) -> bool:
    # the sentence may hold paths and file names with dots, but ends once, with a period
    return message.endswith(".") and "\n" not in message and ". " not in message.replace("e.g. ", "")


def wait_for(process: DownloadProcess, condition, timeout: float = 30.0) -> list[DownloadProgress]:
    events: list[DownloadProgress] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events += process.poll()
        if condition(events):
            return events
        time.sleep(0.02)
    raise AssertionError(f"timed out; events so far: {events[-3:]}")


def finished(events: list[DownloadProgress]) -> bool:
    return bool(events) and events[-1].stage in ("done", "error", "cancelled")


# ------------------------------------------------------------------------------------------------
# Where models live


def test_cache_dir_precedence(tmp_path, monkeypatch):
    # #58.5: the Hugging Face hub cache, found exactly as huggingface_hub finds it
    for var in ("HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert model_cache_dir() == tmp_path / "hubcache"
    monkeypatch.delenv("HF_HUB_CACHE")
    assert model_cache_dir() == tmp_path / "hfhome" / "hub"
    monkeypatch.setenv("HF_HOME", "~/somewhere")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_cache_dir() == tmp_path / "home" / "somewhere" / "hub"
    monkeypatch.delenv("HF_HOME")
    assert model_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    code = "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)"
    for env in ({}, {"HF_HOME": str(tmp_path / "hfhome")}, {"HUGGINGFACE_HUB_CACHE": str(tmp_path / "legacy")}):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert Path(theirs.stdout.strip()) == model_cache_dir(), env
        for k in env:
            monkeypatch.delenv(k)


def test_engine_hub_imports_without_qt_platformdirs_or_huggingface_hub():
    code = (
        "import sys\n"
        "for name in ('platformdirs', 'PySide6', 'huggingface_hub', 'filelock'):\n"
        "    sys.modules[name] = None\n"
        "import tritonchat.engine.hub as h\n"
        "print(h.model_cache_dir(), h._search_caches()[-1])\n"
    )
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    home = Path.home() / ".cache"
    assert out.stdout.split() == [str(home / "huggingface" / "hub"), str(home / "tritonchat" / "hub")]


@pytest.mark.parametrize("model, local", [
    ("/abs/path/to/model", True), ("./model", True), ("../model", True), ("~/models/qwen", True),
    ("C:\\models\\qwen", True), ("Qwen/Qwen3.5-0.8B", False), ("some-org/some-model", False),
])
def test_is_local_dir(model, local, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_local_dir(model) is local


def test_is_local_dir_existing_folder_shaped_like_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-org" / "my-model").mkdir(parents=True)
    assert is_local_dir("my-org/my-model")


def test_resolve_model_passes_folders_through(hub_env, tmp_path):
    # the endpoint is a closed port: any network use would fail the call
    assert resolve_model("/no/such/folder") == Path("/no/such/folder")
    assert resolve_model("./rel/model") == Path("./rel/model")
    assert resolve_model("~/m") == Path.home() / "m"
    (tmp_path / "folder").mkdir()
    assert resolve_model(str(tmp_path / "folder"), offline=True) == tmp_path / "folder"


def write_snapshot(cache: Path, folder: str, files: dict[str, bytes], ref: str | None = None) -> Path:
    snapshot = cache / REPO_DIR / "snapshots" / folder
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    if ref:
        (cache / REPO_DIR / "refs").mkdir(parents=True, exist_ok=True)
        (cache / REPO_DIR / "refs" / "main").write_text(ref)
    return snapshot


def test_local_model_dir_needs_every_file_the_loader_needs(hub_env):
    files = text_files(fake_model_files(weights_bytes=64))
    commit = hub.DEFAULT_REVISION
    snapshot = write_snapshot(hub_env.cache, commit, {n: d for n, d in files.items() if n != SHARD}, ref=commit)
    assert local_model_dir() is None  # the index names a shard that is missing
    (snapshot / SHARD).symlink_to("../../blobs/missing")
    assert local_model_dir() is None  # dangling link: a blob that never finished
    (snapshot / SHARD).unlink()
    (snapshot / SHARD).write_bytes(files[SHARD])
    assert local_model_dir() == snapshot
    assert local_model_dir(revision=commit) == snapshot
    assert local_model_dir(revision="b" * 40) is None  # a pinned commit means that commit
    (snapshot / "tokenizer.json").unlink()
    assert not (snapshot / "vocab.json").exists()
    assert local_model_dir() is None  # no tokenizer at all


def test_local_model_dir_finds_manual_copies_and_the_old_tritonchat_cache(hub_env, tmp_path, monkeypatch):
    files = text_files(fake_model_files(weights_bytes=64))
    manual = write_snapshot(hub_env.cache, "manual", files)  # the folder the error message names
    assert local_model_dir() == manual
    assert resolve_model(DEFAULT_MODEL, offline=True) == manual
    # no HF_* variables: the huggingface cache first, then where tritonchat used to download
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setitem(sys.modules, "platformdirs", None)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert local_model_dir() is None
    pinned = hub.DEFAULT_REVISION
    ours_before = write_snapshot(tmp_path / "home" / ".cache" / "tritonchat" / "hub", pinned, files)
    assert local_model_dir() == ours_before
    theirs = write_snapshot(tmp_path / "xdg" / "huggingface" / "hub", pinned, files)
    assert local_model_dir() == theirs
    # another commit of the model is not the pinned one: it is not used
    (tmp_path / "xdg" / "huggingface" / "hub" / REPO_DIR / "snapshots" / pinned).rename(
        tmp_path / "xdg" / "huggingface" / "hub" / REPO_DIR / "snapshots" / ("c" * 40))
    assert local_model_dir() == ours_before


def test_a_default_download_is_found_by_huggingface_hub(hub_env, tmp_path, monkeypatch):
    # #58.5: no cache_dir anywhere: both sides read HF_HOME, and the layout is huggingface_hub's own
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    fake = hub_env.serve(fake_model_files(weights_bytes=1 << 12))
    dest = resolve_model(DEFAULT_MODEL, retry=FAST)
    assert dest == tmp_path / "hfhome" / "hub" / REPO_DIR / "snapshots" / fake.commit
    assert not (dest / "vocab.json").exists() and not (dest / "merges.txt").exists()
    code = ("from huggingface_hub import snapshot_download; "
            f"print(snapshot_download({DEFAULT_MODEL!r}, revision={hub.DEFAULT_REVISION!r}, local_files_only=True))")
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert theirs.returncode == 0, theirs.stderr
    assert Path(theirs.stdout.strip()) == dest


def test_the_revision_is_pinned_in_one_place():
    import inspect
    src = inspect.getsource(hub)
    assert re.fullmatch(r"[0-9a-f]{40}", hub.DEFAULT_REVISION)     # a commit, not a branch
    assert '"main"' not in src and src.count(hub.DEFAULT_REVISION) == 1   # the constant's definition
    for fn in (local_model_dir, plan_download, DownloadProcess.__init__):
        assert inspect.signature(fn).parameters["revision"].default == hub.DEFAULT_REVISION


# ------------------------------------------------------------------------------------------------
# Planning and downloading


def test_plan_lists_the_text_model_files(hub_env):
    files = fake_model_files(weights_bytes=1 << 16)
    fake = hub_env.serve(files)
    plan = plan_download()
    wanted = text_files(files)
    assert {name for name, _, _ in plan.files} == set(wanted)
    for name, size, sha256 in plan.files:
        assert size == len(files[name])
        assert sha256 == (fake.sha256[name] if name in fake.lfs else None)
    assert plan.total_bytes == sum(len(d) for d in wanted.values())
    assert plan.have_bytes == 0
    assert plan.dest == hub_env.cache / REPO_DIR / "snapshots" / fake.commit
    assert plan.files[-1][0] == SHARD  # the long one last
    assert not (hub_env.cache / REPO_DIR / "snapshots").exists()  # planning writes nothing
    # a partial shard left by an earlier run counts as already here
    part = hub_env.cache / REPO_DIR / "blobs" / f"{fake.sha256[SHARD]}.incomplete"
    part.parent.mkdir(parents=True)
    part.write_bytes(files[SHARD][:1000])
    assert plan_download().have_bytes == 1000


def test_plan_takes_the_shards_the_index_names(hub_env):
    shards = ["model-00001-of-00002.safetensors", "odd-name-part2.safetensors"]
    files = fake_model_files(weights_bytes=1 << 12, shards=shards)
    files["model.safetensors"] = b"a consolidated copy the index does not use"
    files["onnx/model.safetensors"] = b"not the text model"
    hub_env.serve(files)
    names = {name for name, _, _ in plan_download().files}
    assert set(shards) <= names
    assert "model.safetensors" not in names and "onnx/model.safetensors" not in names
    assert names == set(text_files(files)) - {"model.safetensors", "onnx/model.safetensors"}


def test_plan_errors_are_one_sentence(hub_env, monkeypatch):
    files = fake_model_files(weights_bytes=64)
    hub_env.serve(files)
    with pytest.raises(DownloadError, match=r"\(the hub has no model by that name\)") as e:
        plan_download("Qwen/Nope")
    assert one_sentence(str(e.value))
    with pytest.raises(DownloadError, match=r"\(the hub has no such revision\)"):
        plan_download(revision="v9")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError, match="HF_HUB_OFFLINE") as e:
        plan_download()
    assert one_sentence(str(e.value))
    index_less = {n: d for n, d in files.items() if not n.endswith(".safetensors") and n != "model.safetensors.index.json"}
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub_env.serve(index_less)
    with pytest.raises(DownloadError, match="no safetensors weights"):
        plan_download()


def test_full_download_progress_and_hub_compatibility(hub_env):
    files = fake_model_files(weights_bytes=4 << 20)
    fake = hub_env.serve(files, throttle_bps=12e6)  # ~0.35 s: several progress events
    events: list[DownloadProgress] = []
    dest = resolve_model(DEFAULT_MODEL, progress=events.append, retry=FAST)
    wanted = text_files(files)
    assert dest == hub_env.cache / REPO_DIR / "snapshots" / fake.commit
    assert_snapshot(dest, wanted)
    total = sum(len(d) for d in wanted.values())
    assert [e.total_bytes for e in events] == [total] * len(events)
    done = [e.done_bytes for e in events]
    assert done == sorted(done) and done[-1] == total
    assert events[-1].stage == "done" and str(dest) in events[-1].message
    assert {e.stage for e in events} <= {"download", "verify", "done"}
    moving = [e for e in events if e.stage == "download" and e.speed_bps > 0]
    assert moving and all(e.eta_s is not None and e.eta_s >= 0 for e in moving)
    assert all(fake.served[n] == 0 for n in SKIPPED)  # preprocessor configs, README, LICENSE untouched
    # One listing, then each file once (the small index twice: planning reads it), nothing else.
    resolve = f"/{DEFAULT_MODEL}/resolve/{fake.commit}/"
    assert fake.requests[0] == ("GET", f"/api/models/{DEFAULT_MODEL}/revision/{hub.DEFAULT_REVISION}?blobs=true", None)
    fetched = sorted(path[len(resolve):] for _, path, _ in fake.requests[1:] if path.startswith(resolve))
    assert fetched == sorted([*wanted, "model.safetensors.index.json"])
    assert len(fake.requests) == 1 + len(fetched) + len(fake.lfs)  # + the CDN GET of each LFS file
    assert not (hub_env.cache / REPO_DIR / "refs").exists()   # a pinned commit needs no branch ref

    # Cached: no network at all the second time, offline or not.
    count = len(fake.requests)
    assert resolve_model(DEFAULT_MODEL) == dest
    assert resolve_model(DEFAULT_MODEL, offline=True) == dest
    assert len(fake.requests) == count

    # huggingface_hub reads the same cache: offline at the pinned commit (as its own pinned
    # download, it keeps no branch ref), and online at main (whose head is that commit here)
    # without fetching a byte again.
    from huggingface_hub import hf_hub_download, snapshot_download

    pinned = hub.DEFAULT_REVISION
    assert Path(snapshot_download(DEFAULT_MODEL, revision=pinned, cache_dir=hub_env.cache, local_files_only=True)) == dest
    assert Path(hf_hub_download(DEFAULT_MODEL, "config.json", revision=pinned, cache_dir=hub_env.cache,
                                local_files_only=True)) == dest / "config.json"
    bodies = len(fake.bodies)
    for name in (SHARD, "tokenizer.json"):
        path = hf_hub_download(DEFAULT_MODEL, name, cache_dir=hub_env.cache, endpoint=fake.endpoint)
        assert Path(path) == dest / name
    assert len(fake.bodies) == bodies


def test_the_token_goes_to_the_hub_but_never_to_the_cdn(hub_env, monkeypatch):
    monkeypatch.delenv("HF_HUB_DISABLE_IMPLICIT_TOKEN")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    fake = hub_env.serve(fake_model_files(weights_bytes=1 << 12))
    resolve_model(DEFAULT_MODEL, retry=FAST)
    seen = {(server, auth) for server, _, auth in fake.authorization}
    assert seen == {("hub", "Bearer hf_secret"), ("cdn", None)}


def test_a_cache_written_by_huggingface_hub_is_used(hub_env):
    files = fake_model_files(weights_bytes=1 << 16)
    fake = hub_env.serve(files)
    from huggingface_hub import snapshot_download

    theirs = snapshot_download(DEFAULT_MODEL, cache_dir=hub_env.cache, endpoint=fake.endpoint,
                               allow_patterns=list(TEXT_MODEL_FILES))
    count = len(fake.requests)
    assert resolve_model(DEFAULT_MODEL) == Path(theirs)
    assert len(fake.requests) == count
    slow = {n: files[n] for n in ("vocab.json", "merges.txt")}  # their pattern list takes these too
    assert_snapshot(Path(theirs), {**text_files(files), **slow})


def test_retry_after_a_dropped_connection_resumes_mid_file(hub_env):
    files = fake_model_files(weights_bytes=1 << 20)
    fake = hub_env.serve(files, drop_once=True)
    events: list[DownloadProgress] = []
    dest = resolve_model(DEFAULT_MODEL, progress=events.append, retry=FAST)
    assert_snapshot(dest, text_files(files))
    half = len(files[SHARD]) // 2
    assert fake.body_ranges(SHARD) == [None, f"bytes={half}-"]
    assert fake.served[SHARD] == len(files[SHARD])  # nothing fetched twice
    retries = [e for e in events if e.stage == "retry"]
    assert len(retries) == 1 and "connection dropped" in retries[0].message and retries[0].file == SHARD


def test_retry_after_a_stall_resumes_mid_file(hub_env):
    files = fake_model_files(weights_bytes=1 << 20)
    fake = hub_env.serve(files, stall_after=300_000)
    events: list[DownloadProgress] = []
    start = time.monotonic()
    dest = resolve_model(DEFAULT_MODEL, progress=events.append, retry=RetryPolicy(attempts=3, backoff_s=0.02, stall_s=1.0))
    assert time.monotonic() - start < 15
    assert_snapshot(dest, text_files(files))
    assert fake.body_ranges(SHARD) == [None, "bytes=300000-"]
    assert any(e.stage == "retry" and "stalled" in e.message for e in events)


def test_retries_back_off_exponentially_then_give_up(hub_env, monkeypatch):
    fake = hub_env.serve(fake_model_files(weights_bytes=1 << 12), fail_first=100)  # the CDN answers 503
    sleeps: list[float] = []
    monkeypatch.setattr(hub.time, "sleep", sleeps.append)
    events: list[DownloadProgress] = []
    policy = RetryPolicy(attempts=5, backoff_s=0.5, max_backoff_s=3.0, stall_s=5.0)
    with pytest.raises(DownloadError, match=r"\(the hub answered HTTP 503\)") as e:
        resolve_model(DEFAULT_MODEL, progress=events.append, retry=policy)
    assert sleeps == [0.5, 1.0, 2.0, 3.0, 3.0]
    retries = [e for e in events if e.stage == "retry"]
    assert events[0].stage == "download" and events[-1].stage == "error" and len(retries) == 5
    assert all(e.file == SHARD for e in retries)
    assert retries[2].message == "The hub answered HTTP 503; retrying in 2.0 s (attempt 4)."
    assert one_sentence(str(e.value))
    assert fake.fail_first == 100 - 6  # the first try and five retries

    # The same policy recovers when the hub comes back before the retries run out.
    fake.fail_first = 3
    assert_snapshot(resolve_model(DEFAULT_MODEL, retry=policy), text_files(fake.files))


def test_no_network_fails_within_seconds(hub_env, monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(hub.time, "sleep", sleeps.append)
    events: list[DownloadProgress] = []
    with pytest.raises(DownloadError) as e:
        resolve_model(DEFAULT_MODEL, progress=events.append)  # the default policy, against a closed port
    assert sum(sleeps) <= 3.0 and len(sleeps) == 2
    assert [e.stage for e in events] == ["retry", "retry", "error"]
    assert events[0].message == "No network; retrying in 1.0 s (attempt 2)."
    cache = hub_env.cache / REPO_DIR / "snapshots" / "manual"
    assert str(e.value) == (f"Could not download {DEFAULT_MODEL} (no network); download it elsewhere and put its "
                            f"files in {cache} or pass --model /path/to/folder.")
    with pytest.raises(DownloadError, match=r"\(no network\); try again later, or download it elsewhere"):
        plan_download(retry=RetryPolicy(backoff_s=0.0))


def test_offline_messages(hub_env, monkeypatch):
    cache = hub_env.cache / REPO_DIR / "snapshots" / "manual"
    with pytest.raises(DownloadError) as e:
        resolve_model(DEFAULT_MODEL, offline=True)
    assert str(e.value) == (f"Could not download {DEFAULT_MODEL} (offline mode is on); download it elsewhere and "
                            f"put its files in {cache} or pass --model /path/to/folder.")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError, match=r"HF_HUB_OFFLINE is set\); download it elsewhere") as e:
        resolve_model(DEFAULT_MODEL)
    assert one_sentence(str(e.value))


@pytest.mark.parametrize("name", [SHARD, "config.json"])  # sha256 of LFS files, git blob id of small ones
def test_a_corrupt_file_is_deleted_and_fetched_again_once(hub_env, name):
    files = fake_model_files(weights_bytes=1 << 18)
    fake = hub_env.serve(files, corrupt_once={name})
    events: list[DownloadProgress] = []
    dest = resolve_model(DEFAULT_MODEL, progress=events.append, retry=FAST)
    assert_snapshot(dest, text_files(files))
    assert fake.body_ranges(name) == [None, None]
    retries = [e for e in events if e.stage == "retry"]
    assert len(retries) == 1 and name in retries[0].message and "downloading it again" in retries[0].message


def test_a_file_corrupt_twice_is_a_clear_error(hub_env):
    files = fake_model_files(weights_bytes=1 << 18)
    fake = hub_env.serve(files, corrupt={SHARD})
    with pytest.raises(DownloadError) as e:
        resolve_model(DEFAULT_MODEL, retry=FAST)
    message = str(e.value)
    assert message.startswith(f"Could not download {DEFAULT_MODEL} ({SHARD} failed its sha256 check twice);")
    assert one_sentence(message)
    assert fake.body_ranges(SHARD) == [None, None]
    blobs = hub_env.cache / REPO_DIR / "blobs"
    assert not any(p.name.startswith(fake.sha256[SHARD]) for p in blobs.iterdir())  # neither blob nor part
    assert not (hub_env.cache / REPO_DIR / "refs" / "main").exists()
    assert local_model_dir() is None


def test_garbage_in_a_partial_file_is_caught_and_replaced(hub_env):
    files = fake_model_files(weights_bytes=1 << 18)
    fake = hub_env.serve(files)
    part = hub_env.cache / REPO_DIR / "blobs" / f"{fake.sha256[SHARD]}.incomplete"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * 5000)  # a broken earlier run: right length so far, wrong bytes
    events: list[DownloadProgress] = []
    dest = resolve_model(DEFAULT_MODEL, progress=events.append, retry=FAST)
    assert_snapshot(dest, text_files(files))
    assert fake.body_ranges(SHARD) == ["bytes=5000-", None]
    assert events[0].done_bytes == 5000  # resumed bytes count from the start
    assert any(e.stage == "retry" and SHARD in e.message for e in events)


def test_a_part_file_longer_than_the_file_is_started_over(hub_env):
    files = fake_model_files(weights_bytes=1 << 16)
    fake = hub_env.serve(files)
    part = hub_env.cache / REPO_DIR / "blobs" / f"{fake.sha256[SHARD]}.incomplete"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"x" * (len(files[SHARD]) + 10))
    events: list[DownloadProgress] = []
    assert_snapshot(resolve_model(DEFAULT_MODEL, progress=events.append, retry=FAST), text_files(files))
    assert fake.body_ranges(SHARD) == [None]
    assert events[-1].done_bytes == events[-1].total_bytes


def test_a_file_longer_than_the_hub_says_is_rejected(hub_env):
    files = fake_model_files(weights_bytes=1 << 16)
    fake = hub_env.serve(files)
    plan = plan_download()
    fake.files[SHARD] = files[SHARD] + b"trailing bytes the listing does not know"
    events: list[DownloadProgress] = []
    with pytest.raises(DownloadError) as e:
        hub.download(plan, progress=events.append, retry=FAST)
    size = len(files[SHARD])
    assert f"({SHARD} came with {size + 40} bytes instead of {size} twice); try again later" in str(e.value)
    assert one_sentence(str(e.value)) and events[-1].stage == "error"
    assert not (plan.dest / SHARD).exists() and local_model_dir() is None


def test_a_server_that_ignores_range_restarts_the_file(hub_env):
    files = fake_model_files(weights_bytes=1 << 18)
    fake = hub_env.serve(files, ignore_range=True)
    part = hub_env.cache / REPO_DIR / "blobs" / f"{fake.sha256[SHARD]}.incomplete"
    part.parent.mkdir(parents=True)
    part.write_bytes(files[SHARD][:7000])
    dest = resolve_model(DEFAULT_MODEL, retry=FAST)
    assert_snapshot(dest, text_files(files))
    assert fake.body_ranges(SHARD) == ["bytes=7000-"]  # answered with 200: written from byte 0, not appended


def test_a_full_disk_is_one_sentence(hub_env, monkeypatch):
    hub_env.serve(fake_model_files(weights_bytes=1 << 12))

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hub, "_fetch_once", no_space)
    with pytest.raises(DownloadError, match=rf"^The disk holding {re.escape(str(hub_env.cache))} has .* free but "
                                            r"the model needs .* more; free some space, or choose another folder "
                                            r"with HF_HUB_CACHE") as e:
        resolve_model(DEFAULT_MODEL, retry=FAST)
    assert one_sentence(str(e.value)) and "No space left" in e.value.details


def test_too_little_free_space_is_said_before_the_download(hub_env, monkeypatch):
    # #61.2: checked with shutil.disk_usage before the first byte; the sentence says how much is needed
    fake = hub_env.serve(fake_model_files(weights_bytes=1 << 16))
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda path: shutil_usage(total=10**9, used=10**9 - 1000, free=1000))
    with pytest.raises(DownloadError, match=r"has 1.0 kB free but the model needs 6\d\.\d kB more") as e:
        resolve_model(DEFAULT_MODEL, retry=FAST)
    assert one_sentence(str(e.value))
    assert fake.served[SHARD] == 0               # the weights were not started


def shutil_usage(**kw):
    import collections
    return collections.namedtuple("usage", "total used free")(**kw)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_is_one_sentence_naming_it(hub_env):
    hub_env.serve(fake_model_files(weights_bytes=1 << 12))
    hub_env.cache.mkdir(parents=True)
    hub_env.cache.chmod(0o500)
    try:
        with pytest.raises(DownloadError) as e:
            resolve_model(DEFAULT_MODEL, retry=FAST)
    finally:
        hub_env.cache.chmod(0o700)
    assert str(e.value).startswith(f"The model cache {hub_env.cache} cannot be written (permission denied); ")
    assert "HF_HUB_CACHE" in str(e.value) and "--model DIR" in str(e.value) and one_sentence(str(e.value))


@pytest.mark.parametrize("code, words", [(errno.EROFS, "read-only file system"), (errno.EACCES, "permission denied")])
def test_an_unwritable_cache_is_one_sentence_in_the_cli_and_the_gui(hub_env, monkeypatch, code, words):
    # #61.2: today "internal error (OSError: [Errno 30] ...)" in the CLI, "unexpected OSError" in the GUI
    hub_env.serve(fake_model_files(weights_bytes=1 << 12))

    def refuse(folder):
        raise OSError(code, os.strerror(code), str(folder))

    monkeypatch.setattr(hub, "_check_writable", refuse)
    with pytest.raises(DownloadError) as e:
        resolve_model(DEFAULT_MODEL, retry=FAST)
    sentence = str(e.value)
    assert sentence == (f"The model cache {hub_env.cache} cannot be written ({words}); choose another folder with "
                        "HF_HUB_CACHE (or HF_HOME), or pass --model DIR with a folder holding the model.")
    events: list[DownloadProgress] = []
    with pytest.raises(DownloadError):
        hub.download(plan_download(retry=FAST), progress=events.append, retry=FAST)
    assert events[-1].stage == "error" and events[-1].message == sentence


# ------------------------------------------------------------------------------------------------
# The child process


def test_download_process_cancel_then_resume_from_the_partial_file(hub_env):
    files = fake_model_files(weights_bytes=4 << 20)
    size = len(files[SHARD])
    fake = hub_env.serve(files, throttle_bps=2e6)  # the shard takes ~2 s: room to kill it mid-file
    first = DownloadProcess(retry=FAST)
    first.start()
    assert first.is_alive()
    events = wait_for(first, lambda ev: any(e.file == SHARD and e.done_bytes > e.total_bytes * 0.3 for e in ev))
    first.cancel()
    assert not first.is_alive()
    events += first.poll()
    assert events[-1].stage == "cancelled"
    assert first.result_dir is None and first.error is None
    assert first.poll() == []

    part = hub_env.cache / REPO_DIR / "blobs" / f"{fake.sha256[SHARD]}.incomplete"
    partial = part.stat().st_size
    assert 0 < partial < size
    assert fake.body_ranges(SHARD) == [None]

    fake.throttle_bps = None
    second = DownloadProcess(retry=FAST)
    second.start()
    events = wait_for(second, finished)
    assert events[-1].stage == "done", events[-1]
    assert second.error is None
    assert second.result_dir == hub_env.cache / REPO_DIR / "snapshots" / fake.commit
    assert_snapshot(second.result_dir, text_files(files))
    assert fake.body_ranges(SHARD) == [None, f"bytes={partial}-"]
    assert fake.bodies[-1][3] == size - partial  # the second run fetched only the rest
    assert events[0].done_bytes >= partial
    done = [e.done_bytes for e in events]
    assert done == sorted(done) and done[-1] == events[-1].total_bytes
    assert not second.is_alive()


def test_download_process_reports_errors(hub_env):
    files = fake_model_files(weights_bytes=2 << 20)
    hub_env.serve(files, throttle_bps=1e6)
    missing = DownloadProcess("Qwen/Nope", retry=FAST)
    missing.start()
    events = wait_for(missing, finished)
    assert events[-1].stage == "error"
    assert missing.error == events[-1].message and "(the hub has no model by that name)" in missing.error
    assert one_sentence(missing.error) and missing.result_dir is None

    killed = DownloadProcess(retry=FAST)  # the child dies without a word (OOM killer, kill -9)
    killed.start()
    wait_for(killed, lambda ev: any(e.done_bytes > 0 for e in ev))
    os.kill(killed._process.pid, signal.SIGKILL)
    events = wait_for(killed, finished)
    assert events[-1].stage == "error" and "stopped unexpectedly" in killed.error
    assert one_sentence(killed.error)


_ORPHAN_SCRIPT = """
import time
from tritonchat.engine.hub import DownloadProcess
if __name__ == "__main__":
    process = DownloadProcess()
    process.start()
    while not any(e.done_bytes > 0 for e in process.poll()):  # the child is mid-download
        time.sleep(0.02)
    print(process._process.pid, flush=True)
    time.sleep(60)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_download_child_exits_when_its_parent_dies(hub_env):
    hub_env.serve(fake_model_files(weights_bytes=2 << 20), throttle_bps=1e5)  # 20 s: it cannot just finish
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return  # reaped
        if state == "Z":
            return  # exited; nobody reaps it in this container
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the download child outlived its parent")


# ------------------------------------------------------------------------------------------------
# Text for people


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_cli_progress_printer_draws_one_line_on_a_terminal():
    out = _Terminal()
    show = cli_progress_printer(out)
    total = 1_746_942_600
    show(DownloadProgress("download", 0, total, 0.0, None, "", "Downloading 9 files (1.75 GB) to /x."))
    time.sleep(0.11)
    show(DownloadProgress("download", total // 2, total, 12.5e6, 70.0, SHARD))
    show(DownloadProgress("download", total // 2 + 1, total, 12.5e6, 70.0, SHARD))  # within 0.1 s: skipped
    show(DownloadProgress("retry", total // 2, total, 0.0, None, SHARD, "The connection stalled; retrying in 1.0 s (attempt 2)."))
    show(DownloadProgress("verify", total, total, 0.0, None, SHARD, "Checking it."))
    show(DownloadProgress("done", total, total, 0.0, None, "", "Downloaded it."))
    lines = out.getvalue().split("\n")
    assert lines[0] == "Downloading 9 files (1.75 GB) to /x."
    bar = lines[1].split("\r")
    assert bar[0] == "" and "  0.0%" in bar[1] and "ETA --:--" in bar[1]
    assert len(bar) == 3 and "50.0%" in bar[2] and "[############............]" in bar[2]
    assert "873.5 MB / 1.75 GB" in bar[2] and "12.5 MB/s" in bar[2] and "ETA 1:10" in bar[2]
    assert len(bar[2]) >= len(bar[1])  # each redraw covers the previous one
    assert lines[2] == "The connection stalled; retrying in 1.0 s (attempt 2)."
    assert "100.0%" in lines[3] and "Checking" not in out.getvalue()
    assert lines[4:] == ["Downloaded it.", ""]


def test_cli_progress_printer_writes_plain_lines_to_a_log():
    out = io.StringIO()
    show = cli_progress_printer(out)
    show(DownloadProgress("download", 0, 100, 0.0, None))
    show(DownloadProgress("download", 50, 100, 10.0, 5.0))  # within 5 s: skipped in a log
    show(DownloadProgress("cancelled", 50, 100, message="Download cancelled."))
    show(DownloadProgress("error", 50, 100, message="Could not download X (no network)."))  # the caller prints it
    assert out.getvalue().splitlines() == [
        "Downloading   0.0% [........................] 0 B / 100 B  -- B/s  ETA --:--",
        "Download cancelled.",
    ]


def test_formatting():
    assert hub.format_size(1_746_942_600) == "1.75 GB"
    assert hub.format_size(20_500_000) == "20.5 MB"
    assert hub.format_size(7_800) == "7.8 kB"
    assert hub.format_size(999) == "999 B"
    assert hub.format_eta(None) == "--:--"
    assert hub.format_eta(80) == "1:20"
    assert hub.format_eta(3_700) == "1:01:40"
    assert RetryPolicy(backoff_s=1.0, max_backoff_s=10.0).delay(1) == 1.0
    assert [RetryPolicy(backoff_s=1.0, max_backoff_s=10.0).delay(k) for k in (2, 3, 4, 5)] == [2.0, 4.0, 8.0, 10.0]


def test_fake_hub_speaks_enough_hub_for_huggingface_hub(tmp_path):
    # The fake is only worth its tests if the real client agrees with it.
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

    files = fake_model_files(weights_bytes=1 << 16)
    with FakeHub(files) as fake:
        api = HfApi(endpoint=fake.endpoint, token=False)
        info = api.model_info(fake.repo_id, files_metadata=True)
        assert info.sha == fake.commit
        by_name = {s.rfilename: s for s in info.siblings}
        assert by_name[SHARD].lfs.sha256 == fake.sha256[SHARD] and by_name[SHARD].size == len(files[SHARD])
        assert by_name["config.json"].lfs is None and by_name["config.json"].blob_id == fake.oid["config.json"]
        path = hf_hub_download(fake.repo_id, SHARD, cache_dir=tmp_path, endpoint=fake.endpoint, token=False)
        assert Path(path).read_bytes() == files[SHARD]
        assert Path(path).resolve().name == fake.sha256[SHARD]  # blob named by X-Linked-Etag
        path = hf_hub_download(fake.repo_id, "config.json", cache_dir=tmp_path, endpoint=fake.endpoint, token=False)
        assert Path(path).resolve().name == fake.oid["config.json"]
        with pytest.raises(RepositoryNotFoundError):
            api.model_info("Qwen/Nope")
        with pytest.raises(EntryNotFoundError):
            hf_hub_download(fake.repo_id, "nope.json", cache_dir=tmp_path, endpoint=fake.endpoint, token=False)
        index = json.loads(files["model.safetensors.index.json"])
        assert set(index["weight_map"].values()) == {SHARD}


# ------------------------------------------------------------------------------------------------
# Verification records and repair (#61.1)


def _flip(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_each_file_is_recorded_once_verified(hub_env):
    files = fake_model_files(weights_bytes=1 << 16)
    fake = hub_env.serve(files)
    dest = resolve_model(DEFAULT_MODEL, retry=FAST)
    stamp = json.loads((hub_env.cache / REPO_DIR / ".tritonchat" / f"verified-{fake.commit}.json").read_text())
    assert set(stamp["files"]) == set(text_files(files))
    for name, entry in stamp["files"].items():
        assert entry["size"] == len(files[name]) and entry["sha256"] == fake.sha256[name]
        assert entry["mtime_ns"] == (dest / name).stat().st_mtime_ns and entry["verified_at"].endswith("Z")
    assert all(c.status == "ok" for c in hub.check_snapshot(dest, full=True))
    from huggingface_hub import scan_cache_dir
    assert scan_cache_dir(hub_env.cache).repos  # the record does not upset huggingface_hub's cache scan


@pytest.mark.parametrize("name, damage", [(SHARD, "flip"), (SHARD, "truncate"), ("tokenizer.json", "flip")])
def test_a_damaged_file_is_caught_and_download_again_replaces_it(hub_env, name, damage):
    files = fake_model_files(weights_bytes=1 << 16)
    fake = hub_env.serve(files)
    dest = resolve_model(DEFAULT_MODEL, retry=FAST)
    blob = (dest / name).resolve()
    if damage == "flip":
        _flip(blob)                   # same size: today skipped as "already downloaded"
    else:
        blob.write_bytes(files[name][:-10])
    assert [c.name for c in hub.damaged_files(dest)] == [name]
    assert local_model_dir() is None             # not offered to the loader as a good copy
    with pytest.raises(DownloadError, match=rf"^{re.escape(name)} in .* is damaged .*; go online to download it again") as e:
        resolve_model(DEFAULT_MODEL, offline=True)
    assert one_sentence(str(e.value))
    served = fake.served[name]
    events: list[DownloadProgress] = []
    assert resolve_model(DEFAULT_MODEL, retry=FAST, progress=events.append) == dest
    assert (dest / name).read_bytes() == files[name]
    assert fake.served[name] == 2 * served       # fetched again, whole
    assert any("damaged" in e.message for e in events if e.stage == "retry")
    assert events[-1].stage == "done"
    assert not hub.damaged_files(dest)


def test_a_blob_another_tool_wrote_is_hashed_once_before_it_is_trusted(hub_env):
    files = fake_model_files(weights_bytes=1 << 16)
    fake = hub_env.serve(files)
    from huggingface_hub import snapshot_download
    theirs = Path(snapshot_download(DEFAULT_MODEL, cache_dir=hub_env.cache, endpoint=fake.endpoint,
                                    allow_patterns=list(TEXT_MODEL_FILES)))
    _flip((theirs / SHARD).resolve())
    checks = {c.name: c for c in hub.check_snapshot(theirs, full=True)}   # hub blob names are hashes
    assert checks[SHARD].status == "damaged" and checks["config.json"].status == "ok"
    plan = plan_download(retry=FAST)
    hub.download(plan, retry=FAST)
    assert (theirs / SHARD).read_bytes() == files[SHARD]


def test_the_quick_check_trusts_the_record_and_the_full_check_hashes(hub_env):
    files = fake_model_files(weights_bytes=1 << 16)
    hub_env.serve(files)
    dest = resolve_model(DEFAULT_MODEL, retry=FAST)
    blob = (dest / SHARD).resolve()
    st = blob.stat()
    _flip(blob)
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))     # damage that keeps size and mtime
    assert not hub.damaged_files(dest)
    assert [c.name for c in hub.check_snapshot(dest, full=True) if c.status == "damaged"] == [SHARD]
    os.utime(blob, None)                                     # a touched but intact file: hashed, then recorded again
    blob.write_bytes(files[SHARD])
    assert not hub.damaged_files(dest)
    stamp = json.loads(next((hub_env.cache / REPO_DIR / ".tritonchat").glob("verified-*.json")).read_text())
    assert stamp["files"][SHARD]["mtime_ns"] == blob.stat().st_mtime_ns
