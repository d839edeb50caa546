"""Chat templates: find the checkpoint's jinja template and render it the way transformers does.

The template is the model's own (`chat_template.jinja`, or the `chat_template` field of
`tokenizer_config.json`). It is rendered in a sandboxed jinja2 environment configured like
transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`,
a `tojson` that keeps non-ASCII text, `strftime_now`) so that the official text comes out byte for
byte. No torch, no Qt: the CLI, the app and the tests all import this.
"""
from __future__ import annotations

import json
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
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
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
    try:
        return template.render(
            messages=[dict(m) for m in messages],
            tools=list(tools) if tools else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            **variables,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError("The chat template failed to render this conversation.",
                                details=str(e)) from e
