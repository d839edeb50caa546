"""The eager decode step's launch recording (engine/launch_replay.py): on the CPU against a
stand-in launcher class with Triton's launcher call layout, and against the Triton interpreter
(which launches through no launcher, so nothing may be recorded). The recording on the GPU, in
the engine, is tested in tests/engine/test_triton_backend.py (marked gpu)."""
import pytest
import torch

from tritonchat.engine import launch_replay

CUDA_DEV = torch.device("cuda")     # only its type is read: record() touches no GPU itself


class FakeLauncher:
    """Triton's launcher call layout: grid x, y, z, stream, function, packed metadata, launch
    metadata, enter hook, exit hook, then the kernel's arguments."""
    log: list = []

    def __init__(self, name):
        self.name = name

    def __call__(self, *a):          # (a Triton of another layout would take other arguments)
        FakeLauncher.log.append((self.name, a[:3], a[3], a[9:]))


class DriverLauncher(FakeLauncher):
    """Triton 3.6+'s launcher shape: after its own work (scratch buffers) it calls the
    driver's launch, an attribute of the instance, with everything the kernel needs."""

    def __init__(self, name, global_scratch_size=0):
        super().__init__(name)
        self.global_scratch_size = global_scratch_size
        self.profile_scratch_size = 0
        self.launch = self._driver_launch
        self.calls = 0

    def _driver_launch(self, *a):
        FakeLauncher.log.append((self.name, a[:3], a[3], a[5:]))

    def __call__(self, *a):
        self.calls += 1
        scratch = object() if self.global_scratch_size else None      # a fresh buffer a launch
        self.launch(*a[:4], a[4], scratch, *a[9:])


@pytest.fixture
def fake(monkeypatch):
    FakeLauncher.log = []
    original = FakeLauncher.__call__
    monkeypatch.setattr(launch_replay, "_launcher_class", lambda: FakeLauncher)
    yield FakeLauncher
    assert FakeLauncher.__call__ is original, "record() left the launcher class patched"


def _launch(launcher, *kernel_args, stream=7, grid=(4, 1, 1), hooks=(None, None, None)):
    launcher(*grid, stream, "fn", "meta", *hooks, *kernel_args)


def test_records_the_step_and_replays_its_launches_in_order(fake):
    a, b = FakeLauncher("gemv"), FakeLauncher("attention")
    x = torch.arange(4.0)

    def step():
        _launch(a, x, 3, 1e-6)
        _launch(b, x[1:], grid=(2, 3, 1))          # a view is fine
        _launch(a, x, 5, 1e-6)

    rec, why = launch_replay.record(step, CUDA_DEV)
    assert rec is not None and why == "" and len(rec) == 3 and rec.stream == 7
    ran = list(fake.log)
    assert [e[0] for e in ran] == ["gemv", "attention", "gemv"]     # the step ran for real
    rec.replay()
    rec.replay()
    assert fake.log[3:6] == ran and fake.log[6:] == ran
    assert fake.log[4][3][0].data_ptr() == x[1:].data_ptr()


def test_a_launcher_without_scratch_is_replayed_through_the_driver_launch(fake, monkeypatch):
    """Where the launcher calls the driver's launch and needs no scratch, the replay calls the
    driver's launch with the arguments it got; a launcher that needs scratch (a new buffer a
    launch) is called whole."""
    monkeypatch.setattr(launch_replay, "_launcher_class", lambda: DriverLauncher)
    original = DriverLauncher.__call__
    plain, scratch = DriverLauncher("plain"), DriverLauncher("scratch", global_scratch_size=64)
    x = torch.arange(3.0)

    def step():
        _launch(plain, x, 1)
        _launch(scratch, x, 2)

    rec, why = launch_replay.record(step, CUDA_DEV)
    assert rec is not None and len(rec) == 2 and rec.direct == 1
    assert plain.launch == plain._driver_launch                  # put back after recording
    ran = list(fake.log)
    rec.replay()
    assert plain.calls == 1 and scratch.calls == 2               # only the scratch one re-entered
    assert fake.log[2][0] == "plain" and fake.log[2][1:3] == ran[0][1:3]
    assert fake.log[2][3][1:] == ran[0][3][1:] and fake.log[3][0] == "scratch"
    assert fake.log[3][3][0] is not ran[1][3][0]                 # its scratch made afresh
    assert DriverLauncher.__call__ is original


def test_another_threads_launch_meanwhile_is_not_recorded(fake):
    import threading
    a, b = FakeLauncher("step"), FakeLauncher("other thread")

    def step():
        _launch(a, 1)
        t = threading.Thread(target=lambda: _launch(b, 2))
        t.start()
        t.join()
        _launch(a, 3)

    rec, why = launch_replay.record(step, CUDA_DEV)
    assert rec is not None and len(rec) == 2
    assert [e[0] for e in fake.log] == ["step", "other thread", "step"]   # all of them ran
    rec.replay()
    assert [e[0] for e in fake.log[3:]] == ["step", "step"]


def test_a_pytorch_operator_in_the_step_refuses(fake):
    a, x = FakeLauncher("gemv"), torch.zeros(4)

    def step():
        _launch(a, x)
        x.add_(1)                                   # would be missing from the replay

    rec, why = launch_replay.record(step, CUDA_DEV)
    assert rec is None and "aten.add_" in why
    assert x.tolist() == [1.0] * 4                  # the step still ran once


class Chain:
    """Triton 3.4+'s HookChain: a list of calls, empty when no hook is set."""

    def __init__(self, *calls):
        self.calls = list(calls)


def test_empty_hook_chains_and_launch_metadata_are_recorded(fake):
    a = FakeLauncher("k")
    rec, why = launch_replay.record(lambda: _launch(a, 1, hooks=({"name": "k"}, Chain(), Chain())),
                                    CUDA_DEV)
    assert rec is not None and why == "" and len(rec) == 1


@pytest.mark.parametrize("case", ["no_launch", "hook", "hook_chain", "two_streams", "short_call"])
def test_what_cannot_be_replayed_is_refused(fake, case):
    a = FakeLauncher("k")

    def step():
        if case == "hook":
            _launch(a, 1, hooks=({"name": "k"}, print, None))
        elif case == "hook_chain":
            _launch(a, 1, hooks=({"name": "k"}, Chain(), Chain(print)))
        elif case == "two_streams":
            _launch(a, 1, stream=7)
            _launch(a, 1, stream=8)
        elif case == "short_call":
            a(1, 1, 1, 7)
    rec, why = launch_replay.record(step, CUDA_DEV)
    assert rec is None and why
    assert {"no_launch": "no Triton launch", "hook": "hook", "hook_chain": "hook",
            "two_streams": "more than one stream",
            "short_call": "other arguments"}[case] in why


def test_the_launcher_is_restored_when_the_step_raises(fake):
    def step():
        _launch(FakeLauncher("k"), 1)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        launch_replay.record(step, CUDA_DEV)


def test_cpu_device_is_refused_and_the_step_still_runs_once():
    ran = []
    rec, why = launch_replay.record(lambda: ran.append(1), torch.device("cpu"))
    assert rec is None and "CUDA" in why and ran == [1]


def test_a_triton_without_a_launcher_class_is_refused_and_the_step_still_runs_once(monkeypatch):
    def none():
        raise AttributeError("launcher_cls")
    monkeypatch.setattr(launch_replay, "_launcher_class", none)
    ran = []
    rec, why = launch_replay.record(lambda: ran.append(1), CUDA_DEV)
    assert rec is None and "no launcher" in why and ran == [1]


def test_the_triton_interpreter_launches_through_no_launcher():
    """Under TRITON_INTERPRET (CI) a real kernel runs once, but nothing reaches a launcher
    (where no GPU driver is active there is no launcher class at all), so the engine keeps
    launching through Triton."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter's case")
    from tritonchat.kernels.embedding import embedding_gather
    table = torch.arange(12.0).view(4, 3)
    out = torch.zeros(1, 3)
    ids = torch.tensor([2])
    rec, why = launch_replay.record(lambda: embedding_gather(ids, table, out), CUDA_DEV)
    assert rec is None and ("no Triton launch" in why or "no launcher" in why)
    assert out.tolist() == [[6.0, 7.0, 8.0]]
