"""CUDA Graph of one decode step: captured once after warm-up, replayed as the position advances.

The step reads its token id and position from device tensors (tok_buf, pos_buf) and writes the
next token into tok_buf and pos_buf + 1, so the same graph serves every position of its context
range until the context is full. Where the decode table has plans for short contexts the engine
keeps one graph per range of positions, all captured together, and replays the one of each
step's position (the host knows it). Switching split-K, the sampler mode or the context
invalidates them; the next step re-captures on the engine's thread. If capture fails, one
message and eager decode.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Callable, Optional, Sequence

import torch


@contextmanager
def no_collection():
    """No garbage collection inside a graph capture: a collection can free a dead engine's CUDA
    graphs and their memory pool, and those CUDA calls, made inside the capture, invalidate it
    ("operation failed due to a previous error during capture"; seen on the H200 when a test's
    backend from an earlier test was collected mid-capture). Collection resumes afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture(step, mutable: Sequence[torch.Tensor], l2=None) -> "torch.cuda.CUDAGraph":
    """Warm up (Triton JIT, no autotuning inside capture), then capture one call of `step` (a
    DecodeStep: engine/decode_step.py). The warm-up runs on copies of the `mutable` tensors (what
    a step writes: states, token, position, residual, sampler counters), so capturing changes
    nothing. `l2` (the backend: l2_state_window / l2_state_failed / l2_state_nodes) puts the
    GDN states' persisting-L2 window on the graph's kernels."""
    saved = [t.clone() for t in mutable]
    device = step.device
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()                             # JIT compile every kernel before capture
    torch.cuda.current_stream(device).wait_stream(stream)
    _restore(mutable, saved)
    if step.launch.timer is not None:
        step.launch.timer.events.clear()       # keep only the events recorded into the graph
    g, window = _graph_for_window(l2)
    with no_collection(), torch.cuda.graph(g, stream=stream):
        step()
    # capture records the kernels without running them, but restore anyway for safety
    _restore(mutable, saved)
    if window is not None:
        # the GDN states persisting in L2 for every kernel of the step (engine/l2_state.py);
        # without it the graph is the same, only slower
        from .l2_state import L2StateError, set_graph_window
        try:
            l2.l2_state_nodes = set_graph_window(g.raw_cuda_graph(), *window)
        except L2StateError as e:
            l2.l2_state_failed(str(e))
        g.instantiate()
    return g


def _graph_for_window(l2) -> tuple["torch.cuda.CUDAGraph", Optional[tuple]]:
    """(the graph to capture into, the GDN states' L2 window to put on it or None). The window
    needs a graph that stays editable until instantiate() (torch's keep_graph, 2.7+); where
    torch has none the engine says so once and gives the set-aside L2 back."""
    if l2 is None:
        return torch.cuda.CUDAGraph(), None
    l2.l2_state_nodes = 0
    window = l2.l2_state_window()
    if window is not None:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True), window
        except TypeError:
            l2.l2_state_failed("this PyTorch cannot edit a captured CUDA graph "
                               "(keep_graph needs PyTorch 2.7 or later)")
            l2.l2_state_window()               # now refused: returns the set-aside L2
    return torch.cuda.CUDAGraph(), None


def _restore(mutable: Sequence[torch.Tensor], saved: Sequence[torch.Tensor]) -> None:
    for t, s in zip(mutable, saved):
        t.copy_(s)


def capture_ranges(step, capture_one: Callable) -> list:
    """One captured step per context range of `step` (its plans differ by the position:
    DecodeStep.ranges), all at once, so that no graph is captured as the position advances:
    [capture_one()] per range, with that range in use. The range in use is kept."""
    keep = step.range_index
    graphs = []
    try:
        for i in range(len(step.ranges)):
            step.use_range(i)
            graphs.append(capture_one())
    finally:
        step.use_range(keep)
    return graphs
