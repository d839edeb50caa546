"""The conversation controller: send, edit, regenerate, stop, variants and drafts, without Qt.

The main window only wires views to it (napari / TagStudio: a Qt-free core, views that lay out).
It talks to two things through small interfaces:

* the `ChatStore` (SQLite), where every turn, variant and draft is kept;
* an engine with `generate(messages, params, max_new_tokens, enable_thinking) -> handle` (the
  handle has `request_id` and a `stop_event`) and `count_tokens(tag, messages, enable_thinking)`;
  in the app that is `worker.EngineClient`, the Qt adapter over the engine thread, whose reports
  come back to `on_text` / `on_stats` / `on_finished` / `on_failed` / `on_token_count`.

What the views must show is told to a `ConversationListener` (every method a no-op here).

Regenerating an answer or editing a prompt never deletes: the new text is a variant beside the
old one (the store keeps the conversation as a tree), and the model's context for the next turn
is the path of the variants shown.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from .store import DEFAULT_TITLE, ChatStore, Message

SAVE_INTERVAL_S = 0.5            # the streaming answer reaches the store at least this often
TITLE_CHARS = 48
USER_TURN_TOKENS = 5             # <|im_start|>user\n ... <|im_end|>\n around a message


def title_from(text: str) -> str:
    """A conversation title from its first message: first line, trimmed."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = re.sub(r"\s+", " ", line)
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "\u2026"


def estimate_tokens(text: str) -> int:
    """A quick upper-leaning guess until the tokenizer has counted: ~4 characters per token
    for ASCII text, one per token for the rest (CJK and the like)."""
    ascii_chars = len(text.encode("ascii", "ignore"))
    return -(-ascii_chars // 4) + (len(text) - ascii_chars)


class Handle(Protocol):
    request_id: int
    stop_event: Any              # threading.Event


class Engine(Protocol):
    def generate(self, messages: list[dict], params: Any, max_new_tokens: int,
                 enable_thinking: bool) -> Handle: ...

    def count_tokens(self, tag: int, messages: list[dict], enable_thinking: bool) -> None: ...


class ConversationListener:
    """What the views are told; the main window overrides what it shows."""

    def opened(self, conv_id: int | None, title: str, messages: list[Message],
               streaming: "Generation | None", draft: str) -> None: ...
    def title_changed(self, conv_id: int, title: str) -> None: ...
    def message_added(self, message: Message) -> None: ...
    def removed_from(self, msg_id: int) -> None: ...
    def stream_started(self, message: Message, thinking_enabled: bool) -> None: ...
    def stream_text(self, thinking: str, answer: str) -> None: ...
    def stream_finished(self, message: Message, thinking_seconds: float | None) -> None: ...
    def busy_changed(self, busy: bool) -> None: ...
    def text_returned(self, text: str) -> None: ...
    def conversations_changed(self) -> None: ...
    def context_changed(self, used: int, total: int, exact: bool) -> None: ...
    def refused(self, sentence: str) -> None: ...
    def generation_finished(self, stats: dict) -> None: ...
    def generation_failed(self, sentence: str, details: str) -> None: ...


@dataclass
class Generation:
    """The answer being generated (there is at most one)."""

    request: Handle
    conv_id: int
    assistant_msg_id: int
    thinking_enabled: bool
    undo_id: int                     # deleted again if the run fails before any text
    returned_text: str | None        # put back in the input box then (send, edit)
    new_conversation: bool           # created by this send: removed again if the send fails
    thinking: str = ""
    answer: str = ""
    last_save: float = field(default_factory=time.monotonic)
    discarded: bool = False          # its conversation was deleted: write nothing more


class ConversationController:
    """One per window. `settings` is read at each send (system_prompt, thinking,
    max_new_tokens, sampling_params()); `loaded` says whether the engine can answer."""

    def __init__(self, store: ChatStore, engine: Engine, settings: Any,
                 listener: ConversationListener | None = None):
        self.store = store
        self.engine = engine
        self.settings = settings
        self.listener = listener or ConversationListener()
        self.loaded = False
        self.conv_id: int | None = None
        self.gen: Generation | None = None
        self.max_context = int(getattr(settings, "context_length", 0) or 0) or 2048
        self.engine_options: dict = {}
        self._drafts: dict[int | None, str] = {}
        self._dirty_drafts: set[int | None] = set()
        self._next_tag = 0
        self._counts: dict[int, tuple[str, int | None, str]] = {}    # tag -> (kind, conv, draft)
        self._conv_tokens: dict[int | None, int] = {}               # exact, without the draft
        self._draft_tokens: tuple[int | None, str, int] | None = None  # exact, with the draft

    # ================================================================ startup
    def recover(self) -> list[int]:
        """Run once at start: answers a crash cut off are marked interrupted, empty ones go."""
        return self.store.recover_interrupted()

    # ================================================================ conversations
    def new_chat(self) -> None:
        self._leave()
        self.conv_id = None
        self.listener.opened(None, DEFAULT_TITLE, [], None, self.draft(None))
        self.count_context()

    def open(self, conv_id: int) -> bool:
        try:
            conv = self.store.get_conversation(conv_id)
        except KeyError:
            self.listener.conversations_changed()
            return False
        if conv_id != self.conv_id:
            self._leave()
        self.conv_id = conv_id
        g = self.gen
        shown = g if g is not None and g.conv_id == conv_id and not g.discarded else None
        self.listener.opened(conv_id, conv.title, self.store.messages(conv_id), shown,
                             self.draft(conv_id))
        self.count_context()
        return True

    def rename(self, conv_id: int, title: str) -> None:
        title = title.strip()
        if not title:
            return
        self.store.rename_conversation(conv_id, title)
        self.listener.title_changed(conv_id, title)
        self.listener.conversations_changed()

    def delete(self, conv_id: int) -> None:
        g = self.gen
        if g is not None and g.conv_id == conv_id:
            g.discarded = True
            g.request.stop_event.set()
        self.store.delete_conversation(conv_id)
        self._drafts.pop(conv_id, None)
        self._dirty_drafts.discard(conv_id)
        if conv_id == self.conv_id:
            self.conv_id = None
            self.listener.opened(None, DEFAULT_TITLE, [], None, self.draft(None))
            self.count_context()
        self.listener.conversations_changed()

    def select_variant(self, msg_id: int, step: int) -> None:
        """Show the variant `step` places from msg_id (the arrows under a message)."""
        if self.conv_id is None or self.busy_here():
            return
        try:
            ids = self.store.variant_ids(msg_id)
        except KeyError:
            return
        i = ids.index(msg_id) + step
        if 0 <= i < len(ids):
            self.store.select_variant(ids[i])
            self.open(self.conv_id)

    def busy_here(self) -> bool:
        return self.gen is not None and self.gen.conv_id == self.conv_id

    # ================================================================ drafts
    def draft(self, conv_id: int | None) -> str:
        if conv_id not in self._drafts:
            self._drafts[conv_id] = self.store.draft(conv_id)
        return self._drafts[conv_id]

    def set_draft(self, text: str) -> None:
        """The input box changed: keep its text as this conversation's draft (written to the
        store by flush_drafts, which the window calls shortly after typing stops)."""
        if self._drafts.get(self.conv_id) != text:
            self._drafts[self.conv_id] = text
            self._dirty_drafts.add(self.conv_id)
        self._report_estimate(text)

    def flush_drafts(self) -> None:
        for conv_id in list(self._dirty_drafts):
            self._dirty_drafts.discard(conv_id)
            try:
                self.store.set_draft(conv_id, self._drafts.get(conv_id, ""))
            except KeyError:
                pass

    def _leave(self) -> None:
        self.flush_drafts()

    # ================================================================ context meter
    def engine_messages(self, conv_id: int | None, upto: int | None = None) -> list[dict]:
        """The conversation as the engine sees it: system prompt, then the turns shown (up to
        and including `upto`). Answers a crash cut off before any text never reach it."""
        out: list[dict] = []
        if self.settings.system_prompt.strip():
            out.append({"role": "system", "content": self.settings.system_prompt})
        if conv_id is None:
            return out
        for m in self.store.messages(conv_id):
            if m.role != "system" and not (m.role == "assistant" and m.streaming):
                if not (m.role == "assistant" and m.interrupted and not m.content and not m.thinking):
                    d = {"role": m.role, "content": m.content}
                    if m.role == "assistant" and m.thinking:
                        d["reasoning_content"] = m.thinking
                    out.append(d)
            if m.id == upto:
                break
        return out

    def count_context(self, draft: str | None = None) -> None:
        """Ask the engine for the exact count of the conversation (and of it plus the draft);
        the listener hears an estimate at once and the exact figure when it comes."""
        if draft is None:
            draft = self.draft(self.conv_id)
        if not self.loaded:
            self.listener.context_changed(0, self.max_context, False)
            return
        messages = self.engine_messages(self.conv_id)
        self._ask_count("conv", messages, "")
        if draft.strip():
            self._ask_count("draft", messages + [{"role": "user", "content": draft}], draft)
        self._report_estimate(draft)

    def _ask_count(self, kind: str, messages: list[dict], draft: str) -> None:
        self._next_tag += 1
        self._counts = {t: v for t, v in self._counts.items() if v[0] != kind or v[1] != self.conv_id}
        self._counts[self._next_tag] = (kind, self.conv_id, draft)
        self.engine.count_tokens(self._next_tag, messages, bool(self.settings.thinking))

    def on_token_count(self, tag: int, n: int, max_context: int) -> None:
        entry = self._counts.pop(tag, None)
        if entry is None:
            return
        kind, conv_id, draft = entry
        self.max_context = int(max_context)
        if kind == "conv":
            self._conv_tokens[conv_id] = int(n)
        else:
            self._draft_tokens = (conv_id, draft, int(n))
        if conv_id == self.conv_id and self.gen is None:
            self._report_estimate(self.draft(self.conv_id))

    def prompt_tokens(self, text: str) -> tuple[int, bool]:
        """(tokens the next prompt would take with `text` as the new message, exact?)."""
        d = self._draft_tokens
        if d is not None and d[0] == self.conv_id and d[1] == text:
            return d[2], True
        base = self._conv_tokens.get(self.conv_id)
        if base is None:
            base = sum(estimate_tokens(m["content"]) + USER_TURN_TOKENS
                       for m in self.engine_messages(self.conv_id))
        extra = estimate_tokens(text) + USER_TURN_TOKENS if text.strip() else 0
        exact = not text.strip() and self.conv_id in self._conv_tokens
        return base + extra, exact

    def _report_estimate(self, draft: str) -> None:
        if not self.loaded or self.gen is not None:
            return
        used, exact = self.prompt_tokens(draft)
        self.listener.context_changed(used, self.max_context, exact)

    def on_stats(self, request_id: int, stats: dict) -> None:
        g = self._current(request_id)
        if g is not None and g.conv_id == self.conv_id and stats.get("context_tokens") is not None:
            self.listener.context_changed(int(stats["context_tokens"]),
                                          int(stats.get("max_context") or self.max_context), True)

    def too_long(self, text: str) -> str | None:
        """The sentence to show instead of sending a prompt that cannot fit, else None."""
        used, exact = self.prompt_tokens(text)
        if used < self.max_context:
            return None
        about = "" if exact else "about "
        return (f"This message would make the conversation {about}{used:,} tokens long, more than "
                f"the {self.max_context:,}-token context: shorten it, start a new chat, or raise "
                "the context length in Settings.")

    # ================================================================ sending
    def send(self, text: str) -> bool:
        """Send `text` as the next user turn. False (and nothing changed) when it cannot be
        sent now; the caller keeps the text in the input box then."""
        if not text.strip() or self.gen is not None or not self.loaded:
            return False
        sentence = self.too_long(text)
        if sentence is not None:
            self.listener.refused(sentence)
            return False
        new_conv = self.conv_id is None
        if new_conv:
            self.conv_id = self.store.create_conversation(title_from(text) or DEFAULT_TITLE)
            self.listener.title_changed(self.conv_id, self.store.get_conversation(self.conv_id).title)
        self._clear_draft()
        user_id = self.store.add_message(self.conv_id, "user", text)
        self.listener.message_added(self.store.get_message(user_id))
        self.listener.conversations_changed()
        self._start(self.conv_id, user_id, undo_id=user_id, returned=text, new_conv=new_conv)
        return True

    def edit(self, user_msg_id: int, text: str) -> bool:
        """Send an edited prompt: a new variant of that user turn (the old one and its answers
        stay, one arrow away). The first prompt's edit renames a chat titled after it."""
        if self.gen is not None or not self.loaded or self.conv_id is None or not text.strip():
            return False
        conv = self.conv_id
        try:
            old = self.store.get_message(user_msg_id)
        except KeyError:
            return False
        path = self.store.messages(conv)
        first_user = next((m for m in path if m.role == "user"), None)
        user_id = self.store.add_message(conv, "user", text, parent_id=old.parent_id)
        if first_user is not None and first_user.id == old.id:
            title = self.store.get_conversation(conv).title
            if title == (title_from(old.content) or DEFAULT_TITLE):
                self.store.rename_conversation(conv, title_from(text) or DEFAULT_TITLE)
                self.listener.title_changed(conv, self.store.get_conversation(conv).title)
        self.listener.removed_from(user_msg_id)
        self.listener.message_added(self.store.get_message(user_id))
        self.listener.conversations_changed()
        self._start(conv, user_id, undo_id=user_id, returned=text, new_conv=False)
        return True

    def regenerate(self, assistant_msg_id: int) -> bool:
        """Answer the last prompt again; the answer it replaces stays as a variant."""
        if self.gen is not None or not self.loaded or self.conv_id is None:
            return False
        conv = self.conv_id
        msgs = self.store.messages(conv)
        idx = next((i for i, m in enumerate(msgs) if m.id == assistant_msg_id), None)
        # only the last answer: the arrows would otherwise hide the turns after it mid-stream
        if idx is None or idx != len(msgs) - 1 or idx == 0 or msgs[idx - 1].role != "user":
            return False
        self.listener.removed_from(assistant_msg_id)
        self._start(conv, msgs[idx - 1].id, undo_id=None, returned=None, new_conv=False)
        return True

    def regenerate_last(self) -> bool:
        msgs = self.store.messages(self.conv_id) if self.conv_id is not None else []
        if msgs and msgs[-1].role == "assistant":
            return self.regenerate(msgs[-1].id)
        return False

    def _start(self, conv_id: int, user_msg_id: int, *, undo_id: int | None,
               returned: str | None, new_conv: bool) -> None:
        s = self.settings
        messages = self.engine_messages(conv_id, upto=user_msg_id)
        assistant_id = self.store.add_message(conv_id, "assistant", "", parent_id=user_msg_id,
                                              streaming=True)
        if conv_id == self.conv_id:
            self.listener.stream_started(self.store.get_message(assistant_id), bool(s.thinking))
        request = self.engine.generate(messages, s.sampling_params(), s.max_new_tokens, s.thinking)
        self.gen = Generation(request=request, conv_id=conv_id, assistant_msg_id=assistant_id,
                              thinking_enabled=bool(s.thinking),
                              undo_id=undo_id if undo_id is not None else assistant_id,
                              returned_text=returned, new_conversation=new_conv)
        self.listener.busy_changed(True)

    def _clear_draft(self) -> None:
        self._drafts[self.conv_id] = ""
        self._dirty_drafts.discard(self.conv_id)
        self.store.set_draft(self.conv_id, "")
        if self.conv_id is not None:      # a new chat's draft was typed under "no conversation"
            self._drafts[None] = ""
            self.store.set_draft(None, "")

    def stop(self) -> bool:
        if self.gen is not None:
            self.gen.request.stop_event.set()
            return True
        return False

    # ================================================================ engine reports
    def _current(self, request_id: int) -> Generation | None:
        g = self.gen
        return g if g is not None and g.request.request_id == request_id else None

    def _save(self, g: Generation, **fields) -> None:
        if g.discarded:
            return
        try:
            self.store.update_message(g.assistant_msg_id, **fields)
        except KeyError:             # deleted under us (another window's recovery, a delete)
            g.discarded = True

    def on_text(self, request_id: int, thinking: str, answer: str) -> None:
        g = self._current(request_id)
        if g is None:
            return
        g.thinking += thinking
        g.answer += answer
        if g.conv_id == self.conv_id and not g.discarded:
            self.listener.stream_text(thinking, answer)
        now = time.monotonic()
        if now - g.last_save >= SAVE_INTERVAL_S:
            self._save(g, content=g.answer, thinking=g.thinking)
            g.last_save = now

    def on_finished(self, request_id: int, reply: dict) -> dict | None:
        g = self._current(request_id)
        if g is None:
            return None
        self.gen = None
        stats = {**(reply.get("engine") or {}), **(reply.get("stats") or {}),
                 "thinking_seconds": float(reply.get("thinking_seconds") or 0.0)}
        stats.pop("timing", None)
        answer, thinking = reply.get("answer", g.answer), reply.get("thinking", g.thinking)
        self._save(g, content=answer, thinking=thinking, stats=stats)
        if g.conv_id == self.conv_id and not g.discarded:
            self.listener.stream_finished(self.store.get_message(g.assistant_msg_id),
                                          stats["thinking_seconds"])
        self.listener.busy_changed(False)
        self.listener.conversations_changed()
        self.count_context()
        self.listener.generation_finished(stats)
        return stats

    def on_failed(self, request_id: int, sentence: str, details: str) -> bool:
        g = self._current(request_id)
        if g is None:
            return False
        self.gen = None
        shown = g.conv_id == self.conv_id
        if g.discarded:
            pass
        elif g.answer or g.thinking:
            # keep what was written; the stats say it ended in an error
            stats = {**self.engine_options, "stop_reason": "error"}
            stats.pop("timing", None)
            self._save(g, content=g.answer, thinking=g.thinking, stats=stats)
            if shown:
                self.listener.stream_finished(self.store.get_message(g.assistant_msg_id), None)
        else:
            # nothing came out: undo the send (or the new variant) and give the text back
            self.store.delete_messages_from(g.conv_id, g.undo_id)
            if g.new_conversation and not self.store.messages(g.conv_id):
                self.store.delete_conversation(g.conv_id)
                if shown:
                    self.conv_id = None
            if shown:
                self.open(self.conv_id) if self.conv_id is not None else self.listener.opened(
                    None, DEFAULT_TITLE, [], None, self.draft(None))
            if g.returned_text is not None:
                self.listener.text_returned(g.returned_text)
        self.listener.busy_changed(False)
        self.listener.conversations_changed()
        self.listener.generation_failed(sentence, details)
        return True

    # ================================================================ closing
    def save_in_flight(self) -> None:
        """Write the streaming answer as it stands, and the drafts (used on close)."""
        g = self.gen
        if g is not None and not g.discarded:
            stats = {**self.engine_options, "stop_reason": "stopped"}
            stats.pop("timing", None)
            self._save(g, content=g.answer, thinking=g.thinking, stats=stats)
            g.discarded = True
        self.flush_drafts()
