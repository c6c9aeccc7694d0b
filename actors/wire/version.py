"""The installed version of Pensieve (distribution `pensieve-serve`, import package `pensieve`)."""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "pensieve-serve"  # `pensieve` on PyPI is an unrelated project


def version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
        return "0.0.0+source"
