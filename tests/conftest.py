"""Shared test set-up. Without a GPU, Triton kernels run in its CPU interpreter.

TRITON_INTERPRET must be set before anything imports triton, so this comes first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gc  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

# A test's engine holds its KV tiers (gigabytes of address space on the CPU). Reference cycles
# can keep them past the test until the collector happens to run, and the suite's process then
# grows past what the kernel lets a fork commit: every later test that starts a process fails.
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
    """After a test whose process grew, collect the cycles it left (and their tensors)."""
    before = data_size()
    yield
    if data_size() - before > COLLECT_AFTER_GROWTH:
        gc.collect()
