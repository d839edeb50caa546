"""Eager decode without the per-launch Python work: the Triton launches of one decode step,
recorded once and then replayed from the host, launch by launch.

With the CUDA graph off the host launches each of the step's ~123 kernels. Through our
wrappers (argument checks, plan lookups) and Triton's dispatch (binding and specialising the
arguments, the kernel-cache lookup) each launch cost the device's host ~47 us, so the eager step
took ~5.8 ms for ~0.6 ms of GPU work (docs/performance.md, "Launch cache"). Yet the
step's launches are the same at every step of a context range: the kernels read the token and
the position from device tensors, which is what lets one captured CUDA graph serve the range.
So the engine records them once, each launch's Triton launcher and the arguments Triton passed
it, and afterwards calls those launchers directly, in the same order, on the same stream (for
a kernel that needs no scratch memory, the launcher's own call into the driver, with the
arguments it passed, since the launcher does nothing else for it). That
is still one host launch per kernel (what the CUDA graph saves is measured against it), without
re-deriving every launch; it is valid exactly where the captured graph would be, and the engine
drops it wherever it drops the graphs.

The recording is refused (None and the reason), and the engine launches through Triton as
before, when the step ran anything but Triton launches and tensor views (a PyTorch kernel in it
would be missing from the replay), when a launch hook is set (a profiler's, which should see
every launch made afresh), or when nothing went through a launcher (the Triton interpreter).
"""
from __future__ import annotations

import functools
import threading
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the launcher's positional arguments: grid x, y, z, stream, function, packed metadata, launch
# metadata (what a hook reads: the kernel's name, function and stream, the same for the same
# launch), enter hook, exit hook, then the kernel's own (Triton 3.2 to 3.9 alike)
_STREAM, _FIRST_HOOK_ARG, _KERNEL_ARGS = 3, 6, 9


class _StepOps(TorchDispatchMode):
    """The PyTorch operators a step runs, other than views."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(func, "is_view", False):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class LaunchRecording:
    """One decode step's Triton launches, replayable from the host on the stream they were
    recorded on."""

    def __init__(self, launches: list, stream: int, direct: int):
        self._launches = launches           # [(callable, positional args)] in launch order
        self.stream = stream
        self.direct = direct                # how many of them call the driver's launch directly

    def __len__(self) -> int:
        return len(self._launches)

    def replay(self) -> None:
        for fn, args in self._launches:
            fn(*args)


def _hook_set(hook) -> bool:
    """A launch hook that does something: Triton up to 3.3 passes None for none, later ones a
    HookChain whose list of calls is empty."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return not (isinstance(calls, list) and not calls)


def _launcher_class():
    from triton.runtime import driver
    return driver.active.launcher_cls


def record(step: Callable[[], None], device: torch.device) -> tuple[Optional[LaunchRecording], str]:
    """Run `step` once (always, and for real: its kernels execute), recording its Triton
    launches where it can. Returns (the recording, "") or (None, why it cannot be replayed)."""
    if device.type != "cuda":
        step()
        return None, "launches are replayed on CUDA devices only"
    try:
        cls = _launcher_class()
        call = cls.__call__
    except Exception as e:  # a Triton without a launcher class: launch through it as before
        step()
        return None, f"this Triton has no launcher to call ({type(e).__name__})"
    launches: list = []     # (launcher, its arguments, the driver launch's arguments or None)
    owner = threading.get_ident()

    def recording_call(launcher, *args):
        if threading.get_ident() != owner:     # another thread's launch: not the step's
            return call(launcher, *args)
        # one level further down where that is plain: the launcher's own work before the
        # driver's launch (scratch buffers, sanitizer state) is nothing for a kernel that needs
        # no scratch, so the replay can call the driver's launch with the same arguments
        inner = getattr(launcher, "__dict__", {}).get("launch")
        if (inner is None or getattr(launcher, "global_scratch_size", 1) != 0
                or getattr(launcher, "profile_scratch_size", 0) != 0
                or getattr(launcher, "gsan_enabled", False)):
            launches.append((launcher, args, None))
            return call(launcher, *args)
        seen: list = []

        def spy(*launch_args):
            seen.append(launch_args)
            return inner(*launch_args)

        launcher.launch = spy
        try:
            return call(launcher, *args)
        finally:
            launcher.launch = inner
            launches.append((launcher, args, seen[0] if len(seen) == 1 else None))

    ops = _StepOps()
    cls.__call__ = recording_call
    try:
        with ops:
            step()
    finally:
        cls.__call__ = call
    if ops.ops:
        return None, f"the step runs PyTorch operators besides its Triton launches ({ops.ops[0]})"
    if not launches:
        return None, "no Triton launch went through a launcher"
    if any(len(a) < _KERNEL_ARGS for _, a, _ in launches):
        return None, "this Triton's launcher takes other arguments"
    if any(_hook_set(h) for _, a, _ in launches for h in a[_FIRST_HOOK_ARG + 1:_KERNEL_ARGS]):
        return None, "a Triton launch hook is set"
    streams = {a[_STREAM] for _, a, _ in launches}
    if len(streams) != 1:
        return None, "the step's launches went to more than one stream"
    replay = [(launcher.launch, driver_args) if driver_args is not None
              else (functools.partial(call, launcher), a) for launcher, a, driver_args in launches]
    direct = sum(driver_args is not None for _, _, driver_args in launches)
    return LaunchRecording(replay, streams.pop(), direct), ""
