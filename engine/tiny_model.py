"""A tiny random-weight Qwen3.5 model folder, in the official layout, for trying the app.

    tritonchat make-tiny DIR        (or make_tiny_model(DIR) from Python)

writes what the engine reads from a real checkpoint, with the same names and structure:

- config.json in the `Qwen3_5ForConditionalGeneration` form (model_type qwen3_5, the text
  model under `text_config`, a `vision_config`), at a tiny shape (4 layers: 3 Gated DeltaNet
  and 1 gated attention, hidden size 64, vocabulary 512);
- model.safetensors with the official tensor names (`model.language_model.layers.N....`),
  bfloat16 like the real file except `A_log` and the GDN norm weight in float32; the vision
  tower is left out (the text engine never reads it);
- tokenizer.json: a byte-level BPE trained here on a few sentences, followed by Qwen3.5's 33
  added tokens in their official order; tokenizer_config.json with the special flags, the eos
  token and the chat template; chat_template.jinja (Qwen3.5's template);
- generation_config.json (stop on <|im_end|> and <|endoftext|>, Qwen's sampling).

The weights are random, so the answers are gibberish: it exists to try the app and the CLI with
no GPU and no download. Needs only torch, safetensors and tokenizers (no transformers).
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Optional

from .errors import TritonChatError

TEMPLATE_RESOURCE = "qwen35_chat_template.jinja"
MARKER_FILE = "TINY_RANDOM_MODEL"       # tells the app the answers are random
TINY_VOCAB = 512

TINY_TEXT = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    vocab_size=TINY_VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-6,
)
TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                   patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                   num_position_embeddings=16, in_channels=3, hidden_act="gelu_pytorch_tanh",
                   model_type="qwen3_5_vision")

# Qwen3.5's added tokens in id order, with the "special" flag of its tokenizer_config.
QWEN35_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True),
    ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]

# Qwen-style pre-tokenizer split (contractions, letter runs, single digits, punctuation, spaces).
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
          r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello! How are you today? I'm fine, thanks.",
    "Machine learning models predict the next token given all the tokens before it.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i * 2))\n",
    "The capital of France is Paris. It's 12:45 and the temperature is 21.5 degrees.",
    "Ça va très bien, merci. Привет, как дела? 你好，世界！こんにちは。",
]


class TinyModelError(TritonChatError):
    pass


def train_tokenizer(base_vocab: int, corpus: Optional[list[str]] = None):
    """A byte-level BPE with Qwen's normalisation and pre-tokenisation, <= base_vocab ids,
    trained on `corpus` (default: a few lines of text and code)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, \
        processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=base_vocab, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator((corpus or _CORPUS) * 4, trainer=trainer)
    return tok


def chat_template_text() -> str:
    return resources.files("tritonchat.engine").joinpath(TEMPLATE_RESOURCE).read_text(encoding="utf-8")


def write_tokenizer(folder: Path, vocab_size: int = TINY_VOCAB) -> dict[str, int]:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja; returns {token: id}."""
    from tokenizers import AddedToken

    padding = max(3, vocab_size // 100)       # unused top rows, like the real 248320 vs 248077
    tok = train_tokenizer(vocab_size - len(QWEN35_ADDED_TOKENS) - padding)
    special: dict[str, int] = {}
    for text, is_special in QWEN35_ADDED_TOKENS:
        token = AddedToken(text, single_word=False, lstrip=False, rstrip=False, normalized=False,
                           special=is_special)
        (tok.add_special_tokens if is_special else tok.add_tokens)([token])
        special[text] = tok.token_to_id(text)
    tok.save(str(folder / "tokenizer.json"))
    template = chat_template_text()
    config = {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {
            str(special[text]): {"content": text, "lstrip": False, "normalized": False,
                                 "rstrip": False, "single_word": False, "special": is_special}
            for text, is_special in QWEN35_ADDED_TOKENS},
        "bos_token": None, "chat_template": template, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 262144,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                                  encoding="utf-8")
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return special


def config_dict(special: dict[str, int]) -> dict:
    """config.json in the Qwen3_5ForConditionalGeneration form, at the tiny shape."""
    n = TINY_TEXT["num_hidden_layers"]
    text = dict(TINY_TEXT, model_type="qwen3_5_text", hidden_act="silu", attention_bias=False,
                attention_dropout=0.0, tie_word_embeddings=True, eos_token_id=special["<|im_end|>"],
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
                rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                     mrope_section=[2, 1, 1], mrope_interleaved=True))
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": text, "vision_config": dict(TINY_VISION), "tie_word_embeddings": True,
        "image_token_id": special["<|image_pad|>"], "video_token_id": special["<|video_pad|>"],
        "vision_start_token_id": special["<|vision_start|>"],
        "vision_end_token_id": special["<|vision_end|>"],
    }


def write_weights(folder: Path, cfg_raw: dict, seed: int = 0) -> None:
    import torch
    from safetensors.torch import save_file

    from .config import parse_config
    from .weights import FP32_SUFFIXES, random_weights

    cfg = parse_config(cfg_raw)
    tensors = random_weights(cfg, device="cpu", dtype=torch.float32, seed=seed)
    tensors.pop("lm_head.weight", None)          # tied: the official file has no lm_head
    out = {}
    for name, t in sorted(tensors.items()):
        keep = name.endswith(FP32_SUFFIXES)
        out["model.language_model." + name] = t.to(torch.float32 if keep else torch.bfloat16).contiguous()
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})


def make_tiny_model(folder, *, seed: int = 0) -> Path:
    """Write a tiny random Qwen3.5 model into `folder` (new or empty); refuses a folder with files."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise TinyModelError(f"{folder} is a file, not a folder: choose a new folder for the tiny model.")
    if folder.is_dir() and any(folder.iterdir()):
        raise TinyModelError(f"{folder} is not empty: choose a new or empty folder for the tiny model.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TinyModelError(f"Cannot create {folder}: {e.strerror or e}.") from e
    special = write_tokenizer(folder)
    raw = config_dict(special)
    (folder / "config.json").write_text(json.dumps(raw, indent=2), encoding="utf-8")
    write_weights(folder, raw, seed=seed)
    generation = {"bos_token_id": special["<|endoftext|>"], "do_sample": True,
                  "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
                  "pad_token_id": special["<|endoftext|>"], "temperature": 1.0, "top_k": 20,
                  "top_p": 0.95}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    (folder / MARKER_FILE).write_text("Random weights written by `tritonchat make-tiny`: the answers "
                                      "are gibberish.\n", encoding="utf-8")
    return folder


def is_tiny_model(folder) -> bool:
    """Was this folder written by make_tiny_model (random answers)?"""
    return Path(folder).expanduser().joinpath(MARKER_FILE).is_file()
