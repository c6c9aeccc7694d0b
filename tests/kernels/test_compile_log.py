"""The compile log sees a Triton kernel compiled while it is entered, chains hooks set before it,
and puts them back on exit."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pensieve.kernels.compile_log import CompileLog

knobs = pytest.importorskip("triton").knobs


def test_each_compile_is_logged_and_earlier_hooks_still_run() -> None:
    earlier: list[str] = []

    def before(**kwargs: Any) -> bool:
        earlier.append("before")
        return False

    def after(**kwargs: Any) -> None:
        earlier.append("after")

    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
    try:
        with CompileLog() as log:
            # what Triton's JITFunction passes around one compile that missed its cache
            call = {
                "key": ("sig", 1),
                "repr": "k[...]",
                "fn": SimpleNamespace(name="k"),
                "compile": {
                    "constants": {(3,): 64},
                    "configs": [{(0,): [["tt.divisibility", 16]]}],
                },
                "is_manual_warmup": False,
                "already_compiled": False,
            }
            assert knobs.runtime.jit_cache_hook(**call) is False  # Triton goes on compiling
            knobs.runtime.jit_post_compile_hook(**call)
            knobs.runtime.jit_cache_hook(**{**call, "key": ("sig", 2)})  # never finished
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == (
            before,
            after,
        )
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved
    assert earlier == ["before", "after", "before"]
    assert [e.kernel for e in log.events] == ["k", "k"]
    assert 0 <= log.events[0].seconds < 1 and log.events[1].seconds == float("inf")
    assert "(3,): 64" in log.events[0].detail and "tt.divisibility" in log.events[0].detail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_new_specialization_compiled_on_the_gpu_is_logged_once() -> None:
    from pensieve.kernels.block_copy import copy_blocks

    src = torch.arange(4 * 7, dtype=torch.int16, device="cuda").view(4, 7)  # an odd block
    dst = torch.zeros_like(src)
    index = torch.arange(4, dtype=torch.int32, device="cuda")
    with CompileLog() as log:
        copy_blocks(src, dst, index, index)
        copy_blocks(src, dst, index, index)  # the same specialization: no second compile
        torch.cuda.synchronize()
    assert torch.equal(dst, src)
    names = [e.kernel for e in log.events]
    assert names.count("_copy_blocks_kernel") == 1, names
    assert all(0 < e.seconds < 120 for e in log.events)
