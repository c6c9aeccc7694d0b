"""Shared test set-up. Without a GPU, Triton kernels run in its CPU interpreter.

TRITON_INTERPRET must be set before anything imports triton, so this comes first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
