"""Where one engine step's host time went (`StepTiming`), phase by phase, and what the step did:
the engine records it for the last step (`Engine.last_timing`), the step log reports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepTiming:
    """Where the last `Engine.step` call's wall time went, in host seconds: scheduling, issuing
    the copies and the forward (`launch_s`), choosing the next ahead-of-time swap-outs while the
    device runs (`ahead_s`), waiting for the sampled tokens (`wait_s`), applying them; and what
    the step it applied did (with overlap, the one launched by the call before). A small `wait_s`
    means the device finished before the host did: the host is on the critical path."""

    schedule_s: float
    launch_s: float
    ahead_s: float
    wait_s: float
    update_s: float
    decodes: int  # single-token pieces
    prefill_tokens: int  # tokens of multi-token pieces (new prompt and recomputed history)
    swap_in: int  # blocks
    swap_out: int
    evict_first: int
    decode_positions: int = 0  # KV positions the decodes attend to, summed over them
    prefill_cap: int | None = None  # prefill tokens allowed beside its decodes (None: no cap)

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.launch_s + self.ahead_s + self.wait_s + self.update_s

    @property
    def kind(self) -> str:
        """decode | mixed | prefill, with "+in" when the step swapped in."""
        shape = "prefill" if not self.decodes else "mixed" if self.prefill_tokens else "decode"
        return shape + ("+in" if self.swap_in else "")
