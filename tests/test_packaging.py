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
    assert "tritonchat = tritonchat.engine.cli:main" in zipfile.ZipFile(wheel).read(meta).decode()
