"""Qwen3.5 text-model configuration, read from a checkpoint's config.json.

Accepts the multimodal form (`model_type: qwen3_5`, fields under `text_config`) and the text-only
form (`model_type: qwen3_5_text`). Anything the text decoder cannot run is refused by name.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import ModelFilesError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

_SUPPORTED_ARCHS = {"Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5TextModel",
                    "Qwen3_5Model"}


@dataclass(frozen=True)
class TextConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    max_position_embeddings: int = 262144
    eos_token_id: Any = None

    # ---- derived sizes, named as in the spec ----
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    # ---- parameter / byte accounting (bench roofline, spec section 10) ----
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every text-model tensor the checkpoint must hold, by our short name (no prefix)."""
        D, I = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "embed_tokens.weight": (self.vocab_size, D),
            "norm.weight": (D,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, D)
        for i, kind in enumerate(self.layer_types):
            p = f"layers.{i}."
            shapes[p + "input_layernorm.weight"] = (D,)
            shapes[p + "post_attention_layernorm.weight"] = (D,)
            shapes[p + "mlp.gate_proj.weight"] = (I, D)
            shapes[p + "mlp.up_proj.weight"] = (I, D)
            shapes[p + "mlp.down_proj.weight"] = (D, I)
            if kind == FULL_ATTENTION:
                H, KV, hd = self.num_attention_heads, self.num_key_value_heads, self.head_dim
                shapes[p + "self_attn.q_proj.weight"] = (H * hd * 2, D)
                shapes[p + "self_attn.k_proj.weight"] = (KV * hd, D)
                shapes[p + "self_attn.v_proj.weight"] = (KV * hd, D)
                shapes[p + "self_attn.o_proj.weight"] = (D, H * hd)
                shapes[p + "self_attn.q_norm.weight"] = (hd,)
                shapes[p + "self_attn.k_norm.weight"] = (hd,)
            else:
                Hv = self.linear_num_value_heads
                shapes[p + "linear_attn.in_proj_qkv.weight"] = (self.conv_dim, D)
                shapes[p + "linear_attn.in_proj_z.weight"] = (self.linear_value_dim, D)
                shapes[p + "linear_attn.in_proj_b.weight"] = (Hv, D)
                shapes[p + "linear_attn.in_proj_a.weight"] = (Hv, D)
                shapes[p + "linear_attn.conv1d.weight"] = (self.conv_dim, 1, self.linear_conv_kernel_dim)
                shapes[p + "linear_attn.dt_bias"] = (Hv,)
                shapes[p + "linear_attn.A_log"] = (Hv,)
                shapes[p + "linear_attn.norm.weight"] = (self.linear_value_head_dim,)
                shapes[p + "linear_attn.out_proj.weight"] = (D, self.linear_value_dim)
        return shapes

    def num_parameters(self) -> int:
        n = 0
        for s in self.expected_shapes().values():
            k = 1
            for d in s:
                k *= d
            n += k
        return n

    def decode_bytes_per_token(self, weight_bytes: int = 2, context: int = 0) -> int:
        """Bytes one decode step must move: every weight once (the tied LM head read whole),
        the GDN recurrent states read + written in fp32, and the KV cache read up to `context`."""
        params = self.num_parameters() - self.vocab_size * self.hidden_size * (0 if self.tie_word_embeddings else 1)
        # the tied embedding is read whole by the LM head; its gather reads one row (ignored)
        b = params * weight_bytes
        n_lin, n_full = len(self.linear_attention_layers), len(self.full_attention_layers)
        b += n_lin * self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4 * 2
        b += n_full * 2 * self.num_key_value_heads * self.head_dim * weight_bytes * context
        return b


def _require(d: dict, key: str, where: str):
    if key not in d:
        raise ModelFilesError(f"{where} has no '{key}' field, so it is not a Qwen3.5 text config.")
    return d[key]


def parse_config(raw: dict, where: str = "config.json") -> TextConfig:
    """Build a TextConfig from a parsed config.json (either form)."""
    if not isinstance(raw, dict):
        raise ModelFilesError(f"{where} does not hold a JSON object.")
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type == "qwen3_5":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelFilesError(f"{where} is a qwen3_5 config without a 'text_config' object.")
        tie_top = raw.get("tie_word_embeddings")
    elif model_type == "qwen3_5_text":
        text, tie_top = raw, None
    else:
        name = model_type or (archs[0] if archs else "unknown")
        raise ModelFilesError(
            f"{where} describes a '{name}' model; tritonchat runs only Qwen3.5 (model_type qwen3_5 or qwen3_5_text).")
    bad_archs = [a for a in archs if a not in _SUPPORTED_ARCHS]
    if bad_archs:
        raise ModelFilesError(f"{where} names the architecture '{bad_archs[0]}', which tritonchat does not run.")
    if text.get("model_type", "qwen3_5_text") != "qwen3_5_text":
        raise ModelFilesError(f"{where}: text_config has model_type '{text.get('model_type')}', expected qwen3_5_text.")

    n_layers = int(_require(text, "num_hidden_layers", where))
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers:
        raise ModelFilesError(f"{where}: layer_types has {len(layer_types)} entries for {n_layers} layers.")
    unknown = sorted({t for t in layer_types if t not in (FULL_ATTENTION, LINEAR_ATTENTION)})
    if unknown:
        raise ModelFilesError(f"{where}: layer type '{unknown[0]}' is not supported (only full_attention and linear_attention).")

    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope", None):
        raise ModelFilesError(f"{where}: rope_type '{rope_type}' is not supported (only default).")
    rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))

    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ModelFilesError(f"{where}: hidden_act '{act}' is not supported (only silu).")
    if text.get("attention_bias", False):
        raise ModelFilesError(f"{where}: attention_bias=true is not supported.")
    if text.get("attn_output_gate", True) is False:
        raise ModelFilesError(f"{where}: attn_output_gate=false is not supported.")
    if text.get("num_experts") or text.get("moe_intermediate_size"):
        raise ModelFilesError(f"{where}: mixture-of-experts Qwen3.5 models are not supported.")

    # transformers' Qwen3_5ForConditionalGeneration ties by its own (top-level) config: that value
    # wins over text_config's. Without one, transformers would use its default (False) and leave
    # a tied checkpoint's LM head random; text_config's value is the better guess then.
    tie = tie_top if tie_top is not None else text.get("tie_word_embeddings")
    if tie is None:
        tie = False

    cfg = TextConfig(
        hidden_size=int(_require(text, "hidden_size", where)),
        intermediate_size=int(_require(text, "intermediate_size", where)),
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        vocab_size=int(_require(text, "vocab_size", where)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(tie),
        num_attention_heads=int(_require(text, "num_attention_heads", where)),
        num_key_value_heads=int(_require(text, "num_key_value_heads", where)),
        head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"])),
        rope_theta=rope_theta,
        partial_rotary_factor=partial,
        linear_num_key_heads=int(_require(text, "linear_num_key_heads", where)),
        linear_num_value_heads=int(_require(text, "linear_num_value_heads", where)),
        linear_key_head_dim=int(_require(text, "linear_key_head_dim", where)),
        linear_value_head_dim=int(_require(text, "linear_value_head_dim", where)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
        eos_token_id=text.get("eos_token_id", raw.get("eos_token_id")),
    )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelFilesError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads.")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ModelFilesError(f"{where}: linear_num_value_heads must be a multiple of linear_num_key_heads.")
    if cfg.rotary_dim % 2 or cfg.rotary_dim > cfg.head_dim:
        raise ModelFilesError(f"{where}: partial_rotary_factor gives an invalid rotary dimension {cfg.rotary_dim}.")
    return cfg


def load_config(model_dir: str | Path) -> TextConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelFilesError(f"{path} is missing; a Qwen3.5 model folder needs its config.json.")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFilesError(f"{path} is not valid JSON ({e.msg if hasattr(e, 'msg') else e}).") from e
    return parse_config(raw, str(path))


def qwen35_08b_config() -> TextConfig:
    """The true Qwen3.5-0.8B text shape (spec section 1.1), for --random-weights benchmarks."""
    return TextConfig(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        layer_types=tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(24)),
        vocab_size=248320, rms_norm_eps=1e-6, tie_word_embeddings=True,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, rope_theta=1e7,
        partial_rotary_factor=0.25, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        max_position_embeddings=262144, eos_token_id=248044,
    )
