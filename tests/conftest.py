"""Shared test set-up. Without a GPU, Triton kernels run in its CPU interpreter.

TRITON_INTERPRET must be set before anything imports triton, so this comes first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The model's weights are dequantized once for the run and every process its tests start, not at
# each load (`models/weights_cache.py`); the folder goes when the run ends.
if "PENSIEVE_WEIGHTS_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _weights = tempfile.mkdtemp(prefix="pensieve-weights-")
    os.environ["PENSIEVE_WEIGHTS_CACHE"] = _weights
    atexit.register(shutil.rmtree, _weights, True)

import gc  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

# A test's engine holds its KV tiers (gigabytes of address space on the CPU). What keeps them
# past the test (reference cycles until the collector runs; aiohttp's cache of the handlers it
# wrapped, up to 1,024 of them, which holds the HTTP actor and through it the engine) lets the
# suite's process grow past what the kernel lets a fork commit: every later test that starts a
# process then fails.
COLLECT_AFTER_GROWTH = 256 << 20


def data_size() -> int:
    """This process's data segment (VmData) in bytes: the address space its heap holds."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) << 10
    return 0


@pytest.fixture(autouse=True)
def collect_what_a_test_left() -> Iterator[None]:
    """After a test whose process grew, let go of what it left (and of its tensors)."""
    before = data_size()
    yield
    if data_size() - before > COLLECT_AFTER_GROWTH:
        web_app = sys.modules.get("aiohttp.web_app")
        if web_app is not None:
            web_app._cached_build_middleware.cache_clear()
        gc.collect()
