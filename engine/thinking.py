"""Split a streamed answer into its thinking part and its visible answer.

Qwen3.5 writes its reasoning between `<think>` and `</think>`. With thinking on, the generation
prompt already ends in `<think>\\n`, so the model's text starts inside the block: everything up to
`</think>` is thinking, the `\\n\\n` after the tag is layout, the rest is the answer. With thinking
off the prompt carries an empty closed block and all text is answer, except that a model which
writes its own empty `<think>\\n\\n</think>\\n\\n` first has that stray block removed.

Text arrives in arbitrary pieces (a tag can be split over several), so the splitter holds back
the shortest tail that could still turn out to be a tag, newlines that could precede `</think>`,
or a possible stray block, and releases it as soon as it is decided. The output never depends on
how the text was cut: pushing pieces and flushing gives the same result as pushing it whole.
"""
from __future__ import annotations

import re

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

_THINKING = "thinking"          # inside the think block
_AFTER_CLOSE = "after_close"    # right after </think>: drop the newlines before the answer
_ANSWER_START = "answer_start"  # thinking off, nothing decided yet: could be a stray empty block
_ANSWER = "answer"

_STRAY_BLOCK = re.compile(re.escape(THINK_OPEN) + r"\s*" + re.escape(THINK_CLOSE))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _could_be_stray_block(text: str) -> bool:
    """Is `text` a prefix of `<think>` + whitespace + `</think>` (not yet complete)?"""
    if len(text) <= len(THINK_OPEN):
        return THINK_OPEN.startswith(text)
    if not text.startswith(THINK_OPEN):
        return False
    rest = text[len(THINK_OPEN):].lstrip()
    return THINK_CLOSE.startswith(rest) and len(rest) < len(THINK_CLOSE)


class ThinkingSplitter:
    """Routes decoded text into (thinking_delta, answer_delta).

    thinking_open: the prompt left a think block open (ChatTokenizer.opens_thinking). Leading and
    trailing newlines of the thinking are dropped (the template strips them when it re-renders
    reasoning), as are the newlines between `</think>` and the answer. A block that never closes
    (generation stopped mid-thought) leaves everything in `thinking` and an empty answer.
    """

    def __init__(self, thinking_open: bool):
        self.thinking_open = bool(thinking_open)
        self.thinking = ""
        self.answer = ""
        self._state = _THINKING if self.thinking_open else _ANSWER_START
        self._held = ""

    @property
    def in_thinking(self) -> bool:
        """Still inside the think block (the next text would be thinking)."""
        return self._state == _THINKING

    def push(self, text: str) -> tuple[str, str]:
        self._held += text
        return self._advance(final=False)

    def flush(self) -> tuple[str, str]:
        """End of the stream: release what was held back."""
        return self._advance(final=True)

    # ------------------------------------------------------------------

    def _advance(self, final: bool) -> tuple[str, str]:
        think_out: list[str] = []
        answer_out: list[str] = []
        while True:
            buf = self._held
            if self._state == _THINKING:
                end = buf.find(THINK_CLOSE)
                if end >= 0:
                    think_out.append(self._thinking_text(buf[:end].rstrip("\n"), think_out))
                    self._held = buf[end + len(THINK_CLOSE):]
                    self._state = _AFTER_CLOSE
                    continue
                if final:
                    think_out.append(self._thinking_text(buf.rstrip("\n"), think_out))
                    self._held = ""
                    break
                # Hold a possible start of </think>, and the newlines before it (they are dropped
                # if the tag follows).
                keep = len(buf) - _partial_suffix(buf, THINK_CLOSE)
                safe = buf[:keep].rstrip("\n")
                think_out.append(self._thinking_text(safe, think_out))
                self._held = buf[len(safe):]
                break
            if self._state == _AFTER_CLOSE:
                rest = buf.lstrip("\n")
                if rest:
                    self._held = rest
                    self._state = _ANSWER
                    continue
                self._held = ""         # only newlines so far (or the end): nothing to show
                break
            if self._state == _ANSWER_START:
                stray = _STRAY_BLOCK.match(buf)
                if stray:
                    self._held = buf[stray.end():]
                    self._state = _AFTER_CLOSE
                    continue
                if _could_be_stray_block(buf) and not final:
                    break                # undecided: wait for more text
                self._state = _ANSWER
                continue
            # _ANSWER
            answer_out.append(buf)
            self._held = ""
            break
        thinking_delta, answer_delta = "".join(think_out), "".join(answer_out)
        self.thinking += thinking_delta
        self.answer += answer_delta
        return thinking_delta, answer_delta

    def _thinking_text(self, text: str, pending: list[str]) -> str:
        # Nothing shown yet: the newlines right after <think> are layout, not thought.
        if not self.thinking and not "".join(pending):
            return text.lstrip("\n")
        return text
