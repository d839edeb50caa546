"""GPU only (a CUDA machine with PySide6, e.g. the device check with the Qt bundle): the main
window on the Triton backend as a user sees it: no CPU banner, an answer with the Triton flags
under it, the kernel panel filled from the GPU's timings, and split-K / CUDA Graph switched off
in the settings reaching the next answer, with its speed changing accordingly.
TRITONCHAT_SCREENSHOT_DIR, when set, receives a picture of the window with the panel open
(TRITONCHAT_FONT_DIR: fonts to register first, for a machine that has none)."""
import copy
import os

import pytest

from tests.app.test_main_window import send, stored


def _register_fonts() -> None:
    folder = os.environ.get("TRITONCHAT_FONT_DIR")
    if not folder or not os.path.isdir(folder):
        return
    from PySide6.QtGui import QFont, QFontDatabase
    from PySide6.QtWidgets import QApplication

    families = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".ttf"):
            i = QFontDatabase.addApplicationFont(os.path.join(folder, name))
            if i >= 0:
                families += QFontDatabase.applicationFontFamilies(i)
    if "DejaVu Sans" in families:
        QApplication.setFont(QFont("DejaVu Sans", 10))


@pytest.mark.gpu
def test_main_window_on_the_triton_backend(qtbot, make_window, recording_loader):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shots = os.environ.get("TRITONCHAT_SCREENSHOT_DIR")
    if shots:
        _register_fonts()
    w = make_window(max_new_tokens=96, context=1024, ignore_eos=True)
    session = recording_loader.sessions[-1]
    assert not w.banner.isVisible()
    assert "triton backend" in w.engine_label.text()
    w.resize(1400, 860)

    # the timing panel: opening it turns engine timing on
    w.timing.toggleViewAction().trigger()
    qtbot.waitUntil(lambda: ("configure", {"timing": True}) in session.calls, timeout=20000)
    assert w.timing.table.isVisibleTo(w) and not w.timing.note.isVisibleTo(w)

    on = send(qtbot, w, "Hello from the GPU", timeout=120000)
    msg = stored(w)[-1]
    assert msg.stats == on
    assert on["backend"] == "triton" and on["split_k"] is True and on["graph"] is True
    assert on["l2_state"] is True and session.inner.backend.l2_state_nodes > 0
    assert on["new_tokens"] == 96 and on["decode_tok_s"] > 0
    line = w.chat.messages[-1].stats_label.text()
    assert "triton" in line and "split-K on" in line and "graph on" in line and "L2 states on" in line
    # the kernel panel holds the GPU's per-kernel timings
    qtbot.waitUntil(lambda: w.timing.table.rowCount() > 0, timeout=20000)
    names = [w.timing.table.item(r, 0).text() for r in range(w.timing.table.rowCount())]
    assert any("gemv" in n for n in names) and any("lm_head" in n for n in names)
    assert w.timing.xs and all(y > 0 for y in w.timing.ys)
    # under the table: the kernels' sum (each timed alone) against the loop's time per token
    assert w.timing.kernel_sum.isVisibleTo(w)
    assert "timed alone" in w.timing.kernel_sum.text() and "decode loop" in w.timing.kernel_sum.text()
    # the bar chart grows a row per kernel, all of it inside the panel
    bars, split = w.timing.bars, w.timing.split
    qtbot.waitUntil(lambda: bars.height() >= bars.minimumHeight() > 120, timeout=5000)
    qtbot.waitUntil(lambda: bars.geometry().bottom() < split.height(), timeout=5000)
    if shots:
        w.grab().save(os.path.join(shots, "gpu_window.png"))

    # the GDN states' L2 window off: re-captured without it, the answer says so
    s = copy.deepcopy(w.settings)
    s.engine["l2_state"] = False
    w.apply_settings(s)
    qtbot.waitUntil(lambda: ("configure", {"l2_state": False}) in session.calls, timeout=20000)
    no_l2 = send(qtbot, w, "Again without the states in L2", timeout=120000)
    assert no_l2["l2_state"] is False and no_l2["graph"] is True
    assert session.inner.backend.l2_state_nodes == 0
    assert "L2 states off" in w.chat.messages[-1].stats_label.text()

    # split-K and the graph off: the next answer runs without them, and slower (eager launches)
    s = copy.deepcopy(w.settings)
    s.engine.update(split_k=False, graph=False)
    w.apply_settings(s)
    qtbot.waitUntil(lambda: ("configure", {"split_k": False, "graph": False}) in session.calls, timeout=20000)
    off = send(qtbot, w, "And once more without the graph", timeout=120000)
    assert off["split_k"] is False and off["graph"] is False
    assert off["decode_tok_s"] < on["decode_tok_s"]
    line = w.chat.messages[-1].stats_label.text()
    assert "split-K off" in line and "graph off" in line and "launch cache on" in line
    assert off["launch_cache"] is True and session.inner.backend.launch_replay_active

    # and the launch cache off too: every launch through Triton's dispatch, slower again
    s = copy.deepcopy(w.settings)
    s.engine["launch_cache"] = False
    w.apply_settings(s)
    qtbot.waitUntil(lambda: ("configure", {"launch_cache": False}) in session.calls, timeout=20000)
    dispatch = send(qtbot, w, "And without the launch cache", timeout=120000)
    assert dispatch["launch_cache"] is False and not session.inner.backend.launch_replay_active
    assert dispatch["decode_tok_s"] < off["decode_tok_s"]
    assert "launch cache off" in w.chat.messages[-1].stats_label.text()


@pytest.mark.gpu
def test_persistent_decode_mode_from_the_settings(qtbot, make_window, recording_loader):
    """issue #59: the persistent step chosen in the settings decodes the next answer (greedy:
    the per-operator answer's tokens) and the stats line says so; where this GPU cannot hold
    its grid, the banner says why and the answer runs per operator."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    w = make_window(max_new_tokens=64, context=1024, ignore_eos=True, seed="3")
    session = recording_loader.sessions[-1]
    greedy = copy.deepcopy(w.settings)
    greedy.sampling.temperature = 0.0
    greedy.sampling.greedy = True
    w.apply_settings(greedy)
    per_op = send(qtbot, w, "Per operator first", timeout=120000)
    assert per_op["decode_mode"] == "per_op" and "decode per_op" in w.chat.messages[-1].stats_label.text()
    per_op_text = stored(w)[-1].content
    s = copy.deepcopy(greedy)
    s.engine_choices["decode_mode"] = "persistent"
    w.apply_settings(s)
    qtbot.waitUntil(lambda: ("configure", {"decode_mode": "persistent"}) in session.calls, timeout=20000)
    w.new_chat()
    persistent = send(qtbot, w, "Per operator first", timeout=120000)
    line = w.chat.messages[-1].stats_label.text()
    if session.inner.backend.decode_mode_error:
        assert persistent["decode_mode"] == "per_op" and "decode per_op" in line
        assert session.inner.backend.decode_mode_error in w.banner.text()
    else:
        assert persistent["decode_mode"] == "persistent" and "decode persistent" in line
        assert type(session.inner.backend.decode_step).__name__ == "PersistentStep"
        print(f"persistent {persistent['decode_tok_s']:.0f} tok/s, per_op {per_op['decode_tok_s']:.0f} tok/s, "
              f"same answer: {stored(w)[-1].content == per_op_text}")
