import os

import pytest
import torch

# Tests check index-tensor contents on CUDA too (ioattn.ops.checks): a wrong table fails loudly, never reads OOB.
os.environ.setdefault("IOATTN_VALIDATE", "1")

import ioattn.kernels  # noqa: F401  (selects the Triton interpreter on CPU-only machines before any kernel loads)

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker); run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where kernel tests run: the GPU when present, else the CPU (Triton interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"


def pytest_report_header(config):
    return f"ioattn tests: cuda={HAS_CUDA} TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
