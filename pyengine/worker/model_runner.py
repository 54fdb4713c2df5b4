"""Model runner: turns a SchedulerOutput into model inputs, runs the forward pass and
samples (mirrors vllm/v1/worker/gpu_model_runner.py). Its parts: KV-cache sizing and
warm-up (here), the packed step format (``step_codec``), the tensor-parallel step protocol
(``tp_follower``), and the per-request sampling state (``sampling_state``).

One code path for CPU and GPU. With async scheduling, the token a decode step feeds may
have been sampled by the previous step and never seen by the host: it is gathered on the
device from that step's sampled ids. Sampled ids reach the host through a pinned buffer
copied on a side stream, with an event the engine waits on only when it consumes them.

Speculative decoding with async scheduling: the scheduler gives step N+1's decode rows
draft placeholders and positions that assume all of step N's drafts accepted, before step
N's verification is known. The runner keeps step N's verification in flight
(``_SpecVerification``) and resolves it at the start of step N+1 (or when the engine
consumes step N, whichever comes first): it waits for that one small device-to-host copy,
runs the proposer on step N's result, then runs step N+1 with the placeholders filled from
its own drafts and each row moved back by its rejected drafts (``_fill_drafts``). The
scheduler learns the acceptance one step later and corrects its counts the same way.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from pyengine.attention.backend import AttentionMetadata, get_backend_cls
from pyengine.config import CPU_DEFAULT_KV_BYTES, EngineConfig
from pyengine.core.kv_cache_manager import cdiv
from pyengine.core.sched.output import ScheduledRequest, SchedulerOutput
from pyengine.messages import LogprobsEntry
from pyengine.models.loader import load_model
from pyengine.models.registry import model_dims
from pyengine.spec_decode.base import DeviceDrafts, DraftRow
from pyengine.worker.profiler import RankProfiler
from pyengine.worker.rejection_sampler import RejectionSampler
from pyengine.worker.sampler import Sampler
from pyengine.worker.sampling_state import SamplingState
from pyengine.worker.step_codec import PackedStep, pack_step
from pyengine.worker.tp_follower import TPStepSender, follow_one_step

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    """Host-side results, one entry per sampled row (rows with ScheduledRequest.sample).

    With speculative decoding (``speculative_config``) ``generated_token_ids`` holds, per
    sampled row, the 1..k+1 tokens its verification produced (``sampled_token_ids`` is
    then their first tokens), ``generated_logprobs`` one entry per such token (None when
    no row asked for logprobs), and ``draft_token_ids`` the drafts proposed for each row's
    next step ([] for none; None under async scheduling, where the runner keeps them).
    ``num_draft_tokens``: per sampled row, the drafts it fed (async scheduling: the runner
    fills up to the scheduled placeholders with the drafts it has); None: all scheduled."""
    sampled_token_ids: list[int]
    logprobs: list[LogprobsEntry] | None = None
    generated_token_ids: list[list[int]] | None = None
    generated_logprobs: list[list[LogprobsEntry]] | None = None
    draft_token_ids: list[list[int]] | None = None
    num_draft_tokens: list[int] | None = None

    def ready(self) -> bool:  # (as AsyncModelRunnerOutput: a speculative step's output is on the host)
        return True

    def get_output(self) -> ModelRunnerOutput:
        return self


class AsyncModelRunnerOutput:
    """Results still on their way to the host; ``get_output()`` waits for the copy only."""

    def __init__(self, event, host_tokens: torch.Tensor, logprobs_fn, keepalive):
        self._event, self._host, self._logprobs_fn, self._keepalive = event, host_tokens, logprobs_fn, keepalive

    def ready(self) -> bool:
        """True once ``get_output`` would not wait."""
        return self._event is None or self._event.query()

    def get_output(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        out = ModelRunnerOutput(self._host.tolist(), self._logprobs_fn() if self._logprobs_fn else None)
        self._keepalive = None
        return out


def _draft_rows(sampled) -> list[int]:
    """Per logits row of a verification the draft it checks: each sampled row's drafts,
    then -1 on its last row."""
    out: list[int] = []
    for s in sampled:
        out.extend(s.spec_token_ids)
        out.append(-1)
    return out


class _SpecVerification:
    """One speculative step's verification, its results on their way to the host.

    ``so``: the step as run (drafts filled in); ``sampled``: its sampled rows; ``starts``:
    each row's first logits row; ``draft_ids``: per logits row the draft it checked (-1
    on each request's last row); ``dev``: the device results to copy (the candidates, and
    the acceptance flags unless ``greedy``); ``lp``: the logprobs' three tensors or [];
    ``sched_drafts``: per sampled row the draft placeholders the scheduler gave it;
    ``hidden``: the target's hidden states of the step (for the proposer). ``result()``
    waits for the copy (once) and builds the ``ModelRunnerOutput``."""

    def __init__(self, runner, so, sampled, starts, draft_ids, greedy: bool, dev: list, lp: list,
                 sched_drafts, hidden, non_blocking: bool):
        self.so, self.sampled, self.starts, self.draft_ids = so, sampled, starts, draft_ids
        self.greedy, self.has_logprobs, self.sched_drafts, self.hidden = greedy, bool(lp), sched_drafts, hidden
        self._out: ModelRunnerOutput | None = None
        self._event = None
        self._keepalive = None
        if non_blocking and runner._is_cuda:
            # pinned copies on the side stream; result() waits for their event only
            stream = runner._copy_stream
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                              for t in dev + lp]
                self._event = torch.cuda.Event()
                self._event.record()
            self._keepalive = dev + lp  # (the copies read them on the side stream)
        else:
            # the logprobs' copies are queued before the candidates' (one sync for all)
            self._host = dev + [t.to("cpu", non_blocking=True) for t in lp]

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> ModelRunnerOutput:
        if self._out is not None:
            return self._out
        if self._event is not None:
            self._event.synchronize()
        host, sampled, starts = self._host, self.sampled, self.starts
        draft_ids = self.draft_ids if self.draft_ids is not None else _draft_rows(sampled)
        if self.greedy:  # a greedy row accepts its draft when it is the argmax
            cand = host[0].tolist()
            acc = [c == d for c, d in zip(cand, draft_ids)]
        else:
            cand, acc = torch.stack((host[0], host[1].to(torch.int64))).tolist()
        generated = [RejectionSampler.emitted(cand, acc, st, len(s.spec_token_ids)) for st, s in zip(starts, sampled)]
        glps = None
        if self.has_logprobs:
            ids_l, lps_l, ranks_l = (t.tolist() for t in host[-3:])
            glps = []
            for st, s, g in zip(starts, sampled, generated):
                k = s.request.sampling_params.logprobs
                glps.append(None if k is None else
                            [LogprobsEntry(ids_l[j][:k + 1], lps_l[j][:k + 1], ranks_l[j]) for j in range(st, st + len(g))])
            if all(g is None for g in glps):
                glps = None
        fed = [len(s.spec_token_ids) for s in sampled]
        self._out = ModelRunnerOutput([g[0] for g in generated], None, generated, glps, None,
                                      None if self.sched_drafts is None or fed == self.sched_drafts else fed)
        self._host = self._keepalive = None
        return self._out


class AsyncSpecRunnerOutput:
    """``AsyncModelRunnerOutput`` of a speculative step under async scheduling:
    ``get_output()`` first lets the runner finish the step (the proposer) if the next step
    has not already done so, then returns the verification's host results."""

    def __init__(self, runner, verification: _SpecVerification):
        self._runner, self._ver = runner, verification

    def ready(self) -> bool:
        return self._ver.ready()

    def get_output(self) -> ModelRunnerOutput:
        if self._runner._spec_pending is self._ver:
            self._runner._resolve_spec()
        return self._ver.result()


class ModelRunner:
    """``ModelRunner(config, tp_group=None)``: one rank's model, KV cache and step logic.
    With ``tp_group`` (a ``pyengine.distributed.GroupCoordinator``) rank 0's
    ``execute_model`` sends each step's inputs to the other ranks, whose
    ``execute_follower_step`` runs the same forward; only rank 0 samples. With speculative
    decoding a verification step is flagged as such, a model-based proposer's forwards
    follow as a draft plan every rank runs, and under async scheduling a verified step's
    newest tokens follow as a message (pyengine/worker/tp_follower.py)."""

    def __init__(self, config: EngineConfig, tp_group=None):
        self.config = config
        self.device = config.device
        self.tp = tp_group
        self.dims = model_dims(config.hf_config, tp_group.world_size if tp_group is not None else 1)
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        d = self.dims
        backend_cls = get_backend_cls(config.attention_backend)
        self.attn_backend = backend_cls(d.num_heads, d.num_kv_heads, d.head_dim, d.head_dim ** -0.5,
                                        config.block_size, config.dtype, config.device)
        t0 = time.perf_counter()
        self.model = load_model(config, self.attn_backend, tp_group)
        logger.info("Loaded %s in %.2f s", config.model, time.perf_counter() - t0)
        self.sampler = Sampler()
        # Speculative decoding: the proposer (pyengine/spec_decode) and the verifier.
        self.spec_config = config.speculative_config
        self.rejection_sampler = RejectionSampler()
        self.drafter = None
        self._step_hidden: torch.Tensor | None = None  # the step's hidden states, for the proposer
        self._step_inputs = None  # a speculative step's (input ids, sampled rows) for the proposer
        if self.spec_config is not None:
            from pyengine.spec_decode import make_proposer
            self.drafter = make_proposer(config, self)
        # Async scheduling with speculation (see the module docstring): the verification in
        # flight, each request's drafts (request id -> (epoch, position of the first draft,
        # drafts)), and per request of the last resolved step its rejected draft
        # placeholders and its generated tokens (for the next step's placeholder rows).
        self._async_spec = self.spec_config is not None and config.async_scheduling
        self._spec_pending: _SpecVerification | None = None
        self._drafts: dict[str, tuple[int, int, list[int]]] = {}
        self._spec_rejected: dict[str, int] = {}
        self._spec_generated: dict[str, list[int]] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.max_blocks_per_req = cdiv(config.max_model_len, config.block_size)
        self.sampling_state = SamplingState(self.device, self.dims.vocab_size)
        self._sender = TPStepSender(tp_group) if tp_group is not None else None
        if self.drafter is not None and tp_group is not None and tp_group.rank == 0:
            # a model-based proposer's forwards run on every rank (sharded): rank 0 sends them
            self.drafter.plan_sink = self._sender.send_draft_plan
        if self.drafter is not None and self._async_spec and tp_group is None:
            # a draft model's chain leaves its drafts on the device: the next step's inputs
            # gather them there (ranks > 1 get their inputs from rank 0's host bytes)
            self.drafter.device_drafts = True
        self._device_drafts: DeviceDrafts | None = None  # the drafts prev_sampled holds after its newest tokens
        # Async scheduling: the previous launch's sampled ids (device) and row per request.
        self.prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        self._deferred = None  # execute_model(defer_sampling=True) -> sample_tokens
        self.profiler: RankProfiler | None = None  # open between start_profile and stop_profile
        self._profile_windows = 0
        self._is_cuda = self.device.type == "cuda"
        self.graph_runner = None  # CUDAGraphRunner once captured (CUDA, triton backend, not enforce_eager)
        self.verify_graph_runner = None  # the same for uniform speculative verification steps
        # speculative steps of few decode rows are padded to this query length (the verify
        # graph's; 0: not padded), so that one with fewer drafts replays that graph too
        self.verify_pad_q = 0
        self.graph_capture_time_s = 0.0
        self._draft_ids_host: torch.Tensor | None = None  # (CUDA, speculation) a verification's draft ids
        if self._is_cuda:
            self._copy_stream = torch.cuda.Stream()
            self._pinned = [torch.empty(config.max_num_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._pinned_idx = 0
            if self.spec_config is not None:
                # reused every verification: the step waits for its results, so the copy
                # out of this buffer is done before the next one refills it
                n = config.max_num_seqs * (self.spec_config.num_speculative_tokens + 1)
                self._draft_ids_host = torch.empty(n, dtype=torch.int64, pin_memory=True)

    # ---- KV cache ------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        d = self.dims
        itemsize = torch.empty((), dtype=self.config.kv_cache_torch_dtype).element_size()
        own = 2 * d.num_layers * self.block_size * d.num_kv_heads * d.head_dim * itemsize
        # a draft model's KV lives in the same blocks (same block tables)
        return own + (self.drafter.kv_bytes_per_block() if self.drafter is not None else 0)

    def determine_num_blocks(self) -> int:
        """From num_gpu_blocks_override, kv_cache_memory_bytes, or (GPU) a profiling forward
        and gpu_memory_utilization; on CPU a fixed default. Raises ValueError if < 2 blocks fit."""
        c = self.config
        per_block = self.kv_bytes_per_block()
        if c.num_gpu_blocks_override is not None:
            return c.num_gpu_blocks_override + 1  # + the null block
        if c.kv_cache_memory_bytes is not None:
            n = c.kv_cache_memory_bytes // per_block
        elif self._is_cuda:
            n = self._profile_num_blocks(per_block)
        else:
            # Cap at what max_num_seqs full-length sequences could use.
            n = min(CPU_DEFAULT_KV_BYTES // per_block, c.max_num_seqs * self.max_blocks_per_req + 1)
        if n < 2:
            raise ValueError(f"Not enough memory for the KV cache: {n} blocks of {per_block} bytes fit.")
        return int(n)

    @torch.inference_mode()
    def _profile_num_blocks(self, per_block: int) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._dummy_run(self.config.max_num_batched_tokens)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        # Memory not owned by torch's allocator (other processes, CUDA context) stays out of reach.
        used_elsewhere = total - free - torch.cuda.memory_reserved()
        budget = total * self.config.gpu_memory_utilization - used_elsewhere - peak
        logger.info("Profiling: peak %.2f GiB, KV cache budget %.2f GiB", peak / 2**30, budget / 2**30)
        return int(budget // per_block)

    def _dummy_run(self, num_tokens: int) -> None:
        """A forward over num_tokens tokens in requests of up to 1024 tokens, writing no KV."""
        c = self.config
        # Empty caches: backends then attend over each request's own rows and write nothing.
        dummy_caches = [torch.empty(0, dtype=c.dtype, device=self.device) for _ in range(self.dims.num_layers)]
        self.model.bind_kv_caches(dummy_caches)
        lens = []
        left = num_tokens
        while left > 0:
            lens.append(min(left, 1024, c.max_model_len))
            left -= lens[-1]
        self._dummy_forward(lens, logits_rows=min(num_tokens, c.max_num_seqs))
        del dummy_caches

    def _dummy_forward(self, lens: list[int], logits_rows: int = 0) -> None:
        """One forward over requests of the given query lengths (tokens) with no cached
        context; slot mapping -1, so no KV is written. With caches bound, attention reads
        the null block (block 0) through an all-zero block table."""
        num_tokens = sum(lens)
        qsl = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32)
        seq = torch.tensor(lens, dtype=torch.int32)
        width = cdiv(max(lens), self.block_size)
        meta = AttentionMetadata(num_tokens, len(lens), max(lens), max(lens), qsl.to(self.device), seq.to(self.device),
                                 torch.zeros(len(lens), width, dtype=torch.int32, device=self.device),
                                 torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device), qsl, seq)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        hidden = self.model(ids, pos, meta)
        if logits_rows:
            self.model.compute_logits(hidden[:logits_rows])

    @torch.inference_mode()
    def _warm_up_kernels(self) -> float:
        """Compile, at start-up, every triton kernel variant a prefill or mixed step can
        pick: the extend kernel's query tile (BLOCK_T, a compile-time constant) follows the
        longest query of the step, so a cold variant would otherwise compile mid-serving and
        stall that step for seconds. Returns seconds."""
        t0 = time.perf_counter()
        for n in (2, 3, 5, 9, 17, 33, 65):  # every power-of-two tile (see _extend in ops/paged_attention.py)
            self._dummy_forward([min(n, self.config.max_model_len)])
        warm_model = getattr(self.model, "warm_up_kernels", None)  # a model's own variants (fused MoE tiles)
        if warm_model is not None:
            warm_model(self.config.max_num_batched_tokens)
        if self._is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def initialize_kv_cache(self, num_blocks: int | None = None) -> int:
        """Allocate the paged KV cache of ``num_blocks`` blocks (None: ``determine_num_blocks()``),
        warm up kernels, capture CUDA graphs; returns the number of blocks (block 0 = null
        block). Tensor-parallel ranks call it together (the warm-ups run collectives)."""
        n = num_blocks if num_blocks is not None else self.determine_num_blocks()
        d = self.dims
        self.kv_caches = [torch.zeros(2, n, self.block_size, d.num_kv_heads, d.head_dim,
                                      dtype=self.config.kv_cache_torch_dtype, device=self.device)
                          for _ in range(d.num_layers)]
        self.model.bind_kv_caches(self.kv_caches)
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(n)
        self.num_blocks = n
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", n, self.block_size,
                    n * self.kv_bytes_per_block() / 2**20)
        if self._is_cuda and self.config.attention_backend == "triton":
            logger.info("Warmed up prefill kernels in %.2f s", self._warm_up_kernels())
        graphs_ok = self.drafter is None or self.drafter.allows_cuda_graphs
        if self._is_cuda and not self.config.enforce_eager and self.config.attention_backend == "triton" and graphs_ok:
            from pyengine.worker.cuda_graph import CUDAGraphRunner
            # Another thread (NCCL's watchdog) may query events while a rank captures.
            mode = "global" if self.tp is None else "thread_local"
            self.graph_runner = CUDAGraphRunner(self.model, self.attn_backend, self.config.max_num_seqs,
                                                self.max_blocks_per_req, self.config.max_model_len, self.device,
                                                capture_error_mode=mode)
            self.graph_capture_time_s = self.graph_runner.capture()
            spec = self.spec_config
            if spec is not None:
                # verification steps where every request carries all k drafts (batch 1 with
                # a hit, and small batches: disable_by_batch_size turns larger ones off)
                top = min(self.config.max_num_seqs, 64, (spec.disable_by_batch_size or 65) - 1)
                if top >= 1:
                    self.verify_graph_runner = CUDAGraphRunner(
                        self.model, self.attn_backend, top, self.max_blocks_per_req, self.config.max_model_len,
                        self.device, capture_error_mode=mode, query_len=1 + spec.num_speculative_tokens)
                    self.graph_capture_time_s += self.verify_graph_runner.capture()
                    # (EAGLE-3 reads the step's hidden states row by row: it captures no graphs)
                    self.verify_pad_q = self.verify_graph_runner.query_len
            if self.drafter is not None:
                self.graph_capture_time_s += self.drafter.capture_cuda_graphs(mode)
        return n

    # ---- one step ------------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput):
        """Build the step's inputs (``step_codec.pack_step``); with tensor parallelism also send
        them to the other ranks first. Returns (input ids [T], positions [T],
        AttentionMetadata, rows to sample from [S] or None when every row samples)."""
        prof = self.profiler
        if prof is not None:
            prof.phase("pack")
        pad = self.verify_pad_q if so.speculative else 0
        step = pack_step(so, self.block_size, self._prev_rows, pad, self.config.max_model_len)
        if self._sender is not None:
            if prof is not None:
                prof.phase("send")
            self._sender.send_step(step, verify=self.drafter is not None and so.speculative)
        if prof is not None:
            prof.phase("prepare")
        return self.step_tensors(step)

    def step_tensors(self, step: PackedStep):
        """Copy a packed step to the device (two copies) and fill the placeholder rows from
        the previous step's sampled ids. Returns (ids, positions, meta, sample rows or None)."""
        sh, dev = step.shape, self.device
        T, R, P, S = sh.num_tokens, sh.num_reqs, sh.num_placeholders, sh.num_sampled
        d64 = torch.from_numpy(step.buf64).to(dev, non_blocking=True)
        d32 = torch.from_numpy(step.buf32).to(dev, non_blocking=True)
        ids_t = d64[:T]
        if P:
            o, p2 = sh.placeholder_offset, sh.placeholders_padded
            ids_t[d64[o:o + P]] = self.prev_sampled[d64[o + p2:o + p2 + P]]
        host32 = torch.from_numpy(step.buf32)
        seq = sh.seq_lens_offset
        meta = AttentionMetadata(
            num_actual_tokens=T, num_reqs=R, max_query_len=sh.max_query_len, max_seq_len=sh.max_seq_len,
            query_start_loc=d32[:R + 1], seq_lens=d32[seq:seq + R],
            block_table=d32[sh.block_table_offset:].view(R, sh.max_blocks),
            slot_mapping=d64[sh.slot_mapping_offset:sh.slot_mapping_offset + T],
            query_start_loc_cpu=host32[:R + 1], seq_lens_cpu=host32[seq:seq + R])
        rows_t = d64[sh.sample_rows_offset:sh.sample_rows_offset + S] if S and S != T else None
        return ids_t, d64[sh.positions_offset:sh.positions_offset + T], meta, rows_t

    # ---- tensor parallelism (pyengine/worker/tp_follower.py) ---------------------------
    def broadcast_stop(self) -> None:
        """Rank 0: tell the other ranks' ``execute_follower_step`` loops to return False."""
        self._sender.send_stop()

    def execute_follower_step(self) -> bool:
        """Ranks > 0: receive rank 0's next step and run the same forward. Returns False
        when rank 0 sent stop."""
        return follow_one_step(self)

    # ---- profiling windows (pyengine/worker/profiler.py) ---------------------------------
    def start_profile(self, out_dir: str, trace: bool = True) -> None:
        """Open a profiling window on every rank (rank 0 calls it between steps): host
        time per step phase, and with ``trace`` a torch.profiler trace; ``stop_profile``
        writes each rank's files into ``out_dir``. Raises RuntimeError if one is open."""
        if self.profiler is not None:
            raise RuntimeError("a profiling window is already open")
        if self._sender is not None:
            self._sender.send_profile_start(out_dir, trace)
        self.open_profile(out_dir, trace)

    def stop_profile(self) -> dict:
        """Close the window on every rank; returns rank 0's summary once every rank has
        written its files. Raises RuntimeError if none is open."""
        if self.profiler is None:
            raise RuntimeError("no profiling window is open")
        if self._sender is not None:
            self._sender.send_profile_stop()
        summary, self.profiler = self.profiler.stop(), None
        if self.tp is not None:
            self.tp.barrier()  # the other ranks' files are written
        return summary

    def open_profile(self, out_dir: str, trace: bool) -> None:
        rank = self.tp.rank if self.tp is not None else 0
        self.profiler = RankProfiler(rank, out_dir, self._profile_windows, trace, self.device)
        self._profile_windows += 1

    def close_profile(self) -> None:
        """A follower's window ends (its files written)."""
        if self.profiler is not None:
            self.profiler, prof = None, self.profiler
            prof.stop()

    def forward(self, ids, pos, meta) -> torch.Tensor:
        """The model's forward: a captured CUDA graph for a decode batch it covers."""
        if (self.graph_runner is not None and meta.max_query_len == 1
                and meta.num_reqs <= self.graph_runner.max_batch_size):
            return self.graph_runner.run(ids, pos, meta)
        vg = self.verify_graph_runner
        if vg is not None and vg.covers(meta):
            return vg.run(ids, pos, meta)
        return self.model(ids, pos, meta)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, non_blocking: bool = False, grammar_output=None,
                      defer_sampling: bool = False):
        """Run one step. Returns ModelRunnerOutput, or AsyncModelRunnerOutput when
        non_blocking (async scheduling).

        ``grammar_output`` (a ``pyengine.structured_output.GrammarOutput``): the token
        bitmask of the constrained rows, applied to the logits (on their device) before
        sampling. ``defer_sampling``: run the forward and the logits only and return None;
        ``sample_tokens(grammar_output)`` samples later (vLLM's split), so the host can fill
        the bitmask, which needs the previous step's tokens, while the device runs this
        step's forward."""
        pending = None
        sched_drafts = None
        if self._async_spec:
            if self._spec_pending is not None:
                self._resolve_spec()  # the previous step's proposer, before anything of this one
            for ids in (so.finished_req_ids, so.preempted_req_ids):
                for rid in ids:
                    self._drafts.pop(rid, None)
            if so.speculative:
                sched_drafts = [len(s.spec_token_ids) for s in so.scheduled if s.sample]
                so, pending = self._fill_drafts(so)
            else:
                self._spec_rejected, self._spec_generated = {}, {}
        self.sampling_state.forget(so.finished_req_ids)
        if self.drafter is not None:
            self.drafter.forget(so.finished_req_ids)
            self._last_so = so
        # All host-side preparation (inputs and sampling metadata) comes before the first
        # kernel of the step, so the step reaches the GPU as one burst of launches.
        ids, pos, meta, rows_t = self._prepare_inputs(so)
        sampled = [s for s in so.scheduled if s.sample]
        ph_flags = [s.placeholder_input for s in sampled]
        spec = self.drafter is not None and so.speculative
        meta_s = self.sampling_state.metadata(sampled, ph_flags, spec, pending) if sampled else None
        if meta_s is not None and meta_s.seeds:  # seeded rows draw by (seed, position)
            meta_s.positions = pos if rows_t is None else pos[rows_t]
        self._sched_drafts = sched_drafts
        prof = self.profiler
        if prof is not None:
            prof.phase("forward")
        hidden = self.forward(ids, pos, meta)
        if spec:
            self._step_hidden = hidden
            self._step_inputs = (ids, rows_t)  # (for the proposer's early launch)
            if not sampled:  # a prefill chunk: the proposer still writes its own KV
                self.drafter.propose(so, [], [], hidden)
                self._step_hidden = self._step_inputs = None
        if not sampled:
            out = (ModelRunnerOutput([], None) if not non_blocking
                   else AsyncModelRunnerOutput(None, torch.empty(0, dtype=torch.int64), None, None))
        else:
            if prof is not None:
                prof.phase("logits")
            if rows_t is not None:  # only the last row of each sampling request
                hidden = hidden[rows_t]
            logits = self.model.compute_logits(hidden)
            if defer_sampling:
                self._deferred = (logits, sampled, ph_flags, meta_s, non_blocking)
                if prof is not None:
                    prof.end_step()
                return None
            if prof is not None:
                prof.phase("sample")
            out = self._sample(logits, sampled, ph_flags, meta_s, non_blocking, grammar_output)
        if prof is not None:
            prof.end_step()
        if defer_sampling:
            self._deferred = out
            return None
        return out

    @torch.inference_mode()
    def sample_tokens(self, grammar_output=None):
        """Finish the step that ``execute_model(..., defer_sampling=True)`` started: apply
        ``grammar_output``'s bitmask and sample. Returns what ``execute_model`` would have."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            raise RuntimeError("sample_tokens without a deferred execute_model")
        if not isinstance(deferred, tuple):
            return deferred  # the step sampled no row
        return self._sample(*deferred, grammar_output)

    def _sample(self, logits: torch.Tensor, sampled, ph_flags, meta_s, non_blocking: bool, grammar_output):
        """Sample the step's rows from ``logits`` float32 [S, V] (device)."""
        if self.drafter is not None and self._last_so.speculative:
            return self._sample_spec(logits, sampled, meta_s, grammar_output, non_blocking)
        if grammar_output is not None:
            from pyengine.structured_output.backend_xgrammar import apply_token_bitmask
            bitmask = grammar_output.bitmask[:len(sampled)].to(self.device, non_blocking=True)
            apply_token_bitmask(logits, bitmask, grammar_output.rows)
        if (not meta_s.no_penalties or meta_s.need_last_token_ids) and any(ph_flags):
            # the placeholders' tokens: the previous step's sampled ids, still on the device
            rows = [i for i, f in enumerate(ph_flags) if f]
            idx = torch.tensor([rows, [self._prev_rows[sampled[i].request.request_id] for i in rows]],
                               pin_memory=self._is_cuda).to(self.device, non_blocking=True)
            toks = self.prev_sampled[idx[1]]
            if not meta_s.no_penalties:
                meta_s.output_token_counts.index_put_(
                    (idx[0], toks),
                    torch.ones(len(rows), dtype=meta_s.output_token_counts.dtype, device=self.device), accumulate=True)
            if meta_s.need_last_token_ids:  # bad words and the thinking budget compare it
                meta_s.last_token_ids = torch.full((len(sampled),), -1, dtype=torch.int64,
                                                   device=self.device).index_put_((idx[0],), toks)
        out = self.sampler(logits, meta_s)
        tokens = out.sampled_token_ids
        if self.tp is not None and self.config.async_scheduling:
            if self.profiler is not None:
                self.profiler.phase("token_bcast")
            self.tp.broadcast(tokens)  # the other ranks feed placeholders from them too
        self.prev_sampled = tokens
        self._prev_rows = {s.request.request_id: i for i, s in enumerate(sampled)}
        k_per_row = [s.request.sampling_params.logprobs for s in sampled]
        lp_host = None
        if out.logprobs is not None:
            lp_host = (out.logprobs_token_ids.to("cpu", non_blocking=True), out.logprobs.to("cpu", non_blocking=True),
                       out.sampled_token_ranks.to("cpu", non_blocking=True))

        def logprobs_fn():
            if lp_host is None:
                return None
            ids_l, lps_l, ranks_l = (t.tolist() for t in lp_host)
            return [None if k is None else LogprobsEntry(ids_l[i][:k + 1], lps_l[i][:k + 1], ranks_l[i])
                    for i, k in enumerate(k_per_row)]

        if not self._is_cuda:
            return AsyncModelRunnerOutput(None, tokens, logprobs_fn, None) if non_blocking else \
                ModelRunnerOutput(tokens.tolist(), logprobs_fn())
        if not non_blocking:
            return ModelRunnerOutput(tokens.tolist(), logprobs_fn())
        buf = self._pinned[self._pinned_idx][: len(sampled)]
        self._pinned_idx ^= 1
        self._copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._copy_stream):
            buf.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return AsyncModelRunnerOutput(event, buf, logprobs_fn, tokens)

    def _sample_spec(self, logits: torch.Tensor, sampled, meta_s, grammar_output, non_blocking: bool = False):
        """Speculative decoding: verify each sampled request's drafts on its 1 + k rows of
        ``logits`` (float32 [N, V]) with the rejection sampler. Sync scheduling: wait for
        the result, let the proposer draft the next step's tokens, return the
        ``ModelRunnerOutput``. Async scheduling: return an ``AsyncSpecRunnerOutput`` and
        keep the verification pending; the next step (or the engine consuming this one)
        resolves it (``_resolve_spec``). Constrained requests carry no drafts (one row
        each), so the grammar bitmask applies to their single row."""
        starts, n_rows = [], 0
        for s in sampled:
            starts.append(n_rows)
            n_rows += len(s.spec_token_ids) + 1
        greedy = meta_s.all_greedy
        # (greedy: the drafts' values are read on the host with the verification's result,
        # so device drafts are not waited for here)
        draft_ids = None if greedy else _draft_rows(sampled)
        if grammar_output is not None:
            from pyengine.structured_output.backend_xgrammar import apply_token_bitmask
            rows = [starts[r] for r in grammar_output.rows]
            full = torch.zeros(n_rows, grammar_output.bitmask.shape[1], dtype=grammar_output.bitmask.dtype)
            full[rows] = grammar_output.bitmask[grammar_output.rows]
            apply_token_bitmask(logits, full.to(self.device, non_blocking=True), rows)
        if greedy:  # the drafts stay on the host: a greedy row accepts its draft when it is the argmax
            d_dev = None
        elif self._draft_ids_host is not None:
            if self._async_spec:  # (a buffer per step: the previous step's may still be in use)
                d_host = torch.tensor(draft_ids, dtype=torch.int64).pin_memory()
            else:
                d_host = self._draft_ids_host[:len(draft_ids)]
                d_host.numpy()[:] = draft_ids
            d_dev = d_host.to(self.device, non_blocking=True)
        else:
            d_dev = torch.tensor(draft_ids, dtype=torch.int64, device=self.device)
        out = self.rejection_sampler(logits, meta_s, d_dev)
        dev = [out.candidate] if greedy else [out.candidate, out.accepted]
        lp = [out.logprobs_token_ids, out.logprobs, out.ranks] if out.logprobs is not None else []
        sched = self._sched_drafts if self._async_spec else None
        ver = _SpecVerification(self, self._last_so, sampled, starts, draft_ids, greedy, dev, lp,
                                sched, self._step_hidden, non_blocking and self._async_spec)
        self._step_hidden = None
        inputs, self._step_inputs = self._step_inputs, None
        if self._async_spec:
            if inputs is not None:
                # the next proposal starts on the device now, the result's copy already queued
                ids, rows_t = inputs
                self.drafter.propose_early(self._last_so, sampled, starts, ids if rows_t is None else ids[rows_t],
                                           out.candidate, out.accepted)
            self._spec_pending = ver
            return AsyncSpecRunnerOutput(self, ver) if non_blocking else AsyncSpecRunnerOutput(self, ver).get_output()
        res = ver.result()
        res.draft_token_ids = self._propose(ver, res.generated_token_ids)
        return res

    def _propose(self, ver: _SpecVerification, generated) -> list[list[int]]:
        """The proposer's drafts after the verified step ``ver`` (one list per sampled row),
        padded to k for a CUDA-graph verification (fewer than k drafts: the last one
        repeated, so that the next verification is uniform and replays a graph; a padded
        draft is verified like any other)."""
        if self.profiler is not None:  # the proposer's share of a step (the last thing a step does)
            self.profiler.phase("propose")
        drafts = self.drafter.propose(ver.so, ver.sampled, generated, ver.hidden)
        vg = self.verify_graph_runner
        if vg is not None:
            k = vg.query_len - 1
            # (device drafts cut short by their room are not padded: nothing would verify
            # them, the scheduler cuts drafts to the room; the step's rows are padded instead)
            drafts = [d + [d[-1]] * (k - len(d)) if 0 < len(d) < k and not isinstance(d, DraftRow) else d
                      for d in drafts]
        return drafts

    def _resolve_spec(self) -> None:
        """Async scheduling: finish the pending speculative step N. Waits for its
        verification's copy to the host, runs the proposer on its result (every request
        still holds its tokens before step N: the engine has not consumed N yet), and keeps
        what step N+1 needs: each request's drafts, stamped with its epoch and the position
        of the first draft, its rejected draft placeholders and its generated tokens, and
        (as ``prev_sampled``) its newest token, fed into N+1's placeholder rows."""
        ver, self._spec_pending = self._spec_pending, None
        if ver is None:
            return
        res = ver.result()
        gen = res.generated_token_ids
        drafts = self._propose(ver, gen)
        store = self._drafts
        sched = ver.sched_drafts
        rejected, generated, rows = {}, {}, {}
        for i, (s, g, d) in enumerate(zip(ver.sampled, gen, drafts)):
            rid = s.request.request_id
            # the token before the drafts sat at start + n - 1 - k; g took the positions after it
            newest = s.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids) - 1 + len(g)
            store[rid] = (s.epoch, newest + 1, d)
            rejected[rid] = (sched[i] if sched is not None else len(s.spec_token_ids)) - (len(g) - 1)
            generated[rid] = g
            rows[rid] = i
        self._spec_rejected, self._spec_generated = rejected, generated
        newest = [g[-1] for g in gen]
        if self._sender is not None:  # the other ranks' placeholders take them too
            self._sender.send_tokens(newest)
        newest_t = torch.tensor(newest, dtype=torch.int64).to(self.device, non_blocking=True)
        dd = next((d.drafts for d in drafts if isinstance(d, DraftRow)), None)
        if dd is not None:  # the gather source: the newest tokens, then the device drafts row by row
            dd.base = len(newest)
            newest_t = torch.cat((newest_t, dd.tokens.reshape(-1)))
        self.prev_sampled, self._device_drafts = newest_t, dd
        self._prev_rows = rows

    def _fill_drafts(self, so: SchedulerOutput) -> tuple[SchedulerOutput, dict]:
        """Async scheduling, a speculative step: the step the runner runs for ``so``. A row
        whose newest token is a placeholder moves back by the drafts its previous step
        rejected (the scheduler assumed them accepted); each row's draft placeholders take
        the drafts proposed at its position (fewer, or none, when the proposer gave fewer
        or its drafts are stale). Returns (that ``SchedulerOutput``, request id -> the
        tokens the previous step gave each placeholder row, for the sampling metadata).
        Raises RuntimeError for a placeholder row the last resolved step did not sample
        (an engine bug: the steps would be misplaced)."""
        rej, gen, store = self._spec_rejected, self._spec_generated, self._drafts
        pending: dict = {}
        out: list[ScheduledRequest] = []
        total = 0
        for s in so.scheduled:
            k = len(s.spec_token_ids)
            if s.placeholder_input or k:
                rid = s.request.request_id
                start = s.num_computed_tokens
                if s.placeholder_input:
                    if rid not in rej:
                        raise RuntimeError(f"request {rid}: a placeholder input without a resolved speculative step")
                    start -= rej[rid]
                    pending[rid] = gen[rid]
                d: list[int] = []
                if k:
                    e = store.get(rid)
                    if e is not None and e[0] == s.epoch and e[1] == start + 1:
                        d = e[2]
                        if isinstance(d, DraftRow) and d.drafts is not self._device_drafts:
                            d = list(d)  # (an older step's device drafts: no longer in the gather source)
                        d = d[:k]
                s = ScheduledRequest(s.request, s.num_new_tokens - k + len(d), start, s.block_ids, s.sample,
                                     s.placeholder_input, s.epoch, d)
            out.append(s)
            total += s.num_new_tokens
        return replace(so, scheduled=out, total_num_scheduled_tokens=total), pending

    def release(self) -> None:
        """Drop the model, KV cache, CUDA graphs and per-step device state so their memory
        can go back to the device (the runner is unusable afterwards)."""
        if self.model is not None and self.kv_caches:
            self.model.bind_kv_caches([None] * len(self.kv_caches))
        self.graph_runner = None
        self.verify_graph_runner = None
        self.drafter = None
        self._spec_pending = None
        self._drafts.clear()
        self.kv_caches = []
        self.model = None
        self.prev_sampled = None
        self.sampling_state.clear()
        if self._is_cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
