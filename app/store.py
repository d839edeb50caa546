"""The chat history: conversations and their messages in one SQLite file.

Qt-free on purpose (the GUI thread owns one ChatStore; tests run headless).  Every write is
committed at once and the database runs in WAL mode, so a crash loses at most the write in
flight.  Deleting is real: ``secure_delete`` zeroes freed content in the database file and a
truncating WAL checkpoint removes the old page images from the ``-wal`` file.

The schema carries a version (``PRAGMA user_version``).  A new database is built by running the
same ordered migrations an old one is upgraded with, so the upgrade path is exercised every time.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator

from tritonchat.engine.errors import TritonChatError

from .stats_text import stats_line

ROLES = ("system", "user", "assistant")
DEFAULT_TITLE = "New chat"
EXPORT_FORMAT = "tritonchat-chat-v1"


class ChatStoreError(TritonChatError):
    """The chat history file cannot be used (written by a newer version, corrupt, ...)."""


@dataclass
class Conversation:
    id: int
    title: str
    created_at: float   # seconds since the epoch
    updated_at: float   # bumped by every new message: the list is ordered by it


@dataclass
class Message:
    id: int
    conv_id: int
    role: str           # "system" | "user" | "assistant"
    content: str        # the answer (or the prompt), without the thinking
    thinking: str       # the model's <think> text, kept apart from the answer
    stats: dict | None  # GenerationStats + engine flags of the run that wrote it
    created_at: float
    parent_id: int | None = None   # the message it answers or follows (None: the first turn)
    variant: int = 1               # 1-based place among the messages with the same parent
    variants: int = 1              # how many there are (regenerated answers, edited prompts)
    streaming: bool = False        # written while it streams; still set after a crash

    @property
    def interrupted(self) -> bool:
        return (self.stats or {}).get("stop_reason") == "interrupted"


# --- schema -----------------------------------------------------------------------------------
# Each entry upgrades the database from version i to i + 1.  Never edit a released step: append
# a new one.  Steps run inside one transaction together with the user_version bump.

def _v1_base(db: sqlite3.Connection) -> None:
    # AUTOINCREMENT: ids are never reused, so an id the GUI still holds cannot name a newer row,
    # and message ids order the turns of a conversation.
    db.execute("""
        CREATE TABLE conversations (
            id         INTEGER PRIMARY KEY AUTOINCREMENT,
            title      TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )""")
    db.execute("""
        CREATE TABLE messages (
            id         INTEGER PRIMARY KEY AUTOINCREMENT,
            conv_id    INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role       TEXT NOT NULL,
            content    TEXT NOT NULL DEFAULT '',
            created_at REAL NOT NULL
        )""")


def _v2_thinking_stats_index(db: sqlite3.Connection) -> None:
    # Thinking is stored apart from the answer; stats is a JSON object (NULL for user turns).
    db.execute("ALTER TABLE messages ADD COLUMN thinking TEXT NOT NULL DEFAULT ''")
    db.execute("ALTER TABLE messages ADD COLUMN stats TEXT")
    # messages(conv_id) is read on every conversation switch and by ON DELETE CASCADE.
    db.execute("CREATE INDEX messages_by_conv ON messages(conv_id, id)")
    db.execute("CREATE INDEX conversations_by_update ON conversations(updated_at)")


def _v3_variants_drafts(db: sqlite3.Connection) -> None:
    # A conversation is a tree: regenerating an answer or editing a prompt adds a sibling (a
    # variant) instead of deleting the old one; `selected` marks the variant shown, and the
    # conversation is the path of selected messages from the first turn.  No foreign key on
    # parent_id: a cascade down a long chain would hit SQLite's trigger depth limit.
    db.execute("ALTER TABLE messages ADD COLUMN parent_id INTEGER")
    db.execute("ALTER TABLE messages ADD COLUMN selected INTEGER NOT NULL DEFAULT 1")
    # 1 while an answer streams; a row still at 1 when the app starts again was cut off by a crash
    db.execute("ALTER TABLE messages ADD COLUMN streaming INTEGER NOT NULL DEFAULT 0")
    db.execute("UPDATE messages SET parent_id = (SELECT MAX(p.id) FROM messages p"
               " WHERE p.conv_id = messages.conv_id AND p.id < messages.id)")
    # an answer without stats was never finished (v2 wrote stats at the end of every run)
    db.execute("UPDATE messages SET streaming = 1 WHERE role = 'assistant' AND stats IS NULL")
    # the text typed but not sent, per conversation (conv_id 0: the new chat not yet created)
    db.execute("""
        CREATE TABLE drafts (
            conv_id    INTEGER PRIMARY KEY,
            text       TEXT NOT NULL,
            updated_at REAL NOT NULL
        )""")


MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (
    _v1_base,
    _v2_thinking_stats_index,
    _v3_variants_drafts,
)
SCHEMA_VERSION = len(MIGRATIONS)


def _contains_casefold(haystack: str | None, needle: str) -> bool:
    # SQLite's LIKE folds ASCII only; chats are in any language.
    return haystack is not None and needle in haystack.casefold()


class ChatStore:
    """Conversations and messages in one SQLite file; one instance per thread that uses it."""

    BUSY_TIMEOUT_S = 5.0   # how long a write waits for another tritonchat holding the lock

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            # Chats are private: create the file owner-only (SQLite gives -wal/-shm the same mode).
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        # isolation_level=None: no implicit transactions; _tx() makes each write one commit.
        self._db = sqlite3.connect(str(self.path), isolation_level=None,
                                   timeout=self.BUSY_TIMEOUT_S)
        try:
            self._db.row_factory = sqlite3.Row
            self._db.create_function("contains_casefold", 2, _contains_casefold,
                                     deterministic=True)
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.execute("PRAGMA secure_delete = ON")
            self._db.execute("PRAGMA journal_mode = WAL")
            # NORMAL in WAL mode: a crash of the app loses nothing committed; only a power cut
            # can drop the last commits.  FULL would fsync ~1/s on the GUI thread while streaming.
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            details = f"{type(exc).__name__}: {exc}"
            if "locked" in str(exc):
                raise ChatStoreError(f"The chat history {self.path} is busy in another program: "
                                     "close it and start tritonchat again.", details) from exc
            raise ChatStoreError(f"The chat history file {self.path} cannot be read: move it "
                                 "away to start afresh.", details) from exc
        except BaseException:
            self._db.close()
            raise

    @staticmethod
    def default_path() -> Path:
        import platformdirs   # lazily: engine-side code imports this module where it is absent

        return Path(platformdirs.user_data_dir("tritonchat", appauthor=False)) / "chats.sqlite3"

    # --- plumbing ---------------------------------------------------------------------------

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        # IMMEDIATE takes the write lock up front, so a second app instance waits (busy timeout)
        # instead of failing half-way through.
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise ChatStoreError(
                f"The chat history {self.path} was written by a newer tritonchat: update "
                "tritonchat to open it.",
                details=f"schema version {version}, this build knows {SCHEMA_VERSION}")
        for step in range(version, SCHEMA_VERSION):
            with self._tx() as db:
                MIGRATIONS[step](db)
                db.execute(f"PRAGMA user_version = {step + 1}")

    def _checkpoint(self) -> None:
        # Copy the WAL into the database and truncate it to zero bytes, so page images holding
        # deleted text do not linger in the -wal file.  Busy (another reader) -> retried on close.
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()

    @staticmethod
    def _clean_title(title: str) -> str:
        return " ".join(str(title).split()) or DEFAULT_TITLE

    @staticmethod
    def _stats_json(stats: Any) -> str | None:
        if stats is None:
            return None
        if hasattr(stats, "to_dict"):
            stats = stats.to_dict()
        if not isinstance(stats, dict):
            raise TypeError(f"stats must be a dict or None, not {type(stats).__name__}")
        return json.dumps(stats, ensure_ascii=False, sort_keys=True)

    @staticmethod
    def _conversation(row: sqlite3.Row) -> Conversation:
        return Conversation(id=row["id"], title=row["title"], created_at=row["created_at"],
                            updated_at=row["updated_at"])

    @staticmethod
    def _message(row: sqlite3.Row, variant: int = 1, variants: int = 1) -> Message:
        stats = json.loads(row["stats"]) if row["stats"] is not None else None
        return Message(id=row["id"], conv_id=row["conv_id"], role=row["role"],
                       content=row["content"], thinking=row["thinking"], stats=stats,
                       created_at=row["created_at"], parent_id=row["parent_id"],
                       variant=variant, variants=variants, streaming=bool(row["streaming"]))

    def _tree(self, conv_id: int) -> dict[int | None, list[sqlite3.Row]]:
        """parent id -> its children in the order they were written."""
        children: dict[int | None, list[sqlite3.Row]] = {}
        for r in self._db.execute("SELECT * FROM messages WHERE conv_id = ? ORDER BY id", (conv_id,)):
            children.setdefault(r["parent_id"], []).append(r)
        return children

    def _path(self, children: dict, start: int | None = None) -> list[Message]:
        """The selected messages from `start`'s children down (the newest when none is marked)."""
        out: list[Message] = []
        parent = start
        seen = set()
        while children.get(parent) and parent not in seen:
            seen.add(parent)
            kids = children[parent]
            pick = next((i for i in range(len(kids) - 1, -1, -1) if kids[i]["selected"]), len(kids) - 1)
            out.append(self._message(kids[pick], pick + 1, len(kids)))
            parent = kids[pick]["id"]
        return out

    # --- conversations ----------------------------------------------------------------------

    def list_conversations(self, search: str = "") -> list[Conversation]:
        """Newest activity first; ``search`` (case-insensitive) matches titles and message text."""
        needle = search.strip().casefold()
        order = " ORDER BY c.updated_at DESC, c.id DESC"
        if not needle:
            rows = self._db.execute("SELECT * FROM conversations c" + order).fetchall()
        else:
            rows = self._db.execute(
                "SELECT * FROM conversations c WHERE contains_casefold(c.title, :q)"
                " OR EXISTS (SELECT 1 FROM messages m WHERE m.conv_id = c.id"
                "            AND contains_casefold(m.content, :q))" + order,
                {"q": needle}).fetchall()
        return [self._conversation(r) for r in rows]

    def create_conversation(self, title: str = DEFAULT_TITLE) -> int:
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO conversations (title, created_at, updated_at) VALUES (?, ?, ?)",
                (self._clean_title(title), now, now))
        return int(cur.lastrowid)

    def rename_conversation(self, conv_id: int, title: str) -> None:
        with self._tx() as db:
            cur = db.execute("UPDATE conversations SET title = ? WHERE id = ?",
                             (self._clean_title(title), conv_id))
            if cur.rowcount == 0:
                raise KeyError(f"no conversation {conv_id}")

    def delete_conversation(self, conv_id: int) -> None:
        """Delete the conversation and its messages for good (a missing id is not an error)."""
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE conv_id = ?", (conv_id,))
            db.execute("DELETE FROM drafts WHERE conv_id = ?", (conv_id,))
            db.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))
        self._checkpoint()

    def get_conversation(self, conv_id: int) -> Conversation:
        row = self._db.execute("SELECT * FROM conversations WHERE id = ?", (conv_id,)).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conv_id}")
        return self._conversation(row)

    # --- messages ---------------------------------------------------------------------------

    def messages(self, conv_id: int) -> list[Message]:
        """The conversation as shown: the selected variant of each turn, first turn first."""
        return self._path(self._tree(conv_id))

    def get_message(self, msg_id: int) -> Message:
        row = self._db.execute("SELECT * FROM messages WHERE id = ?", (msg_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {msg_id}")
        ids = self.variant_ids(msg_id)
        return self._message(row, ids.index(msg_id) + 1, len(ids))

    def variant_ids(self, msg_id: int) -> list[int]:
        """The ids of msg_id and its siblings (the same parent), oldest first."""
        row = self._db.execute("SELECT conv_id, parent_id FROM messages WHERE id = ?",
                               (msg_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {msg_id}")
        return [r[0] for r in self._db.execute(
            "SELECT id FROM messages WHERE conv_id = ? AND parent_id IS ? ORDER BY id",
            (row["conv_id"], row["parent_id"]))]

    _LAST = object()     # add_message's default parent: the last message shown

    def add_message(self, conv_id: int, role: str, content: str = "", thinking: str = "",
                    stats: dict | None = None, *, parent_id: Any = _LAST,
                    streaming: bool = False) -> int:
        """Append a message (or, with parent_id, add a variant under that parent); it becomes
        the selected one among its siblings.  streaming=True marks an answer still being written:
        the update that brings its stats ends that."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        now = time.time()
        with self._tx() as db:
            cur = db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?",
                             (now, conv_id))
            if cur.rowcount == 0:
                raise KeyError(f"no conversation {conv_id}")
            if parent_id is self._LAST:
                path = self.messages(conv_id)
                parent_id = path[-1].id if path else None
            db.execute("UPDATE messages SET selected = 0 WHERE conv_id = ? AND parent_id IS ?",
                       (conv_id, parent_id))
            cur = db.execute(
                "INSERT INTO messages (conv_id, role, content, thinking, stats, created_at,"
                " parent_id, selected, streaming) VALUES (?, ?, ?, ?, ?, ?, ?, 1, ?)",
                (conv_id, role, content, thinking, self._stats_json(stats), now, parent_id,
                 int(streaming)))
        return int(cur.lastrowid)

    def select_variant(self, msg_id: int) -> None:
        """Show msg_id instead of its siblings (and, below it, the branch it leads to)."""
        with self._tx() as db:
            row = db.execute("SELECT conv_id, parent_id FROM messages WHERE id = ?",
                             (msg_id,)).fetchone()
            if row is None:
                raise KeyError(f"no message {msg_id}")
            db.execute("UPDATE messages SET selected = (id = ?) WHERE conv_id = ? AND parent_id IS ?",
                       (msg_id, row["conv_id"], row["parent_id"]))

    def update_message(self, msg_id: int, *, content: str | None = None,
                       thinking: str | None = None, stats: dict | None = None) -> None:
        """Replace the given fields (None leaves a field as it is); committed before returning.
        Stats end a streaming answer."""
        sets: list[str] = []
        args: list[Any] = []
        if content is not None:
            sets.append("content = ?")
            args.append(content)
        if thinking is not None:
            sets.append("thinking = ?")
            args.append(thinking)
        if stats is not None:
            # a run's stats come when it ends: the answer is no longer streaming
            sets.append("stats = ?")
            args.append(self._stats_json(stats))
            sets.append("streaming = 0")
        with self._tx() as db:
            if sets:
                found = db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?",
                                   (*args, msg_id)).rowcount > 0
            else:
                found = db.execute("SELECT 1 FROM messages WHERE id = ?",
                                   (msg_id,)).fetchone() is not None
            if not found:
                raise KeyError(f"no message {msg_id}")

    def delete_message(self, msg_id: int) -> None:
        """Delete one message; its replies move up to its parent (nothing else is lost)."""
        with self._tx() as db:
            row = db.execute("SELECT parent_id FROM messages WHERE id = ?", (msg_id,)).fetchone()
            if row is not None:
                db.execute("UPDATE messages SET parent_id = ? WHERE parent_id = ?",
                           (row["parent_id"], msg_id))
                self._delete_rows(db, [msg_id])
        self._checkpoint()

    def delete_messages_from(self, conv_id: int, msg_id: int) -> None:
        """Delete ``msg_id`` and everything that follows it on its branch (its replies, theirs,
        ...); another variant of it, if any, is shown instead."""
        with self._tx() as db:
            self._delete_branch(db, conv_id, msg_id)
        self._checkpoint()

    @staticmethod
    def _delete_rows(db: sqlite3.Connection, ids: list[int]) -> None:
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            db.execute(f"DELETE FROM messages WHERE id IN ({','.join('?' * len(chunk))})", chunk)

    def _delete_branch(self, db: sqlite3.Connection, conv_id: int, msg_id: int) -> None:
        row = db.execute("SELECT parent_id, selected FROM messages WHERE id = ? AND conv_id = ?",
                         (msg_id, conv_id)).fetchone()
        if row is None:
            return
        ids = [r[0] for r in db.execute(
            "WITH RECURSIVE sub(id) AS (SELECT ?"
            " UNION ALL SELECT m.id FROM messages m JOIN sub ON m.parent_id = sub.id)"
            " SELECT id FROM sub", (msg_id,))]
        self._delete_rows(db, ids)
        if row["selected"]:       # show the newest variant left
            db.execute("UPDATE messages SET selected = 1 WHERE id = (SELECT MAX(id) FROM messages"
                       " WHERE conv_id = ? AND parent_id IS ?)", (conv_id, row["parent_id"]))

    def recover_interrupted(self) -> list[int]:
        """At start: answers still marked streaming were cut off by a crash.  One with no text
        is deleted (it must not reach the model as an empty turn); the others keep their text
        and get the stop reason "interrupted".  Returns the ids of the answers kept."""
        kept: list[int] = []
        with self._tx() as db:
            rows = db.execute("SELECT id, conv_id, content, thinking, stats FROM messages"
                              " WHERE streaming = 1 ORDER BY id").fetchall()
            for r in rows:
                if not r["content"].strip() and not r["thinking"].strip():
                    self._delete_branch(db, r["conv_id"], r["id"])
                    continue
                stats = json.loads(r["stats"]) if r["stats"] else {}
                stats["stop_reason"] = "interrupted"
                db.execute("UPDATE messages SET streaming = 0, stats = ? WHERE id = ?",
                           (self._stats_json(stats), r["id"]))
                kept.append(int(r["id"]))
        if rows:
            self._checkpoint()
        return kept

    # --- drafts -----------------------------------------------------------------------------

    def draft(self, conv_id: int | None) -> str:
        """The text typed but not sent in this conversation (None: the new chat)."""
        row = self._db.execute("SELECT text FROM drafts WHERE conv_id = ?",
                               (conv_id or 0,)).fetchone()
        return row[0] if row is not None else ""

    def set_draft(self, conv_id: int | None, text: str) -> None:
        with self._tx() as db:
            if text:
                db.execute("INSERT INTO drafts (conv_id, text, updated_at) VALUES (?, ?, ?)"
                           " ON CONFLICT(conv_id) DO UPDATE SET text = excluded.text,"
                           " updated_at = excluded.updated_at", (conv_id or 0, text, time.time()))
            else:
                db.execute("DELETE FROM drafts WHERE conv_id = ?", (conv_id or 0,))

    # --- export -----------------------------------------------------------------------------

    def export_json(self, conv_id: int) -> dict:
        """The conversation as shown in "messages"; a turn with variants lists them all in
        "variants" (the shown one has "selected": true), each other variant with the turns
        that followed it on its branch in "messages" -- nothing of the tree is left out."""
        conv = self.get_conversation(conv_id)
        children = self._tree(conv_id)

        def one(m: Message) -> dict:
            d = {"role": m.role, "content": m.content, "thinking": m.thinking,
                 "stats": m.stats, "created_at": m.created_at}
            if m.interrupted:
                d["interrupted"] = True
            return d

        def branch(path: list[Message]) -> list[dict]:
            out = []
            for m in path:
                d = one(m)
                if m.variants > 1:
                    d["variant"] = m.variant          # 1-based place of the shown one in "variants"
                    alts = []
                    for i, row in enumerate(children[m.parent_id]):
                        if row["id"] == m.id:
                            alts.append({**one(m), "selected": True})
                            continue
                        alt = self._message(row, i + 1, m.variants)
                        alts.append({**one(alt), "selected": False,
                                     "messages": branch(self._path(children, alt.id))})
                    d["variants"] = alts
                out.append(d)
            return out

        return {
            "format": EXPORT_FORMAT,
            "title": conv.title,
            "created_at": conv.created_at,
            "messages": branch(self._path(children)),
        }

    def export_markdown(self, conv_id: int) -> str:
        conv = self.get_conversation(conv_id)
        created = datetime.fromtimestamp(conv.created_at).strftime("%Y-%m-%d %H:%M")
        parts = [f"# {conv.title}", f"*Chat started {created}; exported from tritonchat.*"]
        children = self._tree(conv_id)

        def body(m: Message) -> list[str]:
            out = []
            if m.thinking:
                # Blank lines around the body let Markdown render inside the HTML block; a
                # literal closing tag in the thought would end the block early.
                text = _escape_details(m.thinking.strip())
                out.append(f"<details>\n<summary>Thinking</summary>\n\n{text}\n\n</details>")
            if m.content:
                out.append(m.content.strip())
            line = stats_line(m.stats)
            if line:
                out.append(f"*{line}*")
            return out

        for m in self._path(children):
            head = f"## {m.role.capitalize()}"
            if m.variants > 1:
                head += f" (variant {m.variant} of {m.variants}, selected)"
            parts.append(head)
            parts += body(m)
            if m.variants > 1:
                for i, row in enumerate(children[m.parent_id]):
                    if row["id"] == m.id:
                        continue
                    alt = self._message(row, i + 1, m.variants)
                    later = len(self._path(children, alt.id))
                    note = f" ({later} later message{'s' if later != 1 else ''} on its branch: " \
                           "see the JSON export)" if later else ""
                    inner = "\n\n".join(_escape_details(p) for p in body(alt)) or "*(empty)*"
                    parts.append(f"<details>\n<summary>Variant {i + 1} of {m.variants}{note}"
                                 f"</summary>\n\n{inner}\n\n</details>")
        return "\n\n".join(parts) + "\n"

    def close(self) -> None:
        if self._db is None:
            return
        try:
            self._checkpoint()
        finally:
            self._db.close()
            self._db = None

    def __enter__(self) -> "ChatStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def _escape_details(text: str) -> str:
    return text.replace("</details>", "&lt;/details&gt;")
