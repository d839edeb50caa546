"""ChatStore: CRUD, search, real deletion, migrations, export, persistence and crash safety."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tritonchat.app.stats_text import stats_line
from tritonchat.app.store import EXPORT_FORMAT, SCHEMA_VERSION, ChatStore, ChatStoreError

STATS = {"ttft_ms": 41.7, "prefill_tok_s": 5120.0, "decode_tok_s": 211.25, "new_tokens": 37,
         "stop_reason": "eos", "engine": {"backend": "triton", "split_k": True, "graph": False}}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "sub" / "chats.sqlite3"


@pytest.fixture
def store(db_path: Path):
    s = ChatStore(db_path)
    yield s
    s.close()


def file_bytes(path: Path) -> bytes:
    """The database and its -wal/-shm side files, as they are on disk right now."""
    return b"".join(p.read_bytes() for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm"))
                    if p.exists())


def test_pragmas_and_file_mode(store: ChatStore, db_path: Path):
    db = store._db
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert db.execute("PRAGMA secure_delete").fetchone()[0] == 1
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert stat.S_IMODE(db_path.stat().st_mode) == 0o600


def test_create_rename_get_and_order(store: ChatStore):
    a = store.create_conversation()
    b = store.create_conversation("  Second\n chat  ")
    assert store.get_conversation(a).title == "New chat"
    assert store.get_conversation(b).title == "Second chat"     # one line, trimmed
    assert [c.id for c in store.list_conversations()] == [b, a]
    # A new message in the older chat moves it to the top.
    time.sleep(0.01)
    store.add_message(a, "user", "hello")
    convs = store.list_conversations()
    assert [c.id for c in convs] == [a, b]
    assert convs[0].updated_at > convs[0].created_at
    store.rename_conversation(a, "Renamed")
    assert store.get_conversation(a).title == "Renamed"
    store.rename_conversation(a, "   ")
    assert store.get_conversation(a).title == "New chat"
    with pytest.raises(KeyError):
        store.rename_conversation(9999, "x")
    with pytest.raises(KeyError):
        store.get_conversation(9999)


def test_search_titles_and_message_text(store: ChatStore):
    recipes = store.create_conversation("Pasta recipes")
    physics = store.create_conversation("Physics homework")
    german = store.create_conversation("Deutsch")
    store.add_message(physics, "user", "Explain the Carbonara of quantum fields")
    store.add_message(german, "assistant", "Die Straße ist lang.", thinking="secret plan")
    ids = lambda q: {c.id for c in store.list_conversations(q)}   # noqa: E731
    assert ids("pasta") == {recipes}                     # title, case-insensitive
    assert ids("CARBONARA") == {physics}                 # message text
    assert ids("strasse") == {german}                    # Unicode case folding (ß -> ss)
    assert ids("100%") == set()                          # LIKE wildcards are not special
    assert ids("_") == set()
    assert ids("secret") == set()                        # thinking is not the message text
    assert ids("   ") == {recipes, physics, german}      # blank search = everything
    assert ids("zzz-no-such-text") == set()


def test_messages_roundtrip_update_and_errors(store: ChatStore):
    c = store.create_conversation()
    u = store.add_message(c, "user", "What is 2+2?")
    a = store.add_message(c, "assistant")
    store.update_message(a, thinking="2+2 is")
    store.update_message(a, content="4", stats=STATS)
    store.update_message(a)                              # nothing to change, still checked
    msgs = store.messages(c)
    assert [(m.id, m.role, m.content, m.thinking) for m in msgs] == [
        (u, "user", "What is 2+2?", ""), (a, "assistant", "4", "2+2 is")]
    assert msgs[0].stats is None and msgs[1].stats == STATS
    assert msgs[1].conv_id == c and msgs[1].created_at >= msgs[0].created_at
    with pytest.raises(KeyError):
        store.update_message(12345, content="x")
    with pytest.raises(KeyError):
        store.update_message(12345)
    with pytest.raises(ValueError):
        store.add_message(c, "robot", "beep")
    with pytest.raises(KeyError):
        store.add_message(777, "user", "orphan")
    assert store._db.execute("SELECT count(*) FROM messages").fetchone()[0] == 2
    with pytest.raises(TypeError):
        store.add_message(c, "assistant", "x", stats=["not", "a", "dict"])


def test_delete_message_and_delete_from(store: ChatStore):
    c = store.create_conversation()
    other = store.create_conversation()
    ids = [store.add_message(c, r, f"turn {i}") for i, r in
           enumerate(["user", "assistant", "user", "assistant", "user"])]
    keep = store.add_message(other, "user", "other chat")
    store.delete_message(ids[1])
    assert [m.id for m in store.messages(c)] == [ids[0], ids[2], ids[3], ids[4]]
    store.delete_messages_from(c, ids[3])
    assert [m.content for m in store.messages(c)] == ["turn 0", "turn 2"]
    # The same id in another conversation is untouched, even when it is larger.
    store.delete_messages_from(c, ids[0])
    assert store.messages(c) == []
    assert [m.id for m in store.messages(other)] == [keep]
    # New messages never reuse deleted ids (they order the turns).
    assert store.add_message(c, "user", "again") > keep


@pytest.mark.parametrize("marker_len", [40, 20_000])   # in-page cell and overflow pages
def test_delete_really_removes_text_from_the_files(db_path: Path, marker_len: int):
    store = ChatStore(db_path)
    marker = ("TOPSECRET-" * (marker_len // 10 + 1))[:marker_len]
    kept_marker = "KEEPME-visible-text"
    doomed = store.create_conversation("doomed title QXZ")
    store.add_message(doomed, "user", marker, thinking="thinking " + marker)
    store.add_message(doomed, "assistant", "reply " + marker, stats=STATS)
    kept = store.create_conversation("kept")
    store.add_message(kept, "user", kept_marker)
    for _ in range(20):                                   # streaming-style updates, each a commit
        store.update_message(store.messages(doomed)[-1].id, content="reply " + marker)
    # Control: before deletion the text is in the files (so the check below can fail).
    assert marker[:40].encode() in file_bytes(db_path)
    assert b"doomed title QXZ" in file_bytes(db_path)

    store.delete_conversation(doomed)
    assert store.messages(doomed) == []
    with pytest.raises(KeyError):
        store.get_conversation(doomed)
    data = file_bytes(db_path)
    assert b"TOPSECRET" not in data
    assert b"doomed title QXZ" not in data
    assert kept_marker.encode() in data                   # the other chat survives
    wal = Path(f"{db_path}-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    # And it stays gone after close and reopen.
    store.close()
    assert b"TOPSECRET" not in file_bytes(db_path)
    with ChatStore(db_path) as again:
        assert [c.title for c in again.list_conversations()] == ["kept"]


def test_delete_messages_from_removes_text_from_the_files(store: ChatStore, db_path: Path):
    c = store.create_conversation()
    store.add_message(c, "user", "first question")
    m = store.add_message(c, "assistant", "REGENERATED-AWAY " * 50)
    assert b"REGENERATED-AWAY" in file_bytes(db_path)
    store.delete_messages_from(c, m)
    assert b"REGENERATED-AWAY" not in file_bytes(db_path)
    assert b"first question" in file_bytes(db_path)


def test_reopen_persists_everything(db_path: Path):
    with ChatStore(db_path) as s:
        c = s.create_conversation("Persisted")
        s.add_message(c, "user", "q")
        a = s.add_message(c, "assistant", "a", thinking="t", stats=STATS)
        before = (s.list_conversations(), s.messages(c))
    with ChatStore(db_path) as s:
        assert (s.list_conversations(), s.messages(c)) == before
        assert s.messages(c)[1].id == a


def test_unclosed_store_keeps_every_commit(db_path: Path):
    writer = ChatStore(db_path)               # never closed, as after a crash
    c = writer.create_conversation()
    m = writer.add_message(c, "assistant")
    for i in range(1, 30):
        writer.update_message(m, content="word " * i)
    reader = ChatStore(db_path)
    assert reader.messages(c)[0].content == "word " * 29
    reader.close()


CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tritonchat.app.store import ChatStore
    store = ChatStore(Path(sys.argv[1]))
    conv = store.create_conversation("streaming")
    msg = store.add_message(conv, "assistant")
    print(conv, msg, flush=True)
    i = 0
    while True:
        i += 1
        store.update_message(msg, content="tok " * i, thinking=str(i))
        print(i, flush=True)
""")


def test_kill_mid_stream_loses_at_most_the_update_in_flight(db_path: Path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(db_path)],
                             stdout=subprocess.PIPE, text=True)
    try:
        conv, msg = map(int, child.stdout.readline().split())
        while int(child.stdout.readline()) < 40:
            pass
        os.kill(child.pid, signal.SIGKILL)
        rest = child.stdout.read().split()
    finally:
        child.kill()
        child.wait()
    last_reported = int(rest[-1]) if rest else 40
    with ChatStore(db_path) as store:
        (m,) = store.messages(conv)
        assert m.id == msg
        n = int(m.thinking)
        # Every reported commit is there; at most the one committed but not yet reported is extra.
        assert last_reported <= n <= last_reported + 1
        assert m.content == "tok " * n


V1_SCHEMA = """
CREATE TABLE conversations (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    title      TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE messages (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    conv_id    INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role       TEXT NOT NULL,
    content    TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL
);
INSERT INTO conversations VALUES (1, 'Old chat', 1000.0, 2000.0);
INSERT INTO conversations VALUES (2, 'Older chat', 500.0, 600.0);
INSERT INTO messages VALUES (1, 1, 'user', 'hi from v1', 1500.0);
INSERT INTO messages VALUES (2, 1, 'assistant', 'hello back', 2000.0);
PRAGMA user_version = 1;
"""


def schema_of(path: Path) -> list[tuple]:
    db = sqlite3.connect(path)
    try:
        rows = db.execute("SELECT type, name, sql FROM sqlite_master "
                          "WHERE name NOT LIKE 'sqlite_%' ORDER BY name").fetchall()
        return [(kind, name, " ".join(sql.split())) for kind, name, sql in rows]
    finally:
        db.close()


def test_migration_from_v1(tmp_path: Path):
    old = tmp_path / "v1.sqlite3"
    db = sqlite3.connect(old)
    db.executescript(V1_SCHEMA)
    db.close()
    with ChatStore(old) as s:
        assert s._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert [c.title for c in s.list_conversations()] == ["Old chat", "Older chat"]
        msgs = s.messages(1)
        assert [(m.role, m.content, m.thinking, m.stats) for m in msgs] == [
            ("user", "hi from v1", "", None), ("assistant", "hello back", "", None)]
        s.update_message(msgs[1].id, thinking="now with thoughts", stats=STATS)
        assert s.messages(1)[1].stats == STATS
        assert s.add_message(2, "user", "new") == 3
    # An upgraded database has exactly the schema of a new one.
    fresh = tmp_path / "fresh.sqlite3"
    ChatStore(fresh).close()
    assert schema_of(old) == schema_of(fresh)


def test_migration_from_v2_builds_the_tree_and_finds_cut_off_answers(tmp_path: Path):
    """v3: each turn's parent is the one before it; an answer v2 never finished (no stats)
    is marked streaming, and recover_interrupted() marks it interrupted or drops it if empty."""
    from tritonchat.app.store import MIGRATIONS

    old = tmp_path / "v2.sqlite3"
    db = sqlite3.connect(old)
    for step in MIGRATIONS[:2]:
        step(db)
    db.execute("PRAGMA user_version = 2")
    db.execute("INSERT INTO conversations VALUES (1, 'c', 0, 0)")
    for i, (role, content, stats) in enumerate([("user", "q1", None), ("assistant", "a1", "{}"),
                                                ("user", "q2", None), ("assistant", "cut", None),
                                                ]):
        db.execute("INSERT INTO messages (conv_id, role, content, created_at, stats)"
                   " VALUES (1, ?, ?, ?, ?)", (role, content, float(i), stats))
    db.execute("INSERT INTO conversations VALUES (2, 'e', 0, 0)")
    db.execute("INSERT INTO messages (conv_id, role, content, created_at) VALUES (2, 'user', 'q', 0)")
    db.execute("INSERT INTO messages (conv_id, role, content, created_at) VALUES (2, 'assistant', '', 1)")
    db.commit()
    db.close()
    with ChatStore(old) as s:
        msgs = s.messages(1)
        assert [m.content for m in msgs] == ["q1", "a1", "q2", "cut"]
        assert [m.parent_id for m in msgs] == [None, msgs[0].id, msgs[1].id, msgs[2].id]
        assert msgs[3].streaming and not msgs[1].streaming
        assert s.recover_interrupted() == [msgs[3].id]
        assert s.messages(1)[-1].interrupted and [m.role for m in s.messages(2)] == ["user"]
    fresh = tmp_path / "fresh.sqlite3"
    ChatStore(fresh).close()
    assert schema_of(old) == schema_of(fresh)


def test_variants_select_delete_and_export(store: ChatStore):
    c = store.create_conversation("v")
    u = store.add_message(c, "user", "q")
    a1 = store.add_message(c, "assistant", "one", stats={"stop_reason": "eos"})
    a2 = store.add_message(c, "assistant", "two", parent_id=u, stats={"stop_reason": "eos"})
    assert [m.content for m in store.messages(c)] == ["q", "two"]
    assert store.variant_ids(a1) == [a1, a2]
    store.select_variant(a1)
    follow = store.add_message(c, "user", "after one")
    assert [m.content for m in store.messages(c)] == ["q", "one", "after one"]
    data = store.export_json(c)
    second = data["messages"][1]
    assert second["variant"] == 1 and [v["selected"] for v in second["variants"]] == [True, False]
    assert second["variants"][1]["content"] == "two" and second["variants"][1]["messages"] == []
    md = store.export_markdown(c)
    assert "## Assistant (variant 1 of 2, selected)" in md and "Variant 2 of 2" in md
    store.delete_messages_from(c, a1)                    # the branch goes, the other variant shows
    assert [m.content for m in store.messages(c)] == ["q", "two"]
    with pytest.raises(KeyError):
        store.get_message(follow)


def test_drafts_round_trip_and_go_with_their_conversation(store: ChatStore):
    c = store.create_conversation()
    store.set_draft(c, "half")
    store.set_draft(None, "new chat")
    assert store.draft(c) == "half" and store.draft(None) == "new chat"
    store.set_draft(c, "")
    assert store.draft(c) == ""
    store.set_draft(c, "again")
    store.delete_conversation(c)
    assert store.draft(c) == "" and store.draft(None) == "new chat"


def test_newer_schema_is_refused_untouched(tmp_path: Path):
    path = tmp_path / "future.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 3}")
    db.close()
    with pytest.raises(ChatStoreError, match="newer tritonchat"):
        ChatStore(path)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 3
    db.close()


def test_corrupt_file_gives_one_sentence(tmp_path: Path):
    path = tmp_path / "junk.sqlite3"
    path.write_bytes(b"this is not a database at all" * 200)
    with pytest.raises(ChatStoreError, match="cannot be read") as info:
        ChatStore(path)
    assert info.value.details


def test_locked_file_gives_one_sentence(tmp_path: Path, monkeypatch):
    path = tmp_path / "locked.sqlite3"
    ChatStore(path).close()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("PRAGMA journal_mode = DELETE")       # so EXCLUSIVE locks readers out too
    other.execute("BEGIN EXCLUSIVE")
    monkeypatch.setattr(ChatStore, "BUSY_TIMEOUT_S", 0.05)
    try:
        with pytest.raises(ChatStoreError, match="busy in another program"):
            ChatStore(path)
    finally:
        other.execute("ROLLBACK")
        other.close()
    ChatStore(path).close()                             # fine once the other one lets go


def test_export_json(store: ChatStore):
    c = store.create_conversation("Export me")
    store.add_message(c, "system", "Be brief.")
    store.add_message(c, "user", "Why is the sky blue?")
    store.add_message(c, "assistant", "Rayleigh scattering.", thinking="short wavelengths",
                      stats=STATS)
    data = store.export_json(c)
    assert data["format"] == EXPORT_FORMAT == "tritonchat-chat-v1"
    assert data["title"] == "Export me"
    assert data["created_at"] == store.get_conversation(c).created_at
    assert [(m["role"], m["content"], m["thinking"], m["stats"]) for m in data["messages"]] == [
        ("system", "Be brief.", "", None), ("user", "Why is the sky blue?", "", None),
        ("assistant", "Rayleigh scattering.", "short wavelengths", STATS)]
    assert json.loads(json.dumps(data)) == data            # plain JSON types only


def test_export_markdown(store: ChatStore):
    c = store.create_conversation("Sky talk")
    store.add_message(c, "user", "Why is the sky blue?")
    store.add_message(c, "assistant", "```python\nprint('blue')\n```",
                      thinking="It scatters.\n</details> sneaky", stats=STATS)
    md = store.export_markdown(c)
    lines = md.splitlines()
    assert lines[0] == "# Sky talk"
    assert md.index("## User") < md.index("Why is the sky blue?") < md.index("## Assistant")
    # Thinking sits in a <details> block before the answer, and cannot close it early.
    start, end = md.index("<details>"), md.rindex("</details>")
    assert start > md.index("## Assistant") and end < md.index("```python")
    assert "<summary>Thinking</summary>" in md[start:end]
    assert "It scatters." in md[start:end]
    assert md.count("</details>") == 1
    assert "```python\nprint('blue')\n```" in md
    assert f"*{stats_line(STATS)}*" in md            # the chat view's line, word for word
    assert "*TTFT 42 ms  ·  prefill 5,120 tok/s  ·  decode 211.2 tok/s  ·  37 tokens  ·  " \
           "finished  ·  triton split-K on graph off*" in md
    assert md.endswith("\n")


def test_default_path_under_user_data_dir(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    path = ChatStore.default_path()
    assert path.name == "chats.sqlite3"
    if sys.platform.startswith("linux"):
        assert path == tmp_path / "xdg" / "tritonchat" / "chats.sqlite3"


def test_store_module_is_qt_free():
    code = ("import sys; import tritonchat.app.store; "
            "bad = [m for m in sys.modules if m.startswith(('PySide6', 'platformdirs', 'torch'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
