"""The launchers' plain-Python grid arithmetic equals Triton's helpers (which are slow to call
from the host in newer Triton versions)."""
import triton

from tritonchat.kernels._common import cdiv, next_pow2


def test_cdiv_and_next_pow2_equal_tritons():
    for a in list(range(0, 2100)) + [248320, 2**31 - 1, 2**40 + 3]:
        for b in (1, 2, 3, 7, 16, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
        assert next_pow2(a) == triton.next_power_of_2(a), a
