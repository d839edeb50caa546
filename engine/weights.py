"""Load the text model's tensors from a Qwen3.5 checkpoint folder.

Accepts `model.safetensors` or an index (`model.safetensors.index.json`, whose shards may be named
like the official `model.safetensors-00001-of-00001.safetensors`). Takes `model.language_model.*`
(multimodal) or `model.*` (text-only), skips `model.visual.*` and `mtp.*`, keeps `A_log` and the
GDN norm weight in float32, checks every shape against the config, and reads each tensor straight
onto the target device (safetensors memory-maps the file; no second full copy in RAM).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from .config import TextConfig
from .errors import ModelFilesError

_TEXT_PREFIXES = ("model.language_model.", "model.")
_SKIP_PREFIXES = ("model.visual.", "mtp.", "visual.", "model.mtp.")
# Kept in float32 whatever the model dtype: the decay parameter and the GDN output-norm weight.
FP32_SUFFIXES = ("linear_attn.A_log", "linear_attn.norm.weight")


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of the checkpoint, from the index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
            weight_map = data["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelFilesError(f"{index} is not a valid safetensors index ({type(e).__name__}).") from e
        files = [model_dir / n for n in names]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ModelFilesError(f"{missing[0]} is missing (named by {index.name}); download the model again.")
        return files
    if single.is_file():
        return [single]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return others
    raise ModelFilesError(f"No weights in {model_dir}: expected model.safetensors or model.safetensors.index.json.")


def _short_name(key: str) -> str | None:
    """Checkpoint key -> our short name, or None for tensors the text model does not use."""
    if key.startswith(_SKIP_PREFIXES):
        return None
    if key == "lm_head.weight":
        return key
    for p in _TEXT_PREFIXES:
        if key.startswith(p):
            return key[len(p):]
    return None


def _open(path: Path, device: str):
    from safetensors import safe_open
    try:
        return safe_open(str(path), framework="pt", device=device)
    except Exception as e:  # safetensors raises its own SafetensorError / OSError for bad headers
        raise ModelFilesError(
            f"{path} is corrupt or truncated ({str(e).splitlines()[0][:120]}); download the model again.") from e


def iter_checkpoint_tensors(model_dir: Path, device: str = "cpu") -> Iterator[tuple[str, str, Path, object]]:
    """Yield (short_name, key, file, handle) for every text tensor in the checkpoint."""
    for path in weight_files(model_dir):
        f = _open(path, device)
        for key in f.keys():
            name = _short_name(key)
            if name is not None:
                yield name, key, path, f


def load_weights(model_dir: str | Path, cfg: TextConfig, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All text-model tensors by short name (e.g. `layers.0.linear_attn.A_log`), on `device`,
    in `dtype` except the float32 ones. Raises ModelFilesError naming the file on any problem."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelFilesError(f"Model folder {model_dir} does not exist.")
    expected = cfg.expected_shapes()
    dev = str(torch.device(device))
    out: dict[str, torch.Tensor] = {}
    where: dict[str, tuple[Path, str]] = {}
    for name, key, path, f in iter_checkpoint_tensors(model_dir, dev):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the LM head is the embedding
        if name not in expected:
            continue  # a tensor of a part we do not run
        try:
            shape = tuple(f.get_slice(key).get_shape())
        except Exception as e:
            raise ModelFilesError(f"{path} is corrupt: cannot read the header of '{key}'.") from e
        if shape != expected[name]:
            raise ModelFilesError(
                f"{path}: '{key}' has shape {list(shape)} but config.json implies {list(expected[name])}.")
        try:
            t = f.get_tensor(key)
        except Exception as e:
            raise ModelFilesError(f"{path} is corrupt or truncated: cannot read '{key}'.") from e
        if not (t.is_floating_point()):
            raise ModelFilesError(f"{path}: '{key}' has dtype {t.dtype}, expected a floating-point tensor.")
        target = torch.float32 if name.endswith(FP32_SUFFIXES) else dtype
        if t.dtype != target:
            t = t.to(target)
        out[name] = t
        where[name] = (path, key)
    missing = [n for n in expected if n not in out]
    if missing:
        raise ModelFilesError(
            f"The checkpoint in {model_dir} lacks '{missing[0]}' ({len(missing)} tensors missing); "
            "it is incomplete or not a Qwen3.5 checkpoint.")
    bad = first_non_finite(out)
    if bad is not None:
        path, key = where[bad]
        raise ModelFilesError(f"{path} is damaged: the tensor '{key}' holds NaN or infinite values; "
                              "download the model again or replace that file.")
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first tensor holding a NaN or an infinity, else None.

    One fused multi-tensor reduction per dtype (torch._foreach_norm, L1: NaN and inf propagate, and a
    sane weight's absolute sum cannot overflow) and one host sync for the whole checkpoint: well
    under a millisecond on the GPU, and on the CPU faster than an isfinite() pass per tensor.
    """
    names = list(tensors)
    if not names:
        return None
    groups: dict[tuple, list[int]] = {}
    for k, n in enumerate(names):
        t = tensors[n]
        groups.setdefault((t.device, t.dtype), []).append(k)
    order: list[int] = []
    sums = []
    for idx in groups.values():
        group = [tensors[names[k]] for k in idx]
        try:
            norms = torch._foreach_norm(group, 1)
        except (AttributeError, RuntimeError, TypeError):  # no fused kernel for this dtype/device
            norms = [g.abs().sum() for g in group]
        sums.append(torch.stack(list(norms)).float().to(group[0].device))
        order += idx
    device = sums[0].device
    finite = torch.isfinite(torch.cat([x.to(device) for x in sums]))
    if bool(finite.all()):  # the one host sync
        return None
    return names[order[int((~finite).nonzero()[0, 0])]]


def random_weights(cfg: TextConfig, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights at the config's true shape (benchmarks; speed does not depend on values).
    Scaled so activations stay O(1) through the layers."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in cfg.expected_shapes().items():
        fp32 = name.endswith(FP32_SUFFIXES)
        if name.endswith("A_log"):
            t = torch.rand(shape, generator=g, device=dev) * 2.0 - 1.0
        elif name.endswith("dt_bias"):
            t = torch.rand(shape, generator=g, device=dev)
        elif name.endswith("linear_attn.norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, device=dev)
        elif "norm" in name:
            t = 0.1 * torch.randn(shape, generator=g, device=dev)
        else:
            fan_in = shape[-1] if len(shape) == 2 else shape[-1]
            t = torch.randn(shape, generator=g, device=dev) * (fan_in ** -0.5)
        out[name] = t.to(dtype=torch.float32 if fp32 else dtype)
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out
