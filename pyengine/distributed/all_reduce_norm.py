"""All-reduce fused with the residual add and RMSNorm that follow it, over symmetric memory
(the role of vLLM's all-reduce + RMSNorm fusion, vllm/compilation/collective_fusion.py,
which calls FlashInfer's TensorRT-LLM kernel; this one is a Triton kernel of our own).

Where it pays: batch-1 decode with tensor parallelism. A row-parallel linear's output
(8 KB per token for a 4096-wide model) is summed over the ranks and then added to the
residual stream and normalised, 64 times a step for a 32-layer model. Unfused, that is
an all-reduce kernel (~7 us on two H200s, most of it barriers over NVLink) and a norm
kernel (~2 us); fused, one kernel of ~4 us (benchmarks/all_reduce_norm.py).

The exchange is a low-latency ("LL") protocol, as NCCL's LL: every 4-byte word of a
rank's partial sum travels to each peer in an 8-byte store together with the call's
epoch, so a receiver knows a word has arrived when it reads this call's epoch next to it.
No fence, no flag, no barrier round trip: one one-way NVLink latency per call.

Each program (at most ``MAX_PROGRAMS``; a program takes every n-th row) owns, per rank,
a call counter (the epoch) and, per sender, two halves of a receive slot, used by
alternate calls (``epoch & 1``). A rank can only write call m's words into the half call
m-2 used after it has received call m-1's words from every peer, which a peer sends only
once it has finished call m-2. So the slots are safe to reuse with no second barrier,
whatever the calls' sizes and order, as long as every rank makes the same calls with the
same shapes (the rule for any collective).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

# At most this many programs per call, each with its own counter and slots. More rows than
# programs: a program takes every MAX_PROGRAMS-th row. Keeps every program resident at once
# on both GPUs (they spin on each other).
MAX_PROGRAMS = 64
_COUNTERS_BYTES = 4096  # MAX_PROGRAMS int32 epochs at the start of the buffer (one page)


def symm_mem_buffer(numel: int, dtype: torch.dtype, device: torch.device, group_name: str):
    """A symmetric-memory tensor of ``numel`` elements on every rank of the group and its
    rendezvous handle (peer addresses). Collective. Raises where torch or the machine
    cannot do it."""
    import torch.distributed._symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed before torch 2.9
    if enable is not None:
        enable(group_name)
    buf = symm_mem.empty(numel, dtype=dtype, device=device)
    return buf, symm_mem.rendezvous(buf, group_name)


@triton.jit
def _ll_words_to_values(words, dt: tl.constexpr, BLOCK: tl.constexpr, PAIRS: tl.constexpr):
    """uint32 words [BLOCK_W] -> their elements as float32 [BLOCK], in memory order."""
    if PAIRS:  # two 16-bit elements per word, the first in the low half
        lo = (words & 0xFFFF).to(tl.uint16).to(dt, bitcast=True)
        hi = (words >> 16).to(tl.uint16).to(dt, bitcast=True)
        return tl.reshape(tl.join(lo, hi), [BLOCK]).to(tl.float32)
    else:
        return words.to(dt, bitcast=True).to(tl.float32)


@triton.jit(do_not_specialize=["rank"])
def _all_reduce_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, bases_ptr,
                                    rank, rows, eps,
                                    WORLD: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr,
                                    HW: tl.constexpr, BLOCK_W: tl.constexpr, PAIRS: tl.constexpr,
                                    DATA_OFF: tl.constexpr, SLOT_WORDS: tl.constexpr, MAX_PROG: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dt = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    ow = tl.arange(0, BLOCK_W)
    mw = ow < HW
    # This program's call count: a counter in this rank's buffer that only program `pid`
    # touches; every rank's advances alike (same calls, same grids).
    local = tl.load(bases_ptr + rank)
    counter = local.to(tl.pointer_type(tl.int32)) + pid
    epoch = tl.load(counter) + 1
    tl.store(counter, epoch)
    epoch_u32 = epoch.to(tl.uint32, bitcast=True)
    flag = epoch_u32.to(tl.uint64) << 32
    # slot [half][sender][program]: this program's rows, one after another
    half = (epoch & 1) * WORLD
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32))
    for row in range(pid, rows, nprog):
        entry = flag | tl.load(xw_ptr + row * HW + ow, mask=mw, other=0).to(tl.uint64)
        at = ((half + rank) * MAX_PROG + pid) * SLOT_WORDS + (row // nprog) * HW
        for r in tl.static_range(WORLD):
            if r != rank:
                dst = (tl.load(bases_ptr + r) + DATA_OFF).to(tl.pointer_type(tl.uint64))
                tl.store(dst + at + ow, entry, mask=mw)
    recv = (local + DATA_OFF).to(tl.pointer_type(tl.uint64))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, rows, nprog):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):  # rank order: every rank sums the same way
            if r == rank:
                v = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                src = recv + ((half + r) * MAX_PROG + pid) * SLOT_WORDS + (row // nprog) * HW + ow
                # volatile: past L1, which does not see the peer's stores; spin until every
                # word carries this call's epoch
                e = tl.load(src, mask=mw, other=0, volatile=True)
                while tl.min(((e >> 32).to(tl.uint32) == epoch_u32) | (ow >= HW), 0) == 0:
                    e = tl.load(src, mask=mw, other=0, volatile=True)
                v = _ll_words_to_values(e.to(tl.uint32), dt, BLOCK, PAIRS)
            acc += v
        res = tl.load(res_ptr + row * H + offs, mask=mask, other=0.0)
        s = (acc.to(dt).to(tl.float32) + res.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row * H + offs, s, mask=mask)
        sf = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, 0) / H + eps)
        y = (sf * rstd).to(dt).to(tl.float32) * w
        tl.store(out_ptr + row * H + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


class AllReduceRMSNorm:
    """``(x, residual, weight, eps) -> (rms_norm(sum_ranks(x) + residual), sum_ranks(x) +
    residual)`` in one kernel, for ``x`` of up to ``max_bytes`` (this rank's partial sum).

    x, residual: [T, hidden] contiguous, ``dtype`` (any float dtype; hidden x itemsize a
    multiple of 4 bytes); weight: [hidden]. Returns two new [T, hidden] tensors of
    ``dtype``; numerically the unfused all-reduce (the sum rounded to ``dtype``; ranks
    added in rank order) followed by ``fused_add_rms_norm``. CUDA-graph capturable.
    Collective: every rank calls it with the same shapes in the same order.

    Allocates 4 KB + 4 x world x ``max_bytes`` of symmetric memory per rank (two halves,
    each word doubled). Raises RuntimeError/AttributeError where torch or the machine
    cannot set it up.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 max_bytes: int, rank: int, world_size: int):
        self.rank, self.world_size, self.dtype = rank, world_size, dtype
        self.slot_words = max_bytes // 4 // MAX_PROGRAMS  # words a program can receive per sender
        nbytes = _COUNTERS_BYTES + 2 * world_size * MAX_PROGRAMS * self.slot_words * 8
        self.buffer, handle = symm_mem_buffer(nbytes, torch.uint8, device, group.group_name)
        self.buffer.zero_()  # epochs start at 0, and no stale word may carry a later epoch
        self.bases = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        # Zeroed before any peer writes here: the caller meets the other ranks (a CPU-side
        # collective) after this returns.
        torch.cuda.synchronize(device)

    def accepts(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        if not (x.dtype == self.dtype and x.is_cuda and x.dim() == 2 and x.is_contiguous()
                and residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()):
            return False
        rows, hidden = x.shape
        row_words, rem = divmod(hidden * x.element_size(), 4)
        per_program = -(-rows // max(1, min(rows, MAX_PROGRAMS)))
        return rem == 0 and hidden <= 16384 and per_program * row_words <= self.slot_words

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        rows, hidden = x.shape
        out = torch.empty_like(x)
        res_out = torch.empty_like(x)
        if rows == 0:
            return out, res_out
        block = triton.next_power_of_2(hidden)
        hw = hidden * x.element_size() // 4
        _all_reduce_add_rms_norm_kernel[(min(rows, MAX_PROGRAMS),)](
            x, residual, weight, out, res_out, self.bases, self.rank, rows, float(eps),
            WORLD=self.world_size, H=hidden, BLOCK=block, HW=hw, BLOCK_W=triton.next_power_of_2(hw),
            PAIRS=x.element_size() == 2, DATA_OFF=_COUNTERS_BYTES, SLOT_WORDS=self.slot_words,
            MAX_PROG=MAX_PROGRAMS,
            # as the unfused norm (ops/fused.py), so its sum of squares is likely split alike
            num_warps=8 if block >= 4096 else (4 if block >= 1024 else 1))
        return out, res_out

