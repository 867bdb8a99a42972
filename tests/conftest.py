import os

import pytest
import torch
from hypothesis import Phase, settings

# Report a failing example as found: shrinking one of the interpreter's kernel cases ran past five minutes on CI.
settings.register_profile("ioattn", phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])
settings.load_profile("ioattn")

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


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory(request):
    """After each GPU test, torch's cached blocks go back to the driver: tests run in parallel workers on one GPU
    (pytest -n), and a worker holding a finished test's gigabytes made the others run out of memory."""
    yield
    if HAS_CUDA and "gpu" in request.keywords:
        torch.cuda.empty_cache()


@pytest.fixture
def device():
    """Where kernel tests run: the GPU when present, else the CPU (Triton interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of tiny ops (small models, the paged CPU path's thousands of small ops a
    step): on a shared 2-core machine OpenMP's barriers make two threads several times slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_report_header(config):
    return f"ioattn tests: cuda={HAS_CUDA} TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
