"""The process group ioattn's workers share: one torch.distributed world, NCCL on CUDA and gloo on the CPU.

Every worker process (and the engine's own process, which is rank 0) calls `init_distributed` once; tensor
parallelism uses the whole world as its group, and disaggregated serving uses a world of two (prefill rank and
decode rank). Collectives carry a timeout so that a peer that died turns into an error instead of a hang.
"""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Seconds a collective may wait for its peers before raising; long enough for a cold kernel compile on a GPU.
DEFAULT_TIMEOUT_S = 300.0


# Rendezvous key: how many ranks other than 0 have reached the store.
_JOINED = "ioattn/joined"

# Small pickled messages (step plans) travel over gloo even when tensors use NCCL: no device copies, no syncs.
_control_group = None


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port free on this host now, for the rendezvous of a world started on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device_type: str, rank: int) -> torch.device:
    """Rank r drives GPU r of the host; every CPU rank uses the CPU."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def init_distributed(rank: int, world_size: int, port: int, device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                     check_peers: Callable[[], None] | None = None) -> ParallelState:
    """Join the world of `world_size` processes meeting at 127.0.0.1:port; one world per process at a time.

    Rank 0 hosts the rendezvous store. With `check_peers` (which raises when a peer process is gone) it waits for
    the other ranks by polling, so that a peer that dies before joining fails the start at once, not at the
    timeout.
    """
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed world; shut that engine down first")
    device = rank_device(device_type, rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    if rank == 0:
        deadline = time.monotonic() + timeout_s
        while store.add(_JOINED, 0) < world_size - 1:
            if check_peers is not None:
                check_peers()
            if time.monotonic() > deadline:
                joined = store.add(_JOINED, 0)
                raise TimeoutError(f"only {joined} of {world_size - 1} other ranks joined within {timeout_s} s")
            time.sleep(0.01)
    else:
        store.add(_JOINED, 1)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world_size, timeout=timeout)
    global _control_group
    _control_group = dist.new_group(backend="gloo") if device.type == "cuda" else None
    return ParallelState(rank, world_size, device)


def destroy_distributed() -> None:
    global _control_group
    _control_group = None
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_object(obj=None, src: int = 0):
    """Rank src's picklable `obj` on every rank (over the CPU control group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_control_group)
    return box[0]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `tensor` along the last dimension, in rank order (all ranks get the result)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=-1)
