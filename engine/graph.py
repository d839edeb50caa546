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
import sys
from contextlib import contextmanager
from typing import Optional

import torch


class GraphCaptureFailed(RuntimeError):
    pass


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


def capture(backend) -> "torch.cuda.CUDAGraph":
    """Warm up (Triton JIT, no autotuning inside capture), then capture one decode step.
    The warm-up runs on a copy of the mutable state, so capturing changes nothing."""
    saved = _save_mutable(backend)
    stream = torch.cuda.Stream(device=backend.device)
    stream.wait_stream(torch.cuda.current_stream(backend.device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            backend._decode_step()             # JIT compile every kernel before capture
    torch.cuda.current_stream(backend.device).wait_stream(stream)
    _load_mutable(backend, saved)
    if backend._timer_active is not None:
        backend._timer_active.events.clear()   # keep only the events recorded into the graph
    g, window = _graph_for_window(backend)
    with no_collection(), torch.cuda.graph(g, stream=stream):
        backend._decode_step()
    # capture records the kernels without running them, but restore anyway for safety
    _load_mutable(backend, saved)
    if window is not None:
        # the GDN states persisting in L2 for every kernel of the step (engine/l2_state.py);
        # without it the graph is the same, only slower
        from .l2_state import L2StateError, set_graph_window
        try:
            backend.l2_state_nodes = set_graph_window(g.raw_cuda_graph(), *window)
        except L2StateError as e:
            backend.l2_state_failed(str(e))
        g.instantiate()
    return g


def _graph_for_window(backend) -> tuple["torch.cuda.CUDAGraph", Optional[tuple]]:
    """(the graph to capture into, the GDN states' L2 window to put on it or None). The window
    needs a graph that stays editable until instantiate() (torch's keep_graph, 2.7+); where
    torch has none the engine says so once and gives the set-aside L2 back."""
    backend.l2_state_nodes = 0
    window = backend.l2_state_window()
    if window is not None:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True), window
        except TypeError:
            backend.l2_state_failed("this PyTorch cannot edit a captured CUDA graph "
                                    "(keep_graph needs PyTorch 2.7 or later)")
            backend.l2_state_window()          # now refused: returns the set-aside L2
    return torch.cuda.CUDAGraph(), None


def _save_mutable(backend):
    st = backend.state
    return {
        "conv": {i: t.clone() for i, t in st.conv.items()},
        "rec": {i: t.clone() for i, t in st.rec.items()},
        "tok": backend.tok_buf.clone(), "pos": backend.pos_buf.clone(), "h": backend.h.clone(),
        "counts": backend.counts.clone(), "rng": backend.rng_state.clone(),
    }


def _load_mutable(backend, saved) -> None:
    st = backend.state
    for i, t in saved["conv"].items():
        st.conv[i].copy_(t)
    for i, t in saved["rec"].items():
        st.rec[i].copy_(t)
    backend.tok_buf.copy_(saved["tok"])
    backend.pos_buf.copy_(saved["pos"])
    backend.h.copy_(saved["h"])
    backend.counts.copy_(saved["counts"])
    backend.rng_state.copy_(saved["rng"])


def capture_ranges(backend, capture_one=None) -> list:
    """One captured decode step per context range of the backend (its plans differ by the
    position: TritonBackend._ranges), all at once, so that no graph is captured as the position
    advances: [capture_one(backend)] per range (default: capture). The current range is kept."""
    capture_one = capture_one or capture
    keep = backend._range
    graphs = []
    try:
        for i in range(len(backend._ranges)):
            backend._use_range(i)
            graphs.append(capture_one(backend))
    finally:
        backend._use_range(keep)
    return graphs


def replay_or_capture(backend) -> None:
    """Run one decode step through the CUDA graph of the backend's context range, capturing
    the graphs first if needed."""
    if backend._graphs is None:
        try:
            backend._graphs = capture_ranges(backend)
        except Exception as e:  # driver/memory trouble: say it once, decode eagerly from now on
            backend.options.graph = False
            backend._graphs = backend._graph = None
            backend.graph_error = f"CUDA Graph capture failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); decoding without it."
            print(f"tritonchat: {backend.graph_error}", file=sys.stderr)
            backend._decode_step()
            return
    backend._graph = backend._graphs[backend._range]
    backend._graph.replay()
