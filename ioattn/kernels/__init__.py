"""Triton kernels only: one concept per file, no policy, no Python-side allocation decisions.

On a machine without CUDA the kernels run under Triton's interpreter, so every kernel path is exercised (and
tested) on the CPU too. The switch must happen before Triton is imported, which is why it lives here and why
importing Triton first on such a machine is refused with an explanation rather than failing later inside a kernel.
"""

import os
import sys

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        if "triton" in sys.modules:
            raise RuntimeError(
                "ioattn: triton was imported before ioattn on a machine without CUDA, so its kernels cannot switch "
                "to Triton's CPU interpreter; set TRITON_INTERPRET=1 before importing triton (or import ioattn first)"
            )
        os.environ["TRITON_INTERPRET"] = "1"


def interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter rather than compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
