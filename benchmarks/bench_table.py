"""The benchmark table: one `Row` per measurement, printed last by every benchmark script."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Row:
    """One line of the table: a measurement, what it is compared with, the target it must meet."""

    name: str
    value: float | None
    unit: str = ""
    ref: float | None = None
    ref_label: str = ""
    target: str = ""
    ok: bool | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        return self.value / self.ref if self.value is not None and self.ref else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


NOTED_SECTIONS = ("replay48", "policies")  # sections whose notes are printed under every row


def print_table(report: dict[str, Any]) -> None:
    m = report["meta"]
    print(
        f"\n=== Pensieve benchmarks: {m['device']}, {m['model']} {m['dtype']}, "
        f"torch {m['torch']}, transformers {m['transformers']} ==="
    )
    print(
        f"{'section':<9} {'measurement':<40} {'value':>9} {'unit':<6} {'vs':>9} {'ratio':>6}  "
        f"{'target':<13} ok"
    )
    for name, section in report["sections"].items():
        if not section["rows"]:
            print(f"{name:<9} {section['status']}")
        for r in section["rows"]:
            value = "-" if r["value"] is None else f"{r['value']:.4g}"
            ref = "-" if r["ref"] is None else f"{r['ref']:.4g}"
            ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
            ok = {True: "ok", False: "MISS", None: ""}[r["ok"]]
            print(
                f"{name:<9} {r['name'][:40]:<40} {value:>9} {r['unit']:<6} {ref:>9} "
                f"{ratio:>6}  {r['target']:<13} {ok}"
            )
            if r["note"] and (r["value"] is None or name in NOTED_SECTIONS):
                print(f"{'':<12}{r['note'][:240]}")


def jsonable(value: Any) -> Any:
    """Strict JSON for a report: inf as the string "inf", NaN as null, paths as strings."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, Path):
        return str(value)
    return value
