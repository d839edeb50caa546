"""Helpers every kernel module shares: dtypes, host-side grid arithmetic, the device queries
and the launch helpers of programmatic dependent launch (PDL), and the decode tuning table.

Imports nothing from the other kernel modules, so they all import it and never each other
for these.
"""
from __future__ import annotations

import json
import logging
import os
from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl

# the activation / weight dtypes the launchers accept
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ------------------------------------------------------------------------------------------
# host-side integer helpers (grid sizes, splits)
# ------------------------------------------------------------------------------------------
# `triton.cdiv` is a JIT function: called from Python it costs about 2 us (argument binding),
# and the launchers of the ~130-kernel decode step and the ~230-kernel prefill call it several
# times per launch. These are the same functions in plain Python.

def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers a >= 0, b > 0."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n (n >= 1; 0 for 0), as triton.next_power_of_2, which newer
    Triton versions also route through a slow constexpr-function call."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# ------------------------------------------------------------------------------------------
# device queries
# ------------------------------------------------------------------------------------------

# read once: the eager decode path and the prefill ask at every launch, and an environment
# lookup there cost ~2 us a launch on the device's host
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Whether the kernels run under the Triton interpreter (TRITON_INTERPRET=1, on CPU)."""
    return _INTERPRETER


@lru_cache(maxsize=16)
def _sm90_plus(kind: str, index: Optional[int]) -> bool:
    if kind != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


@lru_cache(maxsize=8)
def _sm_count_cached(kind: str, index: int) -> int:
    if kind == "cuda":
        return int(torch.cuda.get_device_properties(index).multi_processor_count)
    return 4        # the interpreter: a few "SMs", so tests cover programs striding over blocks


def sm_count(device) -> int:
    """Streaming multiprocessors of `device` (4 for a CPU device under the interpreter)."""
    device = torch.device(device)
    if device.type == "cuda":
        return _sm_count_cached("cuda", device.index if device.index is not None
                                else torch.cuda.current_device())
    return _sm_count_cached(device.type, 0)


# ------------------------------------------------------------------------------------------
# programmatic dependent launch (sm_90+)
# ------------------------------------------------------------------------------------------
# A PDL-launched kernel issues its weight loads (which no kernel writes), then waits for the
# previous kernel (gdc_wait) before reading activations. The launchers' `pdl` argument is the
# kernels' PDL constexpr: 0 off, 1 wait then let the next kernel launch (gdc_launch_dependents
# after the wait), 2 early trigger (at the very start: the next kernel's programs become
# resident and start their weight prefetch while this one still runs; its gdc_wait still waits
# for this grid to finish and flush).

PDL_OFF, PDL_ON, PDL_EARLY = 0, 1, 2
# the interpreter has no grid dependency control: there pdl_start / pdl_wait run as no-ops, so
# a launcher called with pdl 1 or 2 on CPU runs its PDL code paths (the tests do)
_GDC = tl.constexpr(not _INTERPRETER)


def pdl_mode(on: bool, early: bool, device) -> int:
    """The launchers' `pdl` argument for the engine's switches: PDL_OFF when `on` is false, under
    the interpreter and on GPUs older than sm_90; else PDL_EARLY with `early`, PDL_ON without."""
    if not on or _INTERPRETER:
        return PDL_OFF
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if not _sm90_plus(device.type, device.index):
        return PDL_OFF
    return PDL_EARLY if early else PDL_ON


def launch_kw(pdl: int) -> dict:
    """Extra launch keywords: launch_pdl only when PDL is on (older Triton lacks it)."""
    return {"launch_pdl": True} if pdl else {}


def check_pdl(pdl: int, name: str) -> int:
    """`pdl` as an int, refused unless 0, 1 or 2 (see pdl_mode)."""
    pdl = int(pdl)
    if pdl not in (PDL_OFF, PDL_ON, PDL_EARLY):
        raise ValueError(f"{name}: pdl must be 0 (off), 1 or 2 (early), got {pdl}")
    return pdl


@triton.jit
def pdl_start(PDL: tl.constexpr):
    # first statement of a PDL kernel: with mode 2 the next kernel may launch right away
    if PDL == 2 and _GDC:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    # wait for the producer grid (and its memory) before touching activations
    if PDL != 0 and _GDC:
        tl.extra.cuda.gdc_wait()
    if PDL == 1 and _GDC:
        # let the next PDL-launched kernel start its own weight prefetch as SMs free up
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    # Before the PDL wait: the lines at ptrs (weights, which no kernel writes) into L2, so the
    # loads after the wait hit there. A hint: no register receives the data, nothing waits on
    # it, the addresses must lie inside the tensor. A GPU instruction: nothing under the
    # interpreter.
    if _GDC:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


# ------------------------------------------------------------------------------------------
# tuned tables, one per GPU (decode_tuning.json, prefill_tuning.json; written by engine/tuning/)
# ------------------------------------------------------------------------------------------
# A table file holds {"tables": [table, ...]}, each table tagged with the GPU it was measured on
# ("gpu": its name, "sm_count", "capability": [major, minor]). A kernel reads the table of the
# GPU it runs on: the one measured on this GPU; else one measured on a GPU of the same SM count
# and architecture (an H100 SXM takes the H200's: 132 SMs, sm_90; one log line says so); else
# none (the plans' heuristics from the SM count; one log line). Under the interpreter (no GPU)
# the file's first table, so the CPU tests run the tuned plans' shapes.

DECODE_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                 "decode_tuning.json")

_log = logging.getLogger("tritonchat.kernels")


def gpu_identity() -> Optional[dict]:
    """{"gpu", "sm_count", "capability"} of the current CUDA device; None without one (or under
    the interpreter)."""
    if interpreting() or not torch.cuda.is_available():
        return None
    i = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(i)
    return {"gpu": p.name, "sm_count": int(p.multi_processor_count), "capability": list(torch.cuda.get_device_capability(i))}


def read_tables(path: str) -> list[dict]:
    """The tables of a table file ([] when it is missing or broken)."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict):
        return []
    if "tables" not in data:
        return [data]                       # one untagged table, for any GPU (the tests write these)
    tables = data["tables"]
    return [t for t in tables if isinstance(t, dict)] if isinstance(tables, list) else []


def select_table(tables: list[dict], gpu: Optional[dict]) -> tuple[Optional[dict], str]:
    """(the table for `gpu`, a sentence saying which when it is not this GPU's own; "" when it
    is). gpu None: the first table (the interpreter)."""
    if gpu is None:
        return (tables[0] if tables else None), ""
    for t in tables:
        if "gpu" not in t or (t["gpu"] == gpu["gpu"] and t.get("sm_count") == gpu["sm_count"]):
            return t, ""                    # this GPU's (an untagged table is every GPU's)
    for t in tables:
        if t.get("sm_count") == gpu["sm_count"] and list(t.get("capability", [])) == gpu["capability"]:
            return t, (f"no tuned table for the {gpu['gpu']}; using the one measured on the {t.get('gpu')} "
                       f"(the same {gpu['sm_count']} SMs and architecture)")
    return None, (f"no tuned table for the {gpu['gpu']} ({gpu['sm_count']} SMs); the kernels use plans "
                  "derived from the SM count (tune with python -m tritonchat.engine.tuning.decode)")


def table_for_this_gpu(path: str) -> Optional[dict]:
    """The table of `path` for the current GPU (select_table), the choice logged once."""
    table, note = _table_for(path, json.dumps(gpu_identity()))
    return table


@lru_cache(maxsize=8)
def _table_for(path: str, gpu_key: str) -> tuple[Optional[dict], str]:
    table, note = select_table(read_tables(path), json.loads(gpu_key))
    if note:
        _log.warning("tritonchat: %s", note)
    return table, note


def store_table(path: str, table: dict) -> None:
    """Write `table` (tagged with gpu / sm_count / capability) into the file at `path`,
    replacing the table of the same GPU and keeping the others."""
    tables = [t for t in read_tables(path)
              if (t.get("gpu"), t.get("sm_count")) != (table.get("gpu"), table.get("sm_count"))]
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"tables": [table] + tables}, f, indent=1)
        f.write("\n")
    clear_table_cache()


def clear_table_cache() -> None:
    """Read the table files again (after a tuner wrote one, or in tests)."""
    _table_for.cache_clear()
    decode_table.cache_clear()


@lru_cache(maxsize=1)
def decode_table() -> dict:
    """{kernel key: entry} of the decode table for this GPU (table_for_this_gpu); {} when none."""
    t = table_for_this_gpu(DECODE_TABLE_PATH)
    try:
        return {str(e["key"]): e for e in (t or {}).get("entries", [])}
    except (KeyError, TypeError):
        return {}
