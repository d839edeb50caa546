"""describe_exception's sentences, the modal error box and the error banner."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QMessageBox, QWidget

from tritonchat.app.errors import (NO_CC_SENTENCE, NO_GPU_SENTENCE, OOM_SENTENCE, ErrorBanner,
                                   build_error_box, describe_exception, show_error)
from tritonchat.engine.errors import BackendUnavailableError, ModelFilesError


def raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    """``exc`` with a real traceback (and optional cause), as the GUI receives it."""
    try:
        if cause is not None:
            raise exc from cause
        raise exc
    except BaseException as caught:   # noqa: BLE001 - the point is to catch anything
        return caught


class OutOfMemoryError(RuntimeError):
    """Stands in for torch.cuda.OutOfMemoryError, which is recognised by name (no torch import)."""


class SafetensorError(Exception):
    pass


def test_tritonchat_error_passes_sentence_and_details():
    exc = raised(ModelFilesError("The model folder has no config.json.", details="looked in /x"))
    sentence, details = describe_exception(exc)
    assert sentence == "The model folder has no config.json."
    assert details.startswith("looked in /x")
    assert "Traceback" in details and "ModelFilesError" in details
    # Not raised (no traceback): just its own details.
    assert describe_exception(BackendUnavailableError("No GPU.", "nvidia-smi failed")) == (
        "No GPU.", "nvidia-smi failed")


def test_tritonchat_error_found_inside_a_wrapper():
    inner = BackendUnavailableError("Triton is not installed.")
    exc = raised(RuntimeError("worker crashed"), cause=inner)
    assert describe_exception(exc)[0] == "Triton is not installed."


@pytest.mark.parametrize("exc", [
    OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 139 GiB total)"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
])
def test_gpu_out_of_memory(exc):
    sentence, details = describe_exception(raised(exc))
    assert sentence == OOM_SENTENCE
    assert "Traceback" in details and str(exc).splitlines()[0] in details


def test_oom_in_the_chain_is_found():
    exc = raised(ValueError("generation failed"), cause=raised(RuntimeError("CUDA out of memory.")))
    assert describe_exception(exc)[0] == OOM_SENTENCE


def test_no_c_compiler():
    exc = RuntimeError("Failed to find C compiler. Please specify via CC environment variable or "
                       "set triton.knobs.build.impl.")
    assert describe_exception(raised(exc))[0] == NO_CC_SENTENCE
    gone = FileNotFoundError(2, "No such file or directory", "/usr/bin/gcc-13")
    assert describe_exception(raised(gone))[0] == NO_CC_SENTENCE


def test_missing_python_headers_from_message():
    exc = RuntimeError("main.c:1:10: fatal error: Python.h: No such file or directory")
    sentence = describe_exception(raised(exc))[0]
    assert "python3-dev" in sentence or f"python{sys.version_info.major}." in sentence
    assert "Python.h" in sentence


def test_compile_failure_detected_from_the_command(tmp_path: Path):
    # Triton runs `cc main.c -O3 -shared ... -I<python include>`; its stderr is not in the error.
    no_headers = tmp_path / "include-without-python-h"
    no_headers.mkdir()
    cmd = ["/usr/bin/gcc", "main.c", "-O3", "-shared", "-fPIC", "-o", "x.so", f"-I{no_headers}"]
    sentence = describe_exception(raised(subprocess.CalledProcessError(1, cmd)))[0]
    assert f"python{sys.version_info.major}.{sys.version_info.minor}-dev" in sentence
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "Python.h").write_text("/* here */")
    cmd[-1] = f"-I{tmp_path / 'inc'}"
    sentence = describe_exception(raised(subprocess.CalledProcessError(1, cmd)))[0]
    assert "could not compile" in sentence and "gcc" in sentence
    # Some other program failing is not a compile failure.
    other = subprocess.CalledProcessError(2, ["nvidia-smi", "-L"])
    assert describe_exception(raised(other))[0].startswith(
        "Something went wrong: CalledProcessError")


def test_missing_model_file_and_other_files():
    exc = FileNotFoundError(2, "No such file or directory",
                            "/m/model.safetensors-00001-of-00001.safetensors")
    sentence = describe_exception(raised(exc))[0]
    assert "model.safetensors-00001-of-00001.safetensors" in sentence
    assert "--model" in sentence and "download" in sentence
    for name in ("config.json", "tokenizer.json", "chat_template.jinja", "tokenizer_config.json"):
        exc = FileNotFoundError(2, "No such file or directory", f"/m/{name}")
        assert f"model file {name} is missing" in describe_exception(raised(exc))[0]
    other = FileNotFoundError(2, "No such file or directory", "/home/u/notes.txt")
    assert describe_exception(raised(other))[0] == \
        "A file tritonchat needs was not found: /home/u/notes.txt."


def test_corrupt_weights_and_no_gpu():
    bad = SafetensorError("Error while deserializing header: HeaderTooLarge")
    assert "corrupt" in describe_exception(raised(bad))[0]
    assert describe_exception(raised(AssertionError("Torch not compiled with CUDA enabled")))[0] \
        == NO_GPU_SENTENCE
    assert describe_exception(raised(RuntimeError("No CUDA GPUs are available")))[0] \
        == NO_GPU_SENTENCE


def test_anything_else_names_type_and_first_line():
    exc = raised(KeyError("layers.3.mlp"))
    sentence, details = describe_exception(exc)
    assert sentence == "Something went wrong: KeyError: 'layers.3.mlp'"
    assert details.startswith("Traceback (most recent call last):")
    multi = raised(ValueError("\n  first real line\nsecond line"))
    assert describe_exception(multi)[0] == "Something went wrong: ValueError: first real line"
    assert describe_exception(raised(ZeroDivisionError()))[0] == \
        "Something went wrong: ZeroDivisionError"


def test_errors_module_does_not_import_torch():
    code = ("import sys; import tritonchat.app.errors; "
            "assert 'torch' not in sys.modules and 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})


def test_error_box_contents(qtbot):
    parent = QWidget()
    qtbot.addWidget(parent)
    box = build_error_box(parent, "The GPU ran out of memory.", "Traceback: ...", title="Oops")
    assert box.text() == "The GPU ran out of memory."
    assert box.detailedText().startswith("What failed: The GPU ran out of memory.\n\nWhat to do: ")
    assert box.icon() == QMessageBox.Icon.Warning
    assert box.windowTitle() == "Oops"
    assert box.parent() is parent
    assert build_error_box(None, "Plain.").detailedText() == ""


def test_show_error_is_modal_and_returns_when_closed(qtbot):
    seen = {}

    def close_it():
        box = QApplication.activeModalWidget()
        seen["box"] = (type(box).__name__, box.text(), box.detailedText())
        box.accept()

    QTimer.singleShot(50, close_it)
    show_error(None, "Something went wrong: KeyError: 'x'", "the traceback")
    assert seen["box"][:2] == ("QMessageBox", "Something went wrong: KeyError: 'x'")
    assert "the traceback" in seen["box"][2]


def test_details_say_what_failed_and_what_to_do_and_the_traceback_goes_to_the_log(qtbot, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setenv("TRITONCHAT_LOG_DIR", str(tmp_path / "logs"))
    exc = raised(ModelFilesError("The model file model.safetensors is missing: download the model "
                                 "again.", details="looked in /m"))
    sentence, details = describe_exception(exc)
    box = build_error_box(None, sentence, details)
    log = tmp_path / "logs" / "tritonchat.log"
    shown = box.detailedText()
    assert shown.startswith("What failed: tritonchat.engine.errors.ModelFilesError: The model file")
    assert "What to do: Download the model again." in shown and "looked in /m" in shown
    assert "Traceback" not in shown and str(log) in shown and str(log) in box.informativeText()
    text = log.read_text()
    assert "Traceback (most recent call last):" in text and "ModelFilesError" in text


def test_error_banner(qtbot):
    window = QWidget()
    qtbot.addWidget(window)
    banner = ErrorBanner(window)
    window.show()
    assert not banner.isVisible()
    banner.show_message("The GPU ran out of memory.", tooltip="details here")
    assert banner.isVisible()
    assert banner.text() == "The GPU ran out of memory."
    assert banner.toolTip() == "details here"
    banner.clear()
    assert not banner.isVisible() and banner.text() == ""
    banner.show_message("Second problem <b>not html</b>")
    assert banner.label.text() == "Second problem <b>not html</b>"
    with qtbot.waitSignal(banner.dismissed, timeout=1000):
        banner.dismiss_button.click()
    assert not banner.isVisible()


def test_real_torch_oom_class():
    torch = pytest.importorskip("torch")
    exc = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    assert describe_exception(raised(exc))[0] == OOM_SENTENCE
