"""What a persistent kernel needs besides its operators (issue #59): one grid of co-resident
programs walking static task lists, operators ordered by completion counters.

    device (inline PTX, GPU only)   globaltimer, stall, wait_counter, signal
    weight tiles                    rows_load
    host                            programs_per_sm, check_co_resident: a persistent grid larger
                                    than the GPU holds at once would deadlock

Counters only grow: an operator's counter gains one count per program per step, and a waiter's
target is the step number (the program's epoch slot + 1) x the grid, so nothing is reset between
steps or graph replays. The interpreter runs programs one after another, so only the `phase`
forms (one launch per operator, no waiting) and a grid of one program run there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv


@triton.jit
def globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def stall(ns, stamp_ptr):
    """Spin `ns` nanoseconds on %globaltimer; the time actually spent goes to stamp_ptr[0]."""
    t0 = globaltimer()
    t = t0
    while t - t0 < ns:
        t = globaltimer()
    tl.store(stamp_ptr, t - t0)


@triton.jit
def wait_counter(cnt_ptr, target, err_ptr, timeout_ns, SPIN: tl.constexpr):
    """Block the program until cnt_ptr[0] >= target (acquire). Spins on an acquire atomic
    (SPIN 0: one thread reads, the value is broadcast, so the loop is uniform) or on a volatile
    load followed by one acquire atomic (SPIN 1). After `timeout_ns` it gives up and sets
    err_ptr[0] = 1 instead of hanging (a grid that is not co-resident would deadlock)."""
    c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    if c < target:
        t0 = globaltimer()
        while c < target:
            if SPIN == 0:
                c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
            else:
                c = tl.load(cnt_ptr, volatile=True)
            if globaltimer() - t0 > timeout_ns:
                tl.atomic_xchg(err_ptr, 1)
                c = target
        if SPIN == 1:
            c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    # every thread's later activation loads after the acquiring thread's read
    tl.debug_barrier()


@triton.jit
def signal(cnt_ptr, n):
    """cnt_ptr[0] += n after all of this program's stores (barrier, then a release atomic)."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, n, sem="release", scope="gpu")


@triton.jit
def rows_load(base, rows, ok, offs, K: tl.constexpr, KP: tl.constexpr):
    """W[rows, :K] of a row-major [*, K] matrix as a [len(rows), KP] tile (rows with ok False and
    columns >= K read as 0 and cost no memory traffic); weights stream once: evict_first."""
    ptrs = base + rows.to(tl.int64)[:, None] * K + offs[None, :]
    if KP == K:
        m = ok[:, None]
    else:
        m = ok[:, None] & (offs < K)[None, :]
    return tl.load(ptrs, mask=m, other=0.0, eviction_policy="evict_first")


# ------------------------------------------------------------------------------------------
# host: the persistent grid must be co-resident
# ------------------------------------------------------------------------------------------

def programs_per_sm(compiled, num_warps, device):
    """How many programs of a compiled kernel (JITFunction.warmup's result) one SM holds at once,
    from its registers, threads and shared memory: dict(regs, spills, shared,
    programs_per_sm_max). A persistent grid larger than SMs x that would deadlock."""
    compiled._init_handles()
    regs, spills = int(compiled.n_regs), int(compiled.n_spills)
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    props = torch.cuda.get_device_properties(device)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    thr_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    per_warp = cdiv(max(regs, 1) * 32, 256) * 256
    by_regs = (regs_sm // per_warp) // num_warps
    by_thr = thr_sm // (32 * num_warps)
    by_smem = smem_sm // (shared + 1024) if shared else 32
    return dict(regs=regs, spills=spills, shared=shared,
                programs_per_sm_max=min(by_regs, by_thr, by_smem, 32))


def check_co_resident(warmup, num_warps, device, ppsm, info):
    """Compile a persistent kernel without launching it (warmup() returns the compiled kernel)
    and check that `ppsm` programs fit on an SM at once: `info` updated with programs_per_sm's
    dict and returned; raises if they do not fit. Where it cannot be compiled here, info gets
    a warning and the spin timeout stays the only guard."""
    try:
        occ = programs_per_sm(warmup(), num_warps, device)
    except Exception as e:               # fall back on the spin timeout alone
        info["warning"] = f"occupancy not checked ({type(e).__name__}: {e})"[:300]
        return info
    info.update(occ)
    if occ["programs_per_sm_max"] < ppsm:
        raise RuntimeError(f"grid not co-resident: {ppsm} programs/SM asked, "
                           f"{occ['programs_per_sm_max']} fit (regs {occ['regs']}, shared "
                           f"{occ['shared']} B, {num_warps} warps)")
    return info
