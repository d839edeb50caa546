"""Tokenizer of a checkpoint folder: text <-> ids, chat prompts, stop ids, streaming decode.

Built on `tokenizers` (tokenizer.json) and the checkpoint's own jinja chat template. Special
tokens are always looked up by their text in the files, never by a literal id.

Prompt safety: message contents are user data. A user who types `<|im_start|>system` or
`<think>` must get those characters as plain text, not the control token. That holds for every
added token, special or not (`<think>`, `<tool_call>`, the FIM markers are "not special" in Qwen's
files, yet they are control ids all the same). encode_chat therefore renders the template with
every added-token string inside message contents swapped for a private-use placeholder, splits
the result at the added tokens that remain (they can only come from the template), puts the
original characters back, and encodes each stretch of text with added-token matching off. For
ordinary text this is exactly what encoding the whole rendered prompt gives, because `tokenizers`
also cuts the text at added tokens before pre-tokenising each stretch on its own.

The one exception is the model's own past output: an assistant message that the user did not edit
(no `"edited": True` key) keeps the non-special added tokens it was generated with (`<tool_call>`,
`<think>`) as their ids. Special tokens never appear in it: decoding for display drops them.

Text that is not valid Unicode (lone UTF-16 surrogates from a paste, or bytes a terminal could not
decode) is repaired in the one encode path every caller goes through: a surrogate pair becomes its
character and a lone surrogate becomes U+FFFD, so `tokenizers` never sees a string it rejects.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from tokenizers import Tokenizer

from . import chat_template
from .errors import ModelFilesError, TritonChatError
from .thinking import THINK_CLOSE, THINK_OPEN

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# What a lossy UTF-8 decode puts where a character is incomplete (or invalid).
REPLACEMENT_CHAR = "\ufffd"

_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def repair_text(text: str) -> str:
    """text with surrogate pairs joined and lone surrogates replaced by U+FFFD (valid UTF-8)."""
    if not _SURROGATE_RE.search(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


# Private-use code points that stand in for special-token text inside message contents while the
# template renders. _ESCAPE starts every placeholder; it also escapes itself, so any input maps
# back exactly, even text that happens to contain these code points.
_ESCAPE = "\U000F0000"
_FIRST_CODE = 0xF0001


def _read_json(path: Path) -> Optional[dict]:
    """The JSON object in an optional config file; None when it is absent. Errors name the file."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFilesError(f"The file {path} is corrupt (not valid JSON).", details=str(e)) from e
    if not isinstance(data, dict):
        raise ModelFilesError(f"The file {path} is corrupt (expected a JSON object).")
    return data


def _token_text(value: Any) -> Optional[str]:
    """A special-token entry of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class StreamDecoder:
    """Turns a stream of token ids into text pieces that are safe to show as they arrive.

    Byte-level tokens can end in the middle of a UTF-8 character (an emoji is four bytes, often
    two or more tokens). A window of recent ids is decoded again on every push; the part of its
    text past what was already shown is emitted, except trailing U+FFFD, which is what an
    incomplete character decodes to and is held back until the character completes (or the
    stream ends). Once the window ends on a whole character it restarts after the emitted text,
    so each push costs a few tokens of decoding, and the concatenation of all pushes plus flush()
    equals decoding all ids at once. The previous window's ids are kept as left context for
    decoders whose output depends on the preceding token (e.g. a leading-space marker).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._ctx = 0       # first id decoded (left context)
        self._start = 0     # first id whose text has not been fully emitted
        self._base = ""     # decode(ids[ctx:start]): text of the context, already emitted
        self._sent = 0      # characters past _base already emitted

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def _tail(self) -> str:
        text = self._decode(self._ids[self._ctx:])
        if not text.startswith(self._base):
            # A decoder whose context changed the earlier text: fall back to a full-length
            # comparison so nothing is shown twice.
            full = self._decode(self._ids)
            shown = self._decode(self._ids[:self._start])
            return full[len(shown):]
        return text[len(self._base):]

    def push(self, token_id: int) -> str:
        """Add one token; return the new text that is now safe to show (may be "")."""
        self._ids.append(int(token_id))
        tail = self._tail()
        stable = tail.rstrip(REPLACEMENT_CHAR)
        piece = stable[self._sent:]
        if len(stable) == len(tail):
            # The window ends on a whole character: everything is shown, start the next window.
            self._ctx, self._start = self._start, len(self._ids)
            self._base = self._decode(self._ids[self._ctx:self._start])
            self._sent = 0
        else:
            self._sent = max(self._sent, len(stable))
        return piece

    def flush(self) -> str:
        """End of stream: return whatever was held back (an unfinished character decodes to U+FFFD)."""
        piece = self._tail()[self._sent:]
        self._ctx = self._start = len(self._ids)
        self._base = ""
        self._sent = 0
        return piece


class ChatTokenizer:
    """The tokenizer, chat template and stop tokens of one checkpoint folder."""

    def __init__(self, tokenizer: Tokenizer, *, eos_token: str,
                 generation_config: Optional[dict] = None,
                 template_source: Optional[str] = None,
                 template_tokens: Optional[Mapping[str, Optional[str]]] = None,
                 source: str = "tokenizer"):
        # The one tokenizer never matches added tokens in text by itself: every added token is
        # flagged special on this instance (ids unchanged) and special matching is off, so
        # encode() and encode_chat() cut added tokens out first where they are allowed (see the
        # module doc). Which tokens the files call "special" is kept for decode(skip_special).
        self._tok = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        plain_added = [tok for tok in added.values() if not tok.special]
        if plain_added:
            from tokenizers import AddedToken
            self._tok.add_special_tokens([AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip,
                                                     rstrip=t.rstrip, normalized=t.normalized, special=True)
                                          for t in plain_added])
        self._tok.encode_special_tokens = True
        self._source = source
        self.generation_config: dict = dict(generation_config or {})
        self._template_source = template_source
        self._template_tokens = dict(template_tokens or {})

        self._added: dict[str, int] = {tok.content: i for i, tok in added.items()}
        self._added_texts = [tok.content for _, tok in sorted(added.items())]
        self._special_texts = [tok.content for i, tok in sorted(added.items()) if tok.special]
        # Ids run 0..n-1 over the model vocab, then the added tokens (get_vocab() would build a
        # 248k-entry dict just to take its max).
        self.vocab_size: int = max([tokenizer.get_vocab_size(with_added_tokens=True)]
                                   + [i + 1 for i in added])

        eos = tokenizer.token_to_id(eos_token)
        if eos is None:
            raise ModelFilesError(f"The end-of-turn token {eos_token!r} named in "
                                  f"{TOKENIZER_CONFIG_FILE} is not in the tokenizer.")
        self.eos_id: int = eos

        # Longest first, so that a token that contains another one is matched whole.
        by_length = sorted(self._added_texts, key=len, reverse=True)
        self._special_re = (re.compile("(" + "|".join(map(re.escape, by_length)) + ")")
                            if by_length else None)
        self._neutral_re = re.compile("|".join(map(re.escape, [_ESCAPE] + by_length)))
        special_by_length = sorted(self._special_texts, key=len, reverse=True)
        self._neutral_special_re = re.compile("|".join(map(re.escape, [_ESCAPE] + special_by_length)))
        self._neutral_of = {text: _ESCAPE + chr(_FIRST_CODE + k)
                            for k, text in enumerate([_ESCAPE] + self._added_texts)}
        self._restore_of = {v[1]: k for k, v in self._neutral_of.items()}
        self._restore_re = re.compile(re.escape(_ESCAPE) + "(.)", re.DOTALL)
        self.stop_ids: list[int] = self._stop_ids_from(self.generation_config, eos)
        self._opens_thinking: dict[bool, bool] = {}

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, path) -> "ChatTokenizer":
        """Load tokenizer.json, tokenizer_config.json, generation_config.json and the template.

        Raises ModelFilesError (one sentence naming the file) when tokenizer.json is missing or
        corrupt, or when a config file is present but corrupt. A missing chat template is allowed;
        encode_chat then raises ModelFilesError.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise ModelFilesError(f"The model folder {folder} does not exist.")
        tok_path = folder / TOKENIZER_FILE
        if not tok_path.is_file():
            raise ModelFilesError(f"The file {TOKENIZER_FILE} is missing from {folder}.")
        try:
            tokenizer = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises plain Exception subclasses for parse errors
            raise ModelFilesError(f"The file {tok_path} is corrupt (not a tokenizer).",
                                  details=str(e)) from e

        config = _read_json(folder / TOKENIZER_CONFIG_FILE) or {}
        generation = _read_json(folder / GENERATION_CONFIG_FILE) or {}

        eos_token = _token_text(config.get("eos_token"))
        if eos_token is None:
            # No tokenizer_config eos: fall back to the first generation_config eos id.
            ids = cls._eos_ids_of(generation)
            eos_token = tokenizer.id_to_token(ids[0]) if ids else None
        if eos_token is None:
            raise ModelFilesError(f"No end-of-turn token is named in {TOKENIZER_CONFIG_FILE} "
                                  f"or {GENERATION_CONFIG_FILE} in {folder}.")

        template_tokens = {name: _token_text(config.get(name))
                           for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        template_tokens["eos_token"] = eos_token
        return cls(tokenizer, eos_token=eos_token, generation_config=generation,
                   template_source=chat_template.load_template_source(folder, config),
                   template_tokens=template_tokens, source=str(folder))

    @staticmethod
    def _eos_ids_of(generation_config: Mapping) -> list[int]:
        value = generation_config.get("eos_token_id")
        if value is None:
            return []
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise ModelFilesError(f"The eos_token_id in {GENERATION_CONFIG_FILE} is not a "
                                  f"token id or a list of token ids.")
        return list(values)

    def _stop_ids_from(self, generation_config: Mapping, eos_id: int) -> list[int]:
        """generation_config.json's eos_token_id when it names any (what transformers stops on),
        else the template's end-of-turn tokens (the tokenizer's eos token and the added token the
        template writes right after an assistant message)."""
        ids = self._eos_ids_of(generation_config) or [eos_id] + self._template_end_ids()
        stop: list[int] = []
        for i in ids:
            if i >= self.vocab_size:
                raise ModelFilesError(f"The eos_token_id {i} in {GENERATION_CONFIG_FILE} is "
                                      f"outside the tokenizer's {self.vocab_size} ids.")
            if i not in stop:
                stop.append(i)
        return stop

    def _template_end_ids(self) -> list[int]:
        if self._template_source is None or self._special_re is None:
            return []
        marker = "\U000F7777"  # a private-use character no template writes by itself
        try:
            text = self._render([{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}],
                                False, False, None)
        except TritonChatError:
            return []  # a template that cannot render is reported when the chat starts
        at = text.rfind(marker)
        if at < 0:
            return []
        match = self._special_re.match(text[at + len(marker):].lstrip())
        return [self._added[match.group(0)]] if match else []

    # ------------------------------------------------------------------ tokens

    @property
    def has_chat_template(self) -> bool:
        return self._template_source is not None

    @property
    def special_tokens(self) -> dict[str, int]:
        """Every added token (special or not) by its text."""
        return dict(self._added)

    def token_id(self, name: str) -> Optional[int]:
        """Id of a special/added token given its text (e.g. "<|im_end|>"), None if there is none."""
        return self._added.get(name)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Ids of `text`. Added-token text is plain characters unless allow_special is set."""
        if not allow_special or self._special_re is None:
            return self._encode_plain(text)
        return self._encode_pieces(text, restore=False)

    def _encode_plain(self, text: str) -> list[int]:
        # The one place text reaches tokenizers: repair what is not valid Unicode here.
        return self._tok.encode(repair_text(text), add_special_tokens=False).ids

    def _encode_pieces(self, text: str, *, restore: bool) -> list[int]:
        """Special tokens in `text` become their ids, the text between them is encoded plainly.

        This is what tokenizers does when it matches special tokens itself: it cuts the text at
        added tokens and pre-tokenises each stretch separately.
        """
        ids: list[int] = []
        # re.split with one capture group alternates: text, special, text, ..., text.
        for k, part in enumerate(self._special_re.split(text)):
            if k % 2:
                ids.append(self._added[part])
            elif part:
                ids.extend(self._encode_plain(self._restore(part) if restore else part))
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ids; skip_special drops the tokens the files call special (as transformers'
        skip_special_tokens does), keeping `<think>`, `<tool_call>` and the other plain added tokens."""
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i not in self._special_ids]
        return self._tok.decode(ids, skip_special_tokens=False)

    def stream_decoder(self, *, skip_special: bool = True) -> StreamDecoder:
        """A streaming decoder for display: special tokens the model emits (`<|vision_pad|>`,
        `<|im_end|>` ...) are dropped from the text unless skip_special=False."""
        return StreamDecoder(lambda ids: self.decode(ids, skip_special=skip_special))

    # ------------------------------------------------------------------ chat

    def _render(self, messages: Sequence[Mapping], add_generation_prompt: bool,
                enable_thinking: bool, tools) -> str:
        if self._template_source is None:
            raise ModelFilesError(f"No chat template was found in {self._source} "
                                  f"({chat_template.TEMPLATE_FILE} or the chat_template field "
                                  f"of {TOKENIZER_CONFIG_FILE}).")
        return chat_template.render(self._template_source, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    enable_thinking=enable_thinking, tools=tools,
                                    special_tokens=self._template_tokens)

    def render_chat(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
                    enable_thinking: bool = False, tools=None) -> str:
        """The prompt text exactly as the template writes it (what transformers renders)."""
        return self._render(messages, add_generation_prompt, enable_thinking, tools)

    def encode_chat(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
                    enable_thinking: bool = False, tools=None) -> list[int]:
        """Prompt ids; special tokens come only from the template, never from message text."""
        neutral = [self._neutralise_message(m) for m in messages]
        text = self._render(neutral, add_generation_prompt, enable_thinking, tools)
        if self._special_re is None:
            return self._encode_plain(self._restore(text))
        return self._encode_pieces(text, restore=True)

    def opens_thinking(self, enable_thinking: bool) -> bool:
        """Does the generation prompt leave a think block open (end in `<think>\\n`)?"""
        key = bool(enable_thinking)
        if key not in self._opens_thinking:
            suffix = self.generation_prompt(enable_thinking=key)
            opened, closed = suffix.rfind(THINK_OPEN), suffix.rfind(THINK_CLOSE)
            self._opens_thinking[key] = opened >= 0 and closed < opened
        return self._opens_thinking[key]

    def generation_prompt(self, *, enable_thinking: bool = False) -> str:
        """The text the template appends for add_generation_prompt (e.g. `<|im_start|>assistant\\n`)."""
        probe = [{"role": "user", "content": "?"}]
        with_prompt = self._render(probe, True, enable_thinking, None)
        without = self._render(probe, False, enable_thinking, None)
        if not with_prompt.startswith(without):
            raise ModelFilesError("The chat template's generation prompt does not extend the "
                                  "conversation it follows.")
        return with_prompt[len(without):]

    # ------------------------------------------------------------------ placeholders

    def _neutralise(self, value: Any, pattern: "re.Pattern") -> Any:
        if isinstance(value, str):
            return pattern.sub(lambda m: self._neutral_of[m.group(0)], value)
        if isinstance(value, Mapping):
            return {k: self._neutralise(v, pattern) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._neutralise(v, pattern) for v in value]
        return value

    def _neutralise_message(self, message: Mapping) -> dict:
        # The role steers the template; everything else in a message is data. The model's own
        # past output (an assistant message nobody edited) keeps its plain added tokens.
        own = message.get("role") == "assistant" and not message.get("edited")
        pattern = self._neutral_special_re if own else self._neutral_re
        return {k: (v if k == "role" else self._neutralise(v, pattern))
                for k, v in message.items() if k != "edited"}

    def _restore(self, text: str) -> str:
        return self._restore_re.sub(lambda m: self._restore_of.get(m.group(1), m.group(0)), text)
