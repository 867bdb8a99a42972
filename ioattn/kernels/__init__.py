"""Triton kernels only: one concept per file, no policy, no Python-side allocation decisions.

On a machine without CUDA the kernels run under Triton's interpreter, so every kernel path is exercised (and
tested) on the CPU too. The switch must happen before any `@triton.jit` runs, which is why it lives here.
"""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter rather than compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
