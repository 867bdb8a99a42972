"""A step's small host <-> device transfers, queued on the stream instead of waiting for it.

- `to_device(values, dtype, device)`: a host list as a device tensor. `torch.tensor(values, device="cuda")`
  copies from pageable memory, and PyTorch then waits for the stream to drain: with asynchronous scheduling the
  host would sit idle until the GPU had finished the step before. Staged through pinned memory (the caching
  host allocator keeps the buffer until its copy has run) the copy is only queued.
- `HostCopy(tensor)`: a device tensor copied into fresh pinned host memory with non_blocking=True, followed by
  an event; `result()` waits for that event alone, so reading step t's tokens does not wait for step t+1,
  queued behind it. On a CPU device the tensor is already in host memory and is returned as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class HostCopy:
    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if tensor.device.type != "cuda":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(tensor.device))

    def result(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host
