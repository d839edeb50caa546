"""Build a backend from a model folder (or random weights) and engine options."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from .api import EngineOptions
from .backend import Backend
from .config import TextConfig, load_config
from .errors import BackendUnavailableError, TritonChatError
from .reference import ReferenceBackend, torch_dtype
from .weights import load_weights, random_weights

Progress = Optional[Callable[[str, float], None]]


def cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


def default_options(device: Optional[str] = None, backend: Optional[str] = None,
                    dtype: Optional[str] = None, **kw) -> EngineOptions:
    """Defaults: CUDA if available else CPU; Triton on CUDA else reference; bf16 on CUDA else fp32."""
    device = device or ("cuda" if cuda_available() else "cpu")
    backend = backend or ("triton" if device == "cuda" else "reference")
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    return EngineOptions(backend=backend, device=device, dtype=dtype, **kw)


def check_options(options: EngineOptions) -> None:
    if options.device not in ("cpu", "cuda") and not options.device.startswith("cuda:"):
        raise TritonChatError(f"Unknown device '{options.device}'; use cpu or cuda.")
    if options.device.startswith("cuda") and not cuda_available():
        raise BackendUnavailableError("No CUDA GPU is available here; use --device cpu (the reference engine).")
    if options.dtype not in ("float32", "bfloat16", "float16"):
        raise TritonChatError(f"Unknown dtype '{options.dtype}'; use bfloat16, float16 or float32.")
    if options.backend not in ("reference", "triton"):
        raise TritonChatError(f"Unknown backend '{options.backend}'; use reference or triton.")
    if options.max_context < 2:
        raise TritonChatError("The context length must be at least 2 tokens.")


def make_backend(cfg: TextConfig, weights: dict, options: EngineOptions, valid_vocab: Optional[int] = None,
                 progress: Progress = None) -> Backend:
    check_options(options)
    if options.backend == "reference":
        return ReferenceBackend(cfg, weights, options, valid_vocab=valid_vocab)
    try:
        from .triton_backend import TritonBackend
    except ImportError as e:
        raise BackendUnavailableError(
            "The Triton backend is not available in this build; use --backend reference.", details=str(e)) from e
    return TritonBackend(cfg, weights, options, valid_vocab=valid_vocab, progress=progress)


def load_backend(model_dir: str | Path, options: EngineOptions, valid_vocab: Optional[int] = None,
                 progress: Progress = None) -> tuple[TextConfig, Backend]:
    check_options(options)
    cfg = load_config(model_dir)
    if progress:
        progress("weights", 0.0)
    weights = load_weights(model_dir, cfg, device=options.device, dtype=torch_dtype(options.dtype))
    if progress:
        progress("weights", 1.0)
    return cfg, make_backend(cfg, weights, options, valid_vocab=valid_vocab, progress=progress)


def random_backend(cfg: TextConfig, options: EngineOptions, seed: int = 0, progress: Progress = None) -> Backend:
    check_options(options)
    weights = random_weights(cfg, device=options.device, dtype=torch_dtype(options.dtype), seed=seed)
    return make_backend(cfg, weights, options, progress=progress)
