"""The wheel builds from the repo and carries every package and data file the app needs."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_contents(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(tmp_path.glob("tritonchat-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("tritonchat/engine/cli.py", "tritonchat/engine/reference.py", "tritonchat/kernels/gemv.py",
                     "tritonchat/kernels/decode_tuning.json", "tritonchat/kernels/prefill_tuning.json", "tritonchat/app/main.py",
                     "tritonchat/resources/tritonchat.svg", "tritonchat/resources/tritonchat.desktop",
                     "tritonchat/resources/icons/tritonchat-256.png"):
        assert required in names, required
    assert not any(n.startswith(("kernels/", "engine/", "app/")) for n in names)   # no bare top-level packages
    meta = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tritonchat = tritonchat.app.launcher:main" in zipfile.ZipFile(wheel).read(meta).decode()


def test_device_qt_bundle_lists_what_the_app_needs():
    """packaging/device_qt_bundle.py (the app's Qt side for the GPU machine without PySide6):
    the Qt modules, libraries and plugins the app and pytest-qt load, the pure-Python GUI deps,
    and no C runtime of this machine."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("device_qt_bundle",
                                                  ROOT / "packaging" / "device_qt_bundle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    arcs = [arc for _, arc in mod.collect()]
    names = set(arcs)
    for m in ("QtCore", "QtGui", "QtWidgets", "QtSvg", "QtTest"):
        assert any(a.startswith(f"site/PySide6/{m}.") and a.endswith(".so") for a in arcs), m
    assert "site/PySide6/__init__.py" in names and "site/shiboken6/__init__.py" in names
    assert "site/PySide6/Qt/plugins/platforms/libqoffscreen.so" in names
    assert any(a.startswith("site/PySide6/Qt/lib/libQt6Widgets.so") for a in arcs)
    for pkg in ("pyqtgraph", "colorama", "platformdirs"):
        assert f"site/{pkg}/__init__.py" in names, pkg
    libs = [a.split("/")[-1] for a in arcs if a.startswith("lib/")]
    assert not any(n.startswith(("libc.so", "libstdc++", "ld-linux", "libm.so")) for n in libs)
    assert not any("__pycache__" in a or "/include/" in a for a in arcs)


def test_repo_kernels_folder_does_not_shadow_an_installed_kernels_package(tmp_path):
    """Hugging Face's `kernels` (transformers imports it whenever its distribution is installed)
    must win over the repo's kernels/ folder even with the repo root first on sys.path, as under
    `python -m pytest`: a regular package there would be imported instead and break transformers."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("WHO = 'installed'\n")
    # the repo root first, then an installed `kernels` (ahead of site-packages, which may hold the real one)
    code = ("import sys; sys.path[:0] = sys.argv[1:3]; "
            "import kernels; print(getattr(kernels, 'WHO', kernels.__path__))")
    r = subprocess.run([sys.executable, "-c", code, str(ROOT), str(site)], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "installed"
