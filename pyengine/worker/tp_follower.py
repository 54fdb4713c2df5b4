"""The tensor-parallel step protocol: rank 0's model runner sends each packed step
(``pyengine.worker.step_codec``) and the profiling-window controls to the other ranks;
each of those runs ``follow_one_step`` in its busy loop and repeats rank 0's forward (and
the logits gather; with async scheduling it takes the sampled ids rank 0 broadcasts).
Only rank 0 samples. Transport: ``GroupCoordinator.send_step`` / ``recv_step``.

Speculative decoding: verification is the target's forward with query length 1 + k (the
drafts are input ids of the packed step, so every rank feeds the same ones); only rank 0
runs the rejection sampler. A model-based proposer's forwards follow as a draft-plan
message (``pyengine.spec_decode.base.DraftPlan``: the token ids, positions and blocks
rank 0 decided, accepted tokens included), which every rank runs on its shard of the
draft model / EAGLE-3 head; their greedy tokens are the same on every rank
(``ParallelLMHead.greedy``). With async scheduling a verified step's newest tokens, which
the next step's placeholders take, come as a tokens message instead of a broadcast."""
from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np
import torch

from pyengine.worker.step_codec import (
    HEADER_LEN,
    KIND_CONTROL,
    KIND_DRAFT,
    KIND_TOKENS,
    KIND_VERIFY,
    PackedStep,
    StepShape,
    control_header,
    int64_header,
    payload_bytes,
)


class ModelRunner(Protocol):
    """What a follower rank uses of ``pyengine.worker.model_runner.ModelRunner`` (named
    here, not imported, so the runner and its protocol do not import each other)."""

    tp: Any
    profiler: Any
    model: Any
    config: Any
    device: torch.device
    prev_sampled: torch.Tensor | None
    drafter: Any

    def step_tensors(self, step: PackedStep) -> tuple: ...
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor: ...
    def open_profile(self, out_dir: str, trace: bool) -> None: ...
    def close_profile(self) -> None: ...

__all__ = ["TPStepSender", "follow_one_step"]

# control ops (profiling windows, pyengine/worker/profiler.py)
PROFILE_START, PROFILE_START_TRACE, PROFILE_STOP = 1, 2, 3


class TPStepSender:
    """Rank 0's side: one message per step (a fixed-size header, then the two buffers)."""

    def __init__(self, tp_group):
        self.tp = tp_group

    def send_step(self, step: PackedStep, verify: bool = False) -> None:
        """``verify``: the rejection sampler verifies the step's rows (no sampled-id
        broadcast follows it)."""
        self.tp.send_step(np.array(step.shape.header(verify), dtype=np.int64), step.buf64, step.buf32)

    def send_draft_plan(self, plan) -> None:
        """A proposer's ``DraftPlan``; the other ranks run it (``Proposer.follow``)."""
        data = plan.encode()
        self.tp.send_step(int64_header(KIND_DRAFT, data.size), data)

    def send_tokens(self, tokens: list[int]) -> None:
        """The rows' newest tokens of a verified step: the other ranks' ``prev_sampled``."""
        data = np.array(tokens, dtype=np.int64)
        self.tp.send_step(int64_header(KIND_TOKENS, data.size), data)

    def send_stop(self) -> None:
        """The other ranks' ``follow_one_step`` returns False."""
        self.tp.send_step(np.array(StepShape.stop_header(), dtype=np.int64))

    def send_profile_start(self, out_dir: str, trace: bool) -> None:
        data = np.frombuffer(os.fsencode(out_dir), dtype=np.uint8)
        self.tp.send_step(control_header(PROFILE_START_TRACE if trace else PROFILE_START, data.nbytes), data)

    def send_profile_stop(self) -> None:
        self.tp.send_step(control_header(PROFILE_STOP, 0))


def _follow_control(runner: ModelRunner, op: int, data: np.ndarray) -> None:
    """Rank 0's ``start_profile`` / ``stop_profile``."""
    if op == PROFILE_STOP:
        runner.close_profile()
        runner.tp.barrier()
        return
    runner.open_profile(os.fsdecode(data.tobytes()), op == PROFILE_START_TRACE)


@torch.inference_mode()
def follow_one_step(runner: ModelRunner) -> bool:
    """Ranks > 0: receive rank 0's next message and run it on ``runner``. Returns False
    when rank 0 sent stop."""
    prof = runner.profiler
    if prof is not None:
        prof.phase("recv")
    head, payload = runner.tp.recv_step(HEADER_LEN, payload_bytes)
    kind = head[0]
    if kind == KIND_CONTROL:
        _follow_control(runner, int(head[1]), payload)
        return True
    if kind == KIND_DRAFT:
        from pyengine.spec_decode.base import DraftPlan
        if prof is not None:
            prof.phase("draft")
        runner.drafter.follow(DraftPlan.decode(payload.view(np.int64)))  # (its phase ends at the next recv)
        return True
    if kind == KIND_TOKENS:
        runner.prev_sampled = torch.from_numpy(payload.view(np.int64).copy()).to(runner.device)
        return True
    shape = StepShape.from_header(head)
    if shape is None:
        return False
    if prof is not None:
        prof.phase("prepare")
    n64 = shape.int64_len * 8
    step = PackedStep(shape, payload[:n64].view(np.int64), payload[n64:].view(np.int32))
    ids, pos, meta, rows_t = runner.step_tensors(step)
    if prof is not None:
        prof.phase("forward")
    hidden = runner.forward(ids, pos, meta)
    if shape.num_sampled:
        if prof is not None:
            prof.phase("logits")
        runner.model.compute_logits(hidden if rows_t is None else hidden[rows_t])  # the gather
        if runner.config.async_scheduling and kind != KIND_VERIFY:  # the next step may feed these ids
            if prof is not None:
                prof.phase("token_bcast")
            runner.prev_sampled = runner.tp.broadcast(
                torch.empty(shape.num_sampled, dtype=torch.int64, device=runner.device))
    if prof is not None:
        prof.end_step()
    return True
