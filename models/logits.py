"""The last step of a model: hidden states times the LM head's rows, in float32.

A module of its own (with no weights: the head's rows are passed in, tied to the embedding or
not) so that a transform can replace it: tensor parallelism gathers the vocabulary shards here
(models/tensor_parallel.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Logits(nn.Module):
    def forward(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden], head: [vocab, hidden] -> logits: [N, vocab] float32
        return F.linear(hidden, head).float()
