"""Integer helpers for launch arithmetic, in plain Python.

Triton's `cdiv` / `next_power_of_2` are wrapped for use inside kernels and cost microseconds per host call; the
ops layer computes grids and block sizes several times per layer per step, so it uses these instead. No imports:
`ioattn.kv` (torch-free) uses them too.
"""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()
