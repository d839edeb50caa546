"""Host-side integer helpers for the launchers (grid sizes, splits).

`triton.cdiv` is a JIT function: called from Python it costs about 2 us (argument binding), and
the launchers of the ~130-kernel decode step and the ~230-kernel prefill call it several times
per launch. This is the same ceiling division in plain Python.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers a >= 0, b > 0."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n (n >= 1; 0 for 0), as triton.next_power_of_2, which newer
    Triton versions also route through a slow constexpr-function call."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
