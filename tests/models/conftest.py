"""Test set-up for tests/models.

The models here are tiny or small, so their CPU matmuls are too short to gain from a second
thread, and on a shared 2-core machine two OpenMP threads per process stall each other badly
(up to 10x slower while another test process runs). One intra-op thread per process.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
