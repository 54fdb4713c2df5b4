"""Token embedding and LM head, vocab-parallel (mirrors
vllm/model_executor/layers/vocab_parallel_embedding.py).

The vocabulary is split into ``tp`` equal ranges of ``ceil(vocab / tp)`` rows (the last
one padded with zero rows). ``tp_group`` is a ``pyengine.distributed.GroupCoordinator``
or None (one rank: plain ``F.embedding`` / ``F.linear``, nothing else).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyengine.layers.linear import _check_shape, narrow_weight


class VocabParallelEmbedding(nn.Module):
    """weight: [ceil(vocab / tp), hidden], this rank's vocabulary range
    [vocab_start_index, vocab_end_index). ``forward(input_ids int64 [T]) -> [T, hidden]``
    (weight dtype): each rank looks up the ids in its range, zeros for the rest, and one
    all-reduce sums the ranks' rows. ``weight``: share this parameter instead of creating
    one (tied LM head)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group=None,
                 weight: nn.Parameter | None = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.__dict__["tp_group"] = tp_group  # not a module; shared by every layer
        self.tp_size = tp_group.world_size if tp_group is not None else 1
        rank = tp_group.rank if tp_group is not None else 0
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_index = min(rank * self.num_embeddings_per_partition, num_embeddings)
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        if weight is None:
            weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                  requires_grad=False)
            weight.weight_loader = self.weight_loader
        self.weight = weight

    def weight_loader(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        """Rows [vocab_start_index, vocab_end_index) of the checkpoint's [vocab, hidden];
        padding rows zeroed. Raises ValueError on a shape mismatch."""
        _check_shape(loaded, (self.num_embeddings, self.embedding_dim))
        n = self.vocab_end_index - self.vocab_start_index
        param.data[:n].copy_(narrow_weight(loaded, 0, self.vocab_start_index, n))
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local = (input_ids - self.vocab_start_index).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(out)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start_index}, "
                f"{self.vocab_end_index}), tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; each rank computes the logits of its
    vocabulary range and rank 0 gathers them.

    With ``tie_to`` (a VocabParallelEmbedding) the weight *is* the embedding's parameter
    (``tie_word_embeddings``), so the checkpoint's ``lm_head.weight`` is neither needed nor
    read. ``forward(hidden [N, hidden]) -> float32 logits [N, vocab]`` on rank 0, None on
    the other ranks (which must call it too: the gather is a collective).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tie_to: VocabParallelEmbedding | None = None,
                 tp_group=None):
        super().__init__(num_embeddings, embedding_dim, tp_group,
                         weight=tie_to.weight if tie_to is not None else None)
        self.tied = tie_to is not None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            # Gathered in the model dtype (half the bytes of float32), padding rows cut.
            logits = self.tp_group.gather(logits, dst=0, dim=-1)
            if logits is None:
                return None
            logits = logits[:, :self.num_embeddings]
        return logits.float()

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of ``forward(hidden)``'s logits, int64 [N], on every rank (a proposer's
        greedy draft tokens, which every rank feeds to its next draft step): each rank takes
        the first maximum of its vocabulary range, one all-gather brings every rank's
        (value, id) pair [2, N] (ids as float32: exact below 2**24), and the first rank with
        the largest value wins, so ties go to the lowest id as ``torch.argmax`` does over the
        whole vocabulary. Collective: every rank calls it."""
        logits = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits.float().argmax(dim=-1)
        n = self.vocab_end_index - self.vocab_start_index
        if n == 0:  # (a vocabulary smaller than the group: this rank's range is empty)
            val = torch.full((hidden.shape[0],), float("-inf"), device=hidden.device)
            idx = torch.zeros(hidden.shape[0], dtype=torch.int64, device=hidden.device)
        else:
            local = logits[:, :n].float()  # padding rows cut
            idx = local.argmax(dim=-1)
            val = local.gather(1, idx.unsqueeze(1)).squeeze(1)
        both = self.tp_group.all_gather(torch.stack((val, (idx + self.vocab_start_index).float())))  # [W, 2, N]
        best = both[:, 0].argmax(dim=0, keepdim=True)  # [1, N]: the first rank holding the maximum
        return both[:, 1].gather(0, best).squeeze(0).to(torch.int64)
