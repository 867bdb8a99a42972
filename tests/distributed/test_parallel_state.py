"""The rendezvous: a peer that dies before joining fails rank 0's start at once, not at the world's timeout."""

import os
import time

import pytest
import torch.multiprocessing as mp

from ioattn.distributed.parallel_state import free_port, init_distributed


def test_peer_dead_before_rendezvous_fails_fast():
    peer = mp.get_context("spawn").Process(target=os._exit, args=(3,), daemon=True)
    peer.start()

    def check_peers():
        if peer.exitcode is not None:
            raise RuntimeError(f"peer exited with code {peer.exitcode}")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="peer exited with code 3"):
        init_distributed(0, 2, free_port(), "cpu", timeout_s=60, check_peers=check_peers)
    assert time.monotonic() - start < 30
    peer.join()


def test_rendezvous_times_out_without_peers():
    with pytest.raises(TimeoutError, match="only 0 of 1 other ranks joined within 0.5 s"):
        init_distributed(0, 2, free_port(), "cpu", timeout_s=0.5)
