"""Host helpers the benchmark scripts share (no Triton kernels here, so a script may import this
before it chooses the interpreter):

    interpret_if_cpu  TRITON_INTERPRET=1 for --device cpu, before triton.jit decorates anything
    shim_checkout     tritonchat from this checkout through a symlink shim (the device runs
                      the repo without installing it)
    ptxas_regs        registers / spills a thread from `ptxas -v` on a kernel's PTX
"""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def interpret_if_cpu():
    """Choose the Triton interpreter when the command line asks for --device cpu: triton.jit
    reads TRITON_INTERPRET when it decorates a kernel, so call this before importing any."""
    if "--device" in sys.argv:
        i = sys.argv.index("--device")
        if i + 1 < len(sys.argv) and sys.argv[i + 1] == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")


def shim_checkout():
    """Make `import tritonchat` load this checkout: a package of symlinks to its folders, first
    on sys.path, and any tritonchat modules already imported dropped."""
    tag = hashlib.sha1(str(ROOT).encode()).hexdigest()[:10]
    pkg = Path(tempfile.gettempdir()) / f"tritonchat_shim_{tag}" / "tritonchat"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").touch()
    for d in ("engine", "kernels", "app", "resources"):
        link = pkg / d
        if link.is_symlink() and os.readlink(link) != str(ROOT / d):
            link.unlink()
        if not link.exists():
            os.symlink(ROOT / d, link)
    sys.path.insert(0, str(pkg.parent))
    for m in [m for m in sys.modules if m == "tritonchat" or m.startswith("tritonchat.")]:
        del sys.modules[m]


def ptxas_regs(ptx) -> dict:
    """Registers / spills per thread from `ptxas -v` on the PTX (sm_90a), if ptxas is around."""
    import re
    import subprocess
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        try:
            p = get_ptxas(90)
        except TypeError:
            p = get_ptxas()
        ptxas = p.path if hasattr(p, "path") else p[0]
    except Exception:
        return {}
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.ptx")
        with open(f, "w") as fh:
            fh.write(ptx)
        r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True)
    m = re.search(r"Used (\d+) registers", r.stderr)
    sp = re.search(r"(\d+) bytes spill stores", r.stderr)
    return dict(regs=int(m.group(1)) if m else None, spill_stores=int(sp.group(1)) if sp else None)
