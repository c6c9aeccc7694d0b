"""Which Triton kernels compile while a block of code runs, and for how long.

A kernel compiled in the middle of serving stops the step that launches it for hundreds of
milliseconds (every running request waits). The engine compiles its kernels at start-up; this log
shows when something still compiles later (a new specialization: another dtype, alignment, or an
integer argument that becomes 1 or a multiple of 16).

    with CompileLog() as log:
        ...
    log.events  # [CompileEvent(kernel, start_s, seconds), ...] in perf_counter seconds

It chains Triton's `knobs.runtime` JIT hooks (called before and after each compile that misses
the in-memory cache), restoring the previous hooks on exit. Where Triton has no such knobs, or runs
in interpreter mode (nothing is compiled), the log stays empty.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CompileEvent:
    kernel: str  # the @triton.jit function's qualified name
    start_s: float  # time.perf_counter() when the compile began
    seconds: float  # until Triton's post-compile hook (inf if it never came)
    detail: str = ""  # its constexpr values and specialized arguments (which variant it was)


class CompileLog:
    def __init__(self) -> None:
        self.events: list[CompileEvent] = []
        self._started: dict[Any, tuple[str, float, str]] = {}
        self._runtime: Any = None
        self._previous: tuple[Any, Any] = (None, None)

    def __enter__(self) -> CompileLog:
        try:
            from triton import knobs
        except ImportError:  # a Triton without knobs: nothing to listen to
            return self
        self._runtime = knobs.runtime
        self._previous = (self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook)
        self._runtime.jit_cache_hook = self._before
        self._runtime.jit_post_compile_hook = self._after
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._previous
            self._runtime = None
        for kernel, start, detail in self._started.values():  # began, never finished
            self.events.append(CompileEvent(kernel, start, float("inf"), detail))
        self._started.clear()

    def _before(self, **kwargs: Any) -> Any:
        self._started[_key(kwargs)] = (_name(kwargs), time.perf_counter(), _detail(kwargs))
        previous = self._previous[0]
        return previous(**kwargs) if previous is not None else False  # False: go on compiling

    def _after(self, **kwargs: Any) -> Any:
        begun = self._started.pop(_key(kwargs), None)
        if begun is not None:
            kernel, start, detail = begun
            self.events.append(CompileEvent(kernel, start, time.perf_counter() - start, detail))
        previous = self._previous[1]
        return previous(**kwargs) if previous is not None else None


def _key(kwargs: dict[str, Any]) -> Any:
    return (_name(kwargs), str(kwargs.get("key")))


def _name(kwargs: dict[str, Any]) -> str:
    fn = kwargs.get("fn")
    return str(getattr(fn, "name", None) or kwargs.get("repr", "?"))


def _detail(kwargs: dict[str, Any]) -> str:
    """The variant: constexpr values and the arguments Triton specialized (e.g. a pointer known
    to be 16-byte aligned, an integer equal to 1), by argument index."""
    compile_args = kwargs.get("compile") or {}
    constants = compile_args.get("constants", "")
    configs = compile_args.get("configs") or [""]
    return f"constants {constants}; specialized {configs[0]}"[:2000]


_PROCESS_LOG: CompileLog | None = None


def process_log() -> CompileLog:
    """One log for the rest of the process's life, begun on the first call: a server's step log
    reads it to say which steps waited for a compile."""
    global _PROCESS_LOG
    if _PROCESS_LOG is None:
        _PROCESS_LOG = CompileLog().__enter__()
    return _PROCESS_LOG
