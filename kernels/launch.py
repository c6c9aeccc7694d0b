"""A leaner launch path for Triton kernels launched many times with the same arguments.

Each `kernel[grid](...)` call makes Triton bind the arguments, specialize every one of them (its
type, and for integers and pointers whether it is 1 or a multiple of 16), hash that into a cache
key and look the compiled kernel up. An eager 40-layer step launches ~280 Triton kernels among
its ~500, and issuing them all takes the host longer than the GPU takes to run a small step (and
a large one, on a slow host). This shortcut cuts the host time of a small eager step's launch by
about a tenth.

`FastKernel` remembers the compiled kernel per exact argument signature (every scalar's value,
every tensor's dtype and whether its address is 16-byte aligned: at least as fine as Triton's own
specialization, so a hit always names the kernel Triton would pick) and launches it through the
compiled kernel's launcher directly. The first launch of a signature goes through Triton as usual
(and compiles if needed). Under the interpreter (TRITON_INTERPRET=1) every launch goes through
Triton. `use_fast_launch(False)` turns the shortcut off (benchmarks compare both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_MAX_ENTRIES = 4096  # signatures remembered per kernel before the table starts over
_KERNELS: list[FastKernel] = []  # every kernel wrapped, so the switch reaches those made already
_enabled = True


def use_fast_launch(enabled: bool) -> None:
    """Launch every kernel through its compiled launcher (True, the default) or through Triton."""
    global _enabled
    _enabled = enabled
    for kernel in _KERNELS:
        kernel.enabled = enabled and kernel.launchable


class FastKernel:
    """Wraps a `triton.jit` function: `FastKernel(fn)(grid, *args, **constexprs_and_options)`
    launches it like `fn[grid](*args, **constexprs_and_options)`.

    Every positional argument is a runtime argument (a tensor or a scalar); keyword arguments are
    the constexprs and launch options (`num_warps`, `num_stages`). The kernel's constexprs must
    come after its runtime arguments, as they do in all of ours."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.launchable = hasattr(fn, "params")  # not under the interpreter
        self.enabled = _enabled and self.launchable
        _KERNELS.append(self)
        params = list(getattr(fn, "params", ()))
        runtime = [p for p in params if not p.is_constexpr]
        constexprs = [p for p in params if p.is_constexpr]
        if params[: len(runtime)] != runtime:
            raise ValueError(f"{fn}: constexpr parameters must come last")
        self._num_runtime = len(runtime)
        self._constexprs = [(p.name, p.default) for p in constexprs]
        self._compiled: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}
        # whether the compiled launcher takes the constexprs too (it does in recent Triton); None
        # until the first direct launch finds out
        self._with_constexprs: bool | None = None

    def __call__(self, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
        if not self.enabled:
            self.fn[grid](*args, **kwargs)
            return
        if len(args) != self._num_runtime:
            wanted = self._num_runtime
            raise TypeError(f"{self.fn}: {len(args)} arguments, {wanted} wanted")
        key = (_signature(args), tuple(kwargs.items()))
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.fn[grid](*args, **kwargs)
            if compiled is None or not hasattr(compiled, "run"):  # the interpreter
                return
            if len(self._compiled) >= _MAX_ENTRIES:
                self._compiled.clear()
            tail = tuple(kwargs.get(name, default) for name, default in self._constexprs)
            self._compiled[key] = (compiled, tail)
            return
        compiled, tail = entry
        grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        if self._with_constexprs is False:
            compiled[grid3](*args)
            return
        try:
            compiled[grid3](*args, *tail)
        except TypeError:
            if self._with_constexprs or not tail:
                raise
            compiled[grid3](*args)  # an older launcher: runtime arguments only
            self._with_constexprs = False
            return
        self._with_constexprs = True


def _signature(args: Sequence[Any]) -> tuple[Any, ...]:
    """What a launch's compiled kernel depends on, per argument."""
    return tuple(
        (a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor) else (type(a), a)
        for a in args
    )
