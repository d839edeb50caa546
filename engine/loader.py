"""Build a backend from a model folder (or random weights) and engine options."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from .options import EngineOptions, cuda_available
from .backend import Backend
from .config import TextConfig, load_config
from .errors import BackendUnavailableError
from .reference import ReferenceBackend, torch_dtype
from .weights import load_weights, random_weights

Progress = Optional[Callable[[str, float], None]]


def check_options(options: EngineOptions) -> None:
    """The options are valid and the machine can run them (a CUDA device is there)."""
    options.validate()
    if options.device.startswith("cuda") and not cuda_available():
        raise BackendUnavailableError("No CUDA GPU is available here; use --device cpu (the reference engine).")


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
    from .compat import check_gpu_stack
    options, notes = check_gpu_stack(options)
    backend = TritonBackend(cfg, weights, options, valid_vocab=valid_vocab, progress=progress)
    backend.notes = notes
    return backend


def load_backend(model_dir: str | Path, options: EngineOptions, valid_vocab: Optional[int] = None,
                 progress: Progress = None) -> tuple[TextConfig, Backend]:
    check_options(options)
    cfg = load_config(model_dir)
    options.check_context(cfg.max_position_embeddings)
    if progress:
        progress("weights", 0.0)
    weights = load_weights(model_dir, cfg, device=options.device, dtype=torch_dtype(options.dtype))
    if progress:
        progress("weights", 1.0)
    return cfg, make_backend(cfg, weights, options, valid_vocab=valid_vocab, progress=progress)


def random_backend(cfg: TextConfig, options: EngineOptions, seed: int = 0, progress: Progress = None) -> Backend:
    check_options(options)
    options.check_context(cfg.max_position_embeddings)
    weights = random_weights(cfg, device=options.device, dtype=torch_dtype(options.dtype), seed=seed)
    return make_backend(cfg, weights, options, progress=progress)
