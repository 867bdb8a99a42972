"""What the device (or Triton's CPU interpreter) can do, as the ops' dispatch and launchers ask it."""

from __future__ import annotations

import functools

import torch

from ioattn.kernels import interpreted

HOPPER = (9, 0)  # H100 / H200: the tuned tables' device
SIXTEEN_BIT = (torch.float16, torch.bfloat16)
HOPPER_SHARED_MEMORY = 227 * 1024  # opt-in dynamic shared memory per block on H100/H200
MAX_GRID_Y = 65535  # CUDA's limit on a launch grid's second dimension (the kernels put (batch, head) pairs there)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return _cuda_capability(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    """Asked on every attention call: torch's lookup costs microseconds of host time each."""
    return torch.cuda.get_device_capability(index)


def interpreter_upcast(dtype: torch.dtype) -> bool:
    """Whether Triton kernels must run on float32 copies: bf16 under Triton 3.6's interpreter, whose bf16
    tl.dot returns garbage (fp16 and fp32 dots, and bf16 casts, are right)."""
    return dtype == torch.bfloat16 and interpreted()
