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


MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (
    _v1_base,
    _v2_thinking_stats_index,
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
    def _message(row: sqlite3.Row) -> Message:
        stats = json.loads(row["stats"]) if row["stats"] is not None else None
        return Message(id=row["id"], conv_id=row["conv_id"], role=row["role"],
                       content=row["content"], thinking=row["thinking"], stats=stats,
                       created_at=row["created_at"])

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
            db.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))
        self._checkpoint()

    def get_conversation(self, conv_id: int) -> Conversation:
        row = self._db.execute("SELECT * FROM conversations WHERE id = ?", (conv_id,)).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conv_id}")
        return self._conversation(row)

    # --- messages ---------------------------------------------------------------------------

    def messages(self, conv_id: int) -> list[Message]:
        rows = self._db.execute("SELECT * FROM messages WHERE conv_id = ? ORDER BY id",
                                (conv_id,)).fetchall()
        return [self._message(r) for r in rows]

    def add_message(self, conv_id: int, role: str, content: str = "", thinking: str = "",
                    stats: dict | None = None) -> int:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        now = time.time()
        with self._tx() as db:
            cur = db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?",
                             (now, conv_id))
            if cur.rowcount == 0:
                raise KeyError(f"no conversation {conv_id}")
            cur = db.execute(
                "INSERT INTO messages (conv_id, role, content, thinking, stats, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (conv_id, role, content, thinking, self._stats_json(stats), now))
        return int(cur.lastrowid)

    def update_message(self, msg_id: int, *, content: str | None = None,
                       thinking: str | None = None, stats: dict | None = None) -> None:
        """Replace the given fields (None leaves a field as it is); committed before returning."""
        sets: list[str] = []
        args: list[Any] = []
        if content is not None:
            sets.append("content = ?")
            args.append(content)
        if thinking is not None:
            sets.append("thinking = ?")
            args.append(thinking)
        if stats is not None:
            sets.append("stats = ?")
            args.append(self._stats_json(stats))
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
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE id = ?", (msg_id,))
        self._checkpoint()

    def delete_messages_from(self, conv_id: int, msg_id: int) -> None:
        """Delete ``msg_id`` and every later message of the conversation (edit-and-resend)."""
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE conv_id = ? AND id >= ?", (conv_id, msg_id))
        self._checkpoint()

    # --- export -----------------------------------------------------------------------------

    def export_json(self, conv_id: int) -> dict:
        conv = self.get_conversation(conv_id)
        return {
            "format": EXPORT_FORMAT,
            "title": conv.title,
            "created_at": conv.created_at,
            "messages": [
                {"role": m.role, "content": m.content, "thinking": m.thinking,
                 "stats": m.stats, "created_at": m.created_at}
                for m in self.messages(conv_id)
            ],
        }

    def export_markdown(self, conv_id: int) -> str:
        conv = self.get_conversation(conv_id)
        created = datetime.fromtimestamp(conv.created_at).strftime("%Y-%m-%d %H:%M")
        parts = [f"# {conv.title}", f"*Chat started {created}; exported from tritonchat.*"]
        for m in self.messages(conv_id):
            parts.append(f"## {m.role.capitalize()}")
            if m.thinking:
                # Blank lines around the body let Markdown render inside the HTML block; a
                # literal closing tag in the thought would end the block early.
                body = m.thinking.strip().replace("</details>", "&lt;/details&gt;")
                parts.append(f"<details>\n<summary>Thinking</summary>\n\n{body}\n\n</details>")
            if m.content:
                parts.append(m.content.strip())
            line = stats_line(m.stats)
            if line:
                parts.append(f"*{line}*")
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
