"""Triton kernels only: one concept per file, no policy, no Python-side allocation decisions.

On a machine without CUDA the kernels run under Triton's interpreter, so every kernel path is exercised (and
tested) on the CPU too. Triton chooses between compiling and interpreting when a function is decorated with
`@triton.jit`, reading TRITON_INTERPRET then: selecting the interpreter here, before the kernel modules below
this package are imported, covers ioattn's kernels. Triton's own library functions (`tl.sum`, `tl.cdiv`, ...) are
decorated when triton is imported, so if something imported triton first (torch does, e.g. when `torch._dynamo`
loads under a `torch.device("meta")` context), they are re-wrapped for the interpreter here.
"""

import os
import sys

def _interpret_triton_library() -> None:
    """Replace every compiled-mode `JITFunction` that `triton.language` and its submodules (and the tensor
    methods they attach) hold by an interpreted one. Raises RuntimeError if this Triton has none of the expected
    shape, rather than leaving kernels that fail later."""
    from triton.language import core
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    replaced: dict[int, InterpretedFunction] = {}

    def interpreted(fn: JITFunction) -> InterpretedFunction:
        if id(fn) not in replaced:
            replaced[id(fn)] = InterpretedFunction(fn.fn, do_not_specialize=fn.do_not_specialize,
                                                   do_not_specialize_on_alignment=fn.do_not_specialize_on_alignment,
                                                   noinline=fn.noinline)
        return replaced[id(fn)]

    holders = [module for name, module in list(sys.modules.items())
               if module is not None and (name == "triton.language" or name.startswith("triton.language."))]
    holders.append(core.tensor)
    for holder in holders:
        for name, value in list(vars(holder).items()):
            if isinstance(value, JITFunction):
                setattr(holder, name, interpreted(value))
    if not replaced:
        raise RuntimeError(
            "ioattn: triton was imported before ioattn on a machine without CUDA and its library functions could "
            "not be switched to Triton's CPU interpreter; set TRITON_INTERPRET=1 before importing triton")


if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        if "triton" in sys.modules:
            _interpret_triton_library()


def interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter rather than compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
