"""Token embedding and LM head (mirrors
vllm/model_executor/layers/vocab_parallel_embedding.py, single-rank)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyengine.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    """weight: [vocab_size, hidden]. forward(input_ids int64 [T]) -> [T, hidden] (weight dtype)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits.

    With ``tie_to`` (a VocabEmbedding) the weight *is* the embedding's parameter
    (``tie_word_embeddings``), so the checkpoint's ``lm_head.weight`` is neither needed nor read.
    ``forward(hidden [N, hidden]) -> logits float32 [N, vocab]``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
            self.weight.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
