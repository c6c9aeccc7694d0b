"""Print the fenced code block that follows `<!-- readme: NAME -->` in README.md.

    python3 .ci/readme_block.py "test command"

CI runs the README's own test command through this, and the README tests run its examples, so
the README cannot drift from what is checked.
"""

from __future__ import annotations

import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(name: str, readme: Path = README) -> str:
    lines = readme.read_text().splitlines()
    marker = f"<!-- readme: {name} -->"
    if marker not in lines:
        raise SystemExit(f"{readme}: no {marker!r}")
    start = lines.index(marker) + 1
    if not lines[start].startswith("```"):
        raise SystemExit(f"{readme}: {marker!r} is not followed by a fenced block")
    end = lines.index("```", start + 1)
    return "\n".join(lines[start + 1 : end]) + "\n"


if __name__ == "__main__":
    sys.stdout.write(readme_block(sys.argv[1]))
