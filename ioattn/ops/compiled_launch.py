"""Launching a compiled Triton / Gluon kernel again without Triton's per-call binding.

`kernel[grid](*args, **kwargs)` binds every argument, specializes each one (pointer alignment, descriptor types,
ints unless `do_not_specialize`) and hashes the result into its cache key on every call: ~22 µs of host time for
the Gluon forward's ~45 arguments on an H100 host, where the driver launch itself takes ~13
(bench/results/2026-12-07-chains-ncu-h100, `lab/launch_cost.py`). A caller that already knows which
specialization a call needs keys the compiled kernel by it and launches that directly.
"""

from __future__ import annotations

import inspect


class CompiledLaunches:
    """One JIT kernel's compiled specializations, by the caller's key. The key must determine everything Triton
    specializes the kernel on: the constexprs and options, the dtypes and block shapes of the tensor descriptors,
    which pointer arguments are None or 16-byte aligned, the device; the kernel's int arguments must be
    `do_not_specialize` (which ones do not fit in i32 is added to the key here). The first call of a key goes
    through the JIT (compiling if need be); the next ones call the compiled kernel with the arguments in signature
    order."""

    def __init__(self, kernel):
        self._kernel = kernel
        parameters = inspect.signature(kernel.fn).parameters
        self._index = {name: i for i, name in enumerate(parameters)}
        empty = inspect.Parameter.empty
        self._defaults = [None if p.default is empty else p.default for p in parameters.values()]
        self._compiled = {}

    def __call__(self, key, grid: tuple[int, ...], *args, **kwargs) -> None:
        # an int argument is passed as i32, or as i64 past i32's range: the one part of an unspecialized int that
        # the compiled kernel depends on
        values = (*args, *kwargs.values())
        key = (key, tuple(i for i, v in enumerate(values) if type(v) is int and not -2**31 <= v < 2**31))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._kernel[grid](*args, **kwargs)
            self._compiled[key] = compiled.result() if hasattr(compiled, "result") else compiled
            return
        values = list(self._defaults)
        values[:len(args)] = args
        index = self._index
        for name, value in kwargs.items():
            at = index.get(name)
            if at is not None:  # options such as num_warps were compiled into the kernel
                values[at] = value
        compiled[(*grid, 1, 1)[:3]](*values)

    def __len__(self) -> int:
        return len(self._compiled)
