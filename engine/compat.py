"""Which torch and Triton the GPU path has been run with, and what to do on others.

The Triton engine uses two things that are not Triton's stable API: programmatic dependent
launch (`tl.extra.cuda.gdc_wait`, the `launch_pdl` launch keyword) and, for the launch cache,
the launcher objects of `triton.runtime.driver` (engine/launch_replay.py turns that option off
with its reason when the layout differs). pyproject.toml bounds the versions from above; this
module checks at engine start and turns off an option whose feature is missing, with one message,
instead of failing.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from .options import EngineOptions

log = logging.getLogger(__name__)

# (torch, triton) pairs the GPU tests and the bench have passed on (the device's stack). The CPU
# interpreter tests also run on torch 2.13 / Triton 3.9 (the CI machine).
GPU_TESTED = {("2.11", "3.6")}


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def has_pdl() -> bool:
    """This Triton can express programmatic dependent launch."""
    try:
        import triton.language.extra.cuda as cuda_ext
    except ImportError:
        return False
    return hasattr(cuda_ext, "gdc_wait") and hasattr(cuda_ext, "gdc_launch_dependents")


def check_gpu_stack(options: EngineOptions) -> tuple[EngineOptions, list[str]]:
    """The options this torch/Triton can run, and one sentence per thing switched off or untested."""
    import torch
    import triton
    notes = []
    pair = (_major_minor(torch.__version__), _major_minor(triton.__version__))
    if options.device.startswith("cuda") and pair not in GPU_TESTED:
        tested = ", ".join(f"torch {t} with Triton {tr}" for t, tr in sorted(GPU_TESTED))
        notes.append(f"torch {pair[0]} with Triton {pair[1]} has not been run on a GPU with tritonchat "
                     f"(tested: {tested}); if the engine misbehaves, install those versions.")
    if (options.pdl or options.pdl_early) and not has_pdl():
        options = replace(options, pdl=False, pdl_early=False)
        notes.append(f"Triton {triton.__version__} has no programmatic dependent launch; "
                     "PDL is off (decode runs about 8% slower).")
    for n in notes:
        log.warning(n)
    return options, notes
