"""Does Triton's CPU interpreter run a Gluon kernel? (stop 40, on the CPU machine, Triton 3.9)

CI tests every kernel against its PyTorch reference under TRITON_INTERPRET=1, so a Gluon kernel
(the open leads in docs/decode_log.md that need one) could join kernels/ only if the
interpreter ran it. Prints "yes" or the error Triton raises; exits 0 either way.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402


@gluon.jit
def _double(x, y, N: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, N, layout=layout)
    gl.store(y + offs, gl.load(x + offs) * 2)


if __name__ == "__main__":
    x = torch.arange(128, dtype=torch.float32)
    y = torch.empty_like(x)
    print("triton", triton.__version__)
    try:
        _double[(1,)](x, y, 128, num_warps=4)
        print("yes" if torch.equal(y, 2 * x) else "ran, wrong result")
    except Exception as exc:  # the answer is the error itself
        print(f"no: {type(exc).__name__}: {exc}")
