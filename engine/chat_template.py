"""Chat templates: find the checkpoint's jinja template and render it the way transformers does.

The template is the model's own (`chat_template.jinja`, or the `chat_template` field of
`tokenizer_config.json`). It is rendered in a sandboxed jinja2 environment configured like
transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`,
a `tojson` that keeps non-ASCII text, `strftime_now`) so that the official text comes out byte for
byte. No torch, no Qt: the CLI, the app and the tests all import this.

A template from a model folder is untrusted code, so rendering is bounded: a time limit
(MAX_RENDER_SECONDS, checked at every loop iteration, call, attribute lookup and output chunk)
and an output-size limit (checked on every chunk `template.generate()` yields, and before a `*`,
`+`, `%` or `**` builds a string, list or number too large to be part of a prompt). Every way a
template can fail (Jinja's errors, the limits, OverflowError, RecursionError, ...) becomes the same
one sentence.
"""
from __future__ import annotations

import json
import math
import threading
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ModelFilesError, TritonChatError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class ChatTemplateError(TritonChatError):
    """The template refused the conversation (its own `raise_exception`) or failed to render it."""


FAILED = "The model's chat template failed to render this conversation."
MAX_RENDER_SECONDS = 5.0
MIN_OUTPUT_CHARS = 1_000_000  # plus twice the text of the conversation: a prompt repeats little
_LOOP_GUARD = "tc_loop_guard"


class _RenderLimit(Exception):
    """A render ran past its time or size limit (reason in args[0])."""


_state = threading.local()  # (deadline, size limit) of the render running on this thread


def _check_time() -> None:
    limits = getattr(_state, "limits", None)
    if limits is not None and time.monotonic() > limits[0]:
        raise _RenderLimit(f"it ran longer than {MAX_RENDER_SECONDS:g} s")


def _size_limit() -> int:
    limits = getattr(_state, "limits", None)
    return limits[1] if limits is not None else MIN_OUTPUT_CHARS


def _too_big(n: int) -> None:
    if n > _size_limit():
        raise _RenderLimit(f"it built a value of {n} items, over the limit of {_size_limit()}")


class _Guarded:
    """An iterable a template loops over: the deadline is checked at every iteration."""

    def __init__(self, iterable):
        self._iterable = iterable

    def __iter__(self):
        for item in self._iterable:
            _check_time()
            yield item

    def __len__(self) -> int:
        return len(self._iterable)  # TypeError when the iterable has no length, as LoopContext expects


def _loop_guard(iterable):
    return _Guarded(iterable)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with time and size checks in its hooks, and every for-loop's iterable guarded."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name(_LOOP_GUARD, "load", lineno=loop.lineno), [loop.iter], [],
                                   None, None, lineno=loop.lineno)
        return tree

    def call_binop(self, context, operator, left, right):
        _check_time()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    _too_big(len(seq) * max(n, 0))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * math.log2(abs(left)) > 1 << 16:   # a number of over 65536 bits
                raise OverflowError("integer power too large")
        elif operator == "+":
            for v in (left, right):
                if not isinstance(v, (str, list, tuple)):
                    break
            else:
                _too_big(len(left) + len(right))
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, (str, list, tuple)):
            _too_big(len(result))
        return result

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        _check_time()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        _check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _check_time()
        return super().getitem(obj, argument)


def _text_size(value: Any, depth: int = 0) -> int:
    """Characters of text in a conversation (its strings, nested)."""
    if isinstance(value, str):
        return len(value)
    if depth > 20:
        return 0
    if isinstance(value, Mapping):
        return sum(_text_size(k, depth + 1) + _text_size(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_text_size(v, depth + 1) for v in value)
    return 0


def _raise_exception(message: str):
    # Templates call this to reject a conversation ("System message must be at the beginning.").
    raise ChatTemplateError(f"The chat template rejected the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators=None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes '<', '>' and '&' for HTML and turns CJK into \uXXXX; the model
    # was trained on plain JSON with the characters themselves.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in HF;
    for rendering it is transparent, so the body is emitted unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals[_LOOP_GUARD] = _loop_guard
    return env


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once (templates are a few KB; compiling costs milliseconds)."""
    return _environment().from_string(source)


def load_template_source(folder: Path, tokenizer_config: Optional[Mapping] = None) -> Optional[str]:
    """The checkpoint's chat template text, or None when the folder has none.

    `chat_template.jinja` wins over the `chat_template` field of `tokenizer_config.json`, as in
    transformers. The field may also be a list of named templates; the one named "default" is used.
    """
    folder = Path(folder)
    path = folder / TEMPLATE_FILE
    if path.is_file():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFilesError(f"The chat template {path} could not be read as UTF-8 text.",
                                  details=str(e)) from e
        if source.strip():
            return source
    field = (tokenizer_config or {}).get("chat_template")
    if isinstance(field, str) and field.strip():
        return field
    if isinstance(field, list):
        for entry in field:
            if isinstance(entry, Mapping) and entry.get("name") == "default":
                template = entry.get("template")
                if isinstance(template, str) and template.strip():
                    return template
    return None


def render(source: str, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
           enable_thinking: bool = False, tools: Optional[Sequence[Mapping]] = None,
           special_tokens: Optional[Mapping[str, Optional[str]]] = None, **extra: Any) -> str:
    """Render `messages` with the template `source`, passing the same variables transformers does.

    `special_tokens` (bos_token, eos_token, pad_token, ...) are visible to the template by name;
    `extra` are further template switches (e.g. `add_vision_id`).
    """
    try:
        template = compile_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelFilesError(f"The chat template has a syntax error on line {e.lineno}.",
                              details=str(e)) from e
    variables = dict(special_tokens or {})
    variables.update(extra)
    messages = [dict(m) for m in messages]
    tools = list(tools) if tools else None
    limit = MIN_OUTPUT_CHARS + 2 * (_text_size(messages) + _text_size(tools) + _text_size(variables))
    previous = getattr(_state, "limits", None)
    _state.limits = (time.monotonic() + MAX_RENDER_SECONDS, limit)
    try:
        parts: list[str] = []
        size = 0
        for chunk in template.generate(messages=messages, tools=tools, documents=None,
                                       add_generation_prompt=add_generation_prompt,
                                       enable_thinking=enable_thinking, **variables):
            size += len(chunk)
            if size > limit:
                raise _RenderLimit(f"its output passed {limit} characters")
            _check_time()
            parts.append(chunk)
        return "".join(parts)
    except ChatTemplateError:
        raise
    except _RenderLimit as e:
        raise ChatTemplateError(FAILED, details=f"The template was stopped: {e.args[0]}.") from None
    except (jinja2.TemplateError, ArithmeticError, RecursionError, MemoryError, TypeError, ValueError,
            LookupError, AttributeError) as e:
        raise ChatTemplateError(FAILED, details=f"{type(e).__name__}: {str(e)[:500]}") from None
    finally:
        _state.limits = previous
