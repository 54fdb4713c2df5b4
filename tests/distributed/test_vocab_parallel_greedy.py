"""``ParallelLMHead.greedy`` (the proposers' draft tokens under tensor parallelism): over
two gloo ranks on CPU, every rank gets the argmax of the whole vocabulary — the padding
row of the last rank's range never wins (all-negative logits), and a tie across the ranks'
ranges goes to the lowest id, as ``torch.argmax`` breaks it — and the same ids on both
ranks; ``GroupCoordinator.all_gather`` stacks the ranks' tensors in rank order."""
from __future__ import annotations

import torch

from tests.helpers import run_two_ranks

VOCAB, HIDDEN = 11, 6  # 6 + 5 rows: the second rank's range padded with one zero row


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.rand(VOCAB, HIDDEN, generator=g) + 0.1  # positive: a negative hidden row gives all-negative logits
    w[2] = w[8] = 3.0  # ids 2 and 8 (on different ranks) tie for every row
    x = torch.randn(5, HIDDEN, generator=g)
    x[0] = -torch.rand(HIDDEN, generator=g) - 0.1
    x[1] = 1.0  # id 2 (= 8) is the maximum
    return w, x


def _rank(rank: int, init_method: str, q) -> None:
    from pyengine.distributed import init_distributed_environment
    from pyengine.layers.embedding import ParallelLMHead

    tp = init_distributed_environment(rank, 2, init_method, torch.device("cpu"))
    try:
        w, x = _weights()
        head = ParallelLMHead(VOCAB, HIDDEN, tp_group=tp)
        head.weight.weight_loader(head.weight, w)
        gathered = tp.all_gather(torch.tensor([rank, 10 + rank]))
        q.put((rank, {"greedy": head.greedy(x).tolist(), "gathered": gathered.tolist()}))
        # neither rank tears gloo down while the other still uses it
        torch.distributed.barrier()
    finally:
        tp.destroy()


def test_greedy_over_two_ranks_is_the_whole_vocabulary_argmax():
    w, x = _weights()
    logits = x @ w.T
    want = logits.argmax(dim=-1).tolist()
    assert (logits[0] < 0).all() and want[1] == 2  # the cases the ranks could get wrong
    reports = run_two_ranks(_rank)
    for rank in (0, 1):
        assert reports[rank]["greedy"] == want
        assert reports[rank]["gathered"] == [[0, 10], [1, 11]]


def test_greedy_on_one_rank_is_the_argmax():
    from pyengine.layers.embedding import ParallelLMHead

    w, x = _weights()
    head = ParallelLMHead(VOCAB, HIDDEN)
    head.weight.weight_loader(head.weight, w)
    assert head.greedy(x).tolist() == (x @ w.T).argmax(dim=-1).tolist()
