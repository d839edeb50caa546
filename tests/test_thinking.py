"""ThinkingSplitter: routing streamed text into thinking and answer, whatever the piece boundaries.

The oracle is a whole-text split written with plain string operations; the streaming splitter must
agree with it for every way of cutting the text (every one and two cut points exhaustively,
single characters, random pieces).
"""
from __future__ import annotations

import itertools
import random
import re

import pytest

from tritonchat.engine.thinking import ThinkingSplitter


def oracle(text: str, thinking_open: bool) -> tuple[str, str]:
    """(thinking, answer) of a complete generation."""
    if thinking_open:
        if "</think>" not in text:
            return text.strip("\n"), ""                       # stopped mid-thought
        thinking, answer = text.split("</think>", 1)
        return thinking.strip("\n"), answer.lstrip("\n")
    stray = re.match(r"<think>\s*</think>", text)
    if stray:
        return "", text[stray.end():].lstrip("\n")
    return "", text


def run(pieces, thinking_open: bool) -> tuple[str, str]:
    splitter = ThinkingSplitter(thinking_open)
    thinking, answer = [], []
    for piece in pieces:
        t, a = splitter.push(piece)
        thinking.append(t)
        answer.append(a)
    t, a = splitter.flush()
    thinking.append(t)
    answer.append(a)
    result = "".join(thinking), "".join(answer)
    assert result == (splitter.thinking, splitter.answer)    # deltas add up to the totals
    return result


THINKING_ON = [
    "Let me add 2 and 2.\nThat is 4.\n</think>\n\nThe answer is 4.",
    "\n\nleading newlines\n\n</think>\n\n\nanswer",
    "</think>\n\nno thinking at all",
    "thought</think>answer with no newline",
    "a < b and </thin is not a tag\n</think>\n\nx </think> stays in the answer",
    "stopped mid-thought, never closed\n",
    "stopped inside the tag </thi",
    "spaces before the tag   </think>  answer keeps its spaces",
    "line\n\n\nbreaks\n\n</think>\n\n\n\n",
    "",
]

THINKING_OFF = [
    "Plain answer.",
    "<think>\n\n</think>\n\nAnswer after a stray empty block.",
    "<think></think>tight stray block",
    "<think>\nreal thoughts the model should not have had\n</think>\n\nkept verbatim",
    "Answer mentioning <think> and </think> tags later.",
    "<thin",
    "<think>\n\n",
    "<think>\n\n</thi",
    "\n<think>\n\n</think>\n\nleading newline: not a stray block",
    "",
]


@pytest.mark.parametrize("text", THINKING_ON)
def test_thinking_on_whole(text):
    assert run([text], True) == oracle(text, True)


@pytest.mark.parametrize("text", THINKING_OFF)
def test_thinking_off_whole(text):
    assert run([text], False) == oracle(text, False)


def test_examples_by_hand():
    assert run(["Reasoning.\n</think>\n\nAnswer."], True) == ("Reasoning.", "Answer.")
    assert run(["Half a thought </thi"], True) == ("Half a thought </thi", "")
    assert run(["<think>\n\n</think>\n\nHello"], False) == ("", "Hello")
    assert run(["<think>\nx\n</think>\n\nHello"], False) == ("", "<think>\nx\n</think>\n\nHello")


@pytest.mark.parametrize("thinking_open, text", [(True, t) for t in THINKING_ON] +
                         [(False, t) for t in THINKING_OFF])
def test_every_cut(thinking_open, text):
    # Every placement of one and of two cuts, so each tag is split across every boundary.
    expected = oracle(text, thinking_open)
    n = len(text)
    for i in range(n + 1):
        assert run([text[:i], text[i:]], thinking_open) == expected, i
    for i, j in itertools.combinations(range(n + 1), 2):
        assert run([text[:i], text[i:j], text[j:]], thinking_open) == expected, (i, j)


@pytest.mark.parametrize("thinking_open", [True, False])
def test_character_by_character(thinking_open):
    for text in THINKING_ON + THINKING_OFF:
        assert run(list(text), thinking_open) == oracle(text, thinking_open)


@pytest.mark.parametrize("thinking_open", [True, False])
def test_random_texts_and_cuts(thinking_open):
    atoms = ["<think>", "</think>", "<", "</", "think", ">", "\n", "\n\n", " ", "a", "思", "😀"]
    rng = random.Random(7)
    for _ in range(400):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 14)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 5))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert run(pieces, thinking_open) == oracle(text, thinking_open), pieces


def test_deltas_stream_early():
    # Thinking and answer text show up as soon as they cannot be part of a tag.
    s = ThinkingSplitter(True)
    assert s.push("step one") == ("step one", "")
    assert s.push(" and two\n") == (" and two", "")          # the newline waits for what follows
    assert s.push("more") == ("\nmore", "")
    assert s.push("</th") == ("", "")
    assert s.in_thinking
    assert s.push("ink>\n") == ("", "")
    assert not s.in_thinking
    assert s.push("\nAns") == ("", "Ans")
    assert s.push("wer") == ("", "wer")
    assert s.flush() == ("", "")
    assert (s.thinking, s.answer) == ("step one and two\nmore", "Answer")


def test_thinking_off_streams_plain_answers_at_once():
    s = ThinkingSplitter(False)
    assert s.push("Hello") == ("", "Hello")
    assert s.push(" <think>") == ("", " <think>")
    s = ThinkingSplitter(False)
    assert s.push("<thi") == ("", "")                       # could be a stray block: held
    assert s.push("nk>\n\n</think>\n\nHi") == ("", "Hi")
