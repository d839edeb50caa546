"""Keep the GDN recurrent states in the GPU's L2 cache from one decode step to the next.

Every decode step reads and writes the 18 GDN layers' fp32 recurrent states (18 x 16 x 128 x 128,
18 MiB) while ~1.5 GB of weights stream through the same L2, which evicts the states before the
next step: 38 MB a step of HBM traffic that is only the same bytes coming back. The CUDA driver
can set part of L2 aside for "persisting" lines (a context limit) and mark an address range as
persisting for the kernels of a graph (an access policy window on each kernel node), so the
streaming weights can no longer evict it. The states live in one buffer (ModelState.rec_buf);
engine/graph.py puts the window on every kernel node of the captured decode step.

Measured on the H200 (docs/performance.md, "GDN states in a persisting L2 window"): the step ~1% faster at position 640 and
~1.4% at 32,704, tokens unchanged, with the set-aside a little larger than the window; a
set-aside of exactly the window's size gained nothing, and the driver's whole 37.5 MiB, or a
window over half the range, was slower than none.

The driver API is reached through ctypes (libcuda ships with every NVIDIA driver; no extra
package). Every failure raises L2StateError with one sentence; the engine then captures the
graph without the window and says so once.
"""
from __future__ import annotations

import ctypes
import sys
from typing import Optional

_CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
_CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108
_CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE = 109
_CU_GRAPH_NODE_TYPE_KERNEL = 0
_CU_KERNEL_NODE_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
_CU_ACCESS_PROPERTY_STREAMING = 1
_CU_ACCESS_PROPERTY_PERSISTING = 2
_ATTR_VALUE_BYTES = 64          # CUkernelNodeAttrValue is a union padded to 64 bytes
SLACK_BYTES = 2 << 20          # set aside this much L2 beyond the window (see TritonBackend)


class L2StateError(RuntimeError):
    """The persisting-L2 window could not be set up (the message is one sentence)."""


class _Window(ctypes.Structure):
    """CUaccessPolicyWindow."""
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t),
                ("hitRatio", ctypes.c_float), ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


_lib = None


def _driver():
    global _lib
    if _lib is None:
        name = "nvcuda.dll" if sys.platform.startswith("win") else "libcuda.so.1"
        try:
            _lib = ctypes.CDLL(name)
        except OSError as e:
            raise L2StateError(f"The CUDA driver library ({name}) could not be loaded: {e}.") from None
    return _lib


def _call(fn: str, *args) -> None:
    lib = _driver()
    try:
        f = getattr(lib, fn)
    except AttributeError:
        raise L2StateError(f"This CUDA driver has no {fn}.") from None
    res = f(*args)
    if res != 0:
        raise L2StateError(f"{fn} failed (CUresult {res}).")


def device_limits(device_index: int) -> tuple[int, int]:
    """(the most bytes L2 can set aside for persisting lines, the largest access policy window)
    of CUDA device `device_index` (0, 0 where the GPU has no persisting L2)."""
    dev = ctypes.c_int()
    _call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(int(device_index)))
    out = []
    for attr in (_CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE,
                 _CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE):
        v = ctypes.c_int()
        _call("cuDeviceGetAttribute", ctypes.byref(v), ctypes.c_int(attr), dev)
        out.append(max(0, v.value))
    return out[0], out[1]


def set_persisting_limit(nbytes: int) -> None:
    """Set aside `nbytes` of L2 for persisting lines in the current CUDA context (0: none; the
    lines already persisting are returned to normal first)."""
    if nbytes <= 0:
        _call("cuCtxResetPersistingL2Cache")
    _call("cuCtxSetLimit", ctypes.c_int(_CU_LIMIT_PERSISTING_L2_CACHE_SIZE),
          ctypes.c_size_t(max(0, int(nbytes))))


def _kernel_nodes(raw_graph: int) -> list:
    g = ctypes.c_void_p(int(raw_graph))
    n = ctypes.c_size_t(0)
    _call("cuGraphGetNodes", g, None, ctypes.byref(n))
    nodes = (ctypes.c_void_p * n.value)()
    _call("cuGraphGetNodes", g, nodes, ctypes.byref(n))
    out = []
    for node in nodes[:n.value]:
        t = ctypes.c_int()
        _call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(t))
        if t.value == _CU_GRAPH_NODE_TYPE_KERNEL:
            out.append(node)
    return out


def set_graph_window(raw_graph: int, base_ptr: int, nbytes: int, hit_ratio: float = 1.0) -> int:
    """Mark [base_ptr, base_ptr + nbytes) persisting (hit_ratio of it; misses streaming) for
    every kernel node of the (not yet instantiated) CUDA graph `raw_graph`. Returns the number
    of kernel nodes."""
    val = (ctypes.c_ubyte * _ATTR_VALUE_BYTES)()
    w = _Window.from_buffer(val)
    w.base_ptr, w.num_bytes, w.hitRatio = int(base_ptr), int(nbytes), float(hit_ratio)
    w.hitProp, w.missProp = _CU_ACCESS_PROPERTY_PERSISTING, _CU_ACCESS_PROPERTY_STREAMING
    nodes = _kernel_nodes(raw_graph)
    for node in nodes:
        _call("cuGraphKernelNodeSetAttribute", ctypes.c_void_p(node),
              ctypes.c_int(_CU_KERNEL_NODE_ATTRIBUTE_ACCESS_POLICY_WINDOW), val)
    return len(nodes)


def graph_windows(raw_graph: int) -> list[Optional[tuple[int, int, float, int]]]:
    """(base_ptr, num_bytes, hitRatio, hitProp) of each kernel node's access policy window
    (None where a node has none); for tests."""
    out = []
    for node in _kernel_nodes(raw_graph):
        val = (ctypes.c_ubyte * _ATTR_VALUE_BYTES)()
        _call("cuGraphKernelNodeGetAttribute", ctypes.c_void_p(node),
              ctypes.c_int(_CU_KERNEL_NODE_ATTRIBUTE_ACCESS_POLICY_WINDOW), val)
        w = _Window.from_buffer(val)
        out.append((int(w.base_ptr or 0), int(w.num_bytes), float(w.hitRatio), int(w.hitProp))
                   if w.num_bytes else None)
    return out
