"""All-reduce fused with the residual add and RMSNorm that follow it, over symmetric memory
(the role of vLLM's all-reduce + RMSNorm fusion, vllm/compilation/collective_fusion.py,
which calls FlashInfer's TensorRT-LLM kernel; this one is a Triton kernel of our own).

Where it pays: batch-1 decode with tensor parallelism. A row-parallel linear's output
(8 KB per token for a 4096-wide model) is summed over the ranks and then added to the
residual stream and normalised, 64 times a step for a 32-layer model. Unfused, that is
an all-reduce kernel (~7 us on two H200s, most of it two barriers over NVLink) and a
norm kernel (~2 us). Fused, it is one kernel with one barrier:

1. each program *pushes* its rows of this rank's partial sum into every rank's receive
   buffer (its own included) with plain stores over NVLink;
2. it meets the same program of every other rank at a flag barrier (thread ``r`` of the
   program sets its flag in rank ``r``'s pad with a release CAS 0 -> 1, and takes rank
   ``r``'s flag in its own pad with an acquire CAS 1 -> 0; the flags reset themselves);
3. it sums the received rows in rank order (every rank gets the same bits), adds the
   residual, normalises, and writes both results.

The receive buffers alternate between two halves from one call to the next, so no second
barrier is needed: a rank can only write call k+2's rows into the half call k used after
every peer has passed call k+1's barrier, which a peer does only once it has finished
call k. This holds when every rank makes the same calls in the same order, and each
forward pass makes an even number of them (two per decoder layer), so a CUDA graph
captured at any point replays the same alternation as eager calls.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import triton
import triton.language as tl

# At most this many programs per call, each with its own flag slot per rank. More rows than
# programs: a program takes every MAX_PROGRAMS-th row. Keeps every program resident at once
# on both GPUs (they spin on each other).
MAX_PROGRAMS = 64
_FLAGS_BYTES = 4096  # [MAX_PROGRAMS][world <= 16] int32 flags at the start of the buffer

# Thread r < world of a program: release-CAS the flag [slot][rank] in rank r's pad 0 -> 1
# (spinning while r has not yet taken the previous one), then acquire-CAS the flag
# [slot][r] in this rank's pad 1 -> 0 (spinning until r has set it). Scalar operands, so
# every thread runs the block once; the other threads skip it. $1: address of the device
# table of every rank's buffer base (u64), $2: rank, $3: slot (program id), $4: world.
_BARRIER_PTX = tl.constexpr("""
{
.reg .u32 %bt, %bold, %bidx;
.reg .u64 %ba, %bb, %boff;
.reg .pred %bp;
mov.u32 %bt, %tid.x;
setp.ge.u32 %bp, %bt, $4;
@%bp bra BARRIER_DONE;
mul.wide.u32 %boff, %bt, 8;
add.u64 %ba, $1, %boff;
ld.global.u64 %bb, [%ba];
mad.lo.u32 %bidx, $3, $4, $2;
mul.wide.u32 %boff, %bidx, 4;
add.u64 %bb, %bb, %boff;
BARRIER_SEND:
atom.global.release.sys.cas.b32 %bold, [%bb], 0, 1;
setp.ne.u32 %bp, %bold, 0;
@%bp bra BARRIER_SEND;
mul.wide.u32 %boff, $2, 8;
add.u64 %ba, $1, %boff;
ld.global.u64 %bb, [%ba];
mad.lo.u32 %bidx, $3, $4, %bt;
mul.wide.u32 %boff, %bidx, 4;
add.u64 %bb, %bb, %boff;
BARRIER_WAIT:
atom.global.acquire.sys.cas.b32 %bold, [%bb], 1, 0;
setp.ne.u32 %bp, %bold, 1;
@%bp bra BARRIER_WAIT;
BARRIER_DONE:
mov.u32 $0, 0;
}
""")


@triton.jit(do_not_specialize=["bases_addr", "rank", "world", "parity"])
def _all_reduce_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, bases_ptr, bases_addr,
                                    rank, world, parity, rows, eps,
                                    WORLD: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr,
                                    DATA_OFF: tl.constexpr, SLOT_NUMEL: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    dt = x_ptr.dtype.element_ty
    slot = (parity * WORLD + rank) * SLOT_NUMEL
    for row in range(pid, rows, nprog):
        x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0)
        for r in tl.static_range(WORLD):
            dst = (tl.load(bases_ptr + r) + DATA_OFF).to(tl.pointer_type(dt)) + slot + row * H
            tl.store(tl.multiple_of(dst, 16) + offs, x, mask=mask)
    tl.debug_barrier()  # every thread's stores issued before this program's release
    tl.inline_asm_elementwise(_BARRIER_PTX, "=r,l,r,r,r", [bases_addr, rank, pid, world],
                              dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()  # the acquire (by threads < world) before any thread reads
    recv = (tl.load(bases_ptr + rank) + DATA_OFF).to(tl.pointer_type(dt)) + parity * WORLD * SLOT_NUMEL
    recv = tl.multiple_of(recv, 16)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, rows, nprog):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            # volatile: past L1, which does not see the peers' stores
            acc += tl.load(recv + r * SLOT_NUMEL + row * H + offs, mask=mask, other=0.0,
                           volatile=True).to(tl.float32)
        res = tl.load(res_ptr + row * H + offs, mask=mask, other=0.0)
        s = (acc.to(dt).to(tl.float32) + res.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row * H + offs, s, mask=mask)
        sf = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, 0) / H + eps)
        y = (sf * rstd).to(dt).to(tl.float32) * w
        tl.store(out_ptr + row * H + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ll_words_to_values(words, dt: tl.constexpr, BLOCK: tl.constexpr, PAIRS: tl.constexpr):
    """uint32 words [BLOCK_W] -> their elements as float32 [BLOCK], in memory order."""
    if PAIRS:  # two 16-bit elements per word, the first in the low half
        lo = (words & 0xFFFF).to(tl.uint16).to(dt, bitcast=True)
        hi = (words >> 16).to(tl.uint16).to(dt, bitcast=True)
        return tl.reshape(tl.join(lo, hi), [BLOCK]).to(tl.float32)
    else:
        return words.to(dt, bitcast=True).to(tl.float32)


@triton.jit(do_not_specialize=["rank", "parity"])
def _all_reduce_add_rms_norm_ll_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, bases_ptr,
                                       rank, parity, rows, eps,
                                       WORLD: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr,
                                       HW: tl.constexpr, BLOCK_W: tl.constexpr, PAIRS: tl.constexpr,
                                       DATA_OFF: tl.constexpr, SLOT_WORDS: tl.constexpr):
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
    xw_ptr = x_ptr.to(tl.pointer_type(tl.uint32))
    for row in range(pid, rows, nprog):
        entry = flag | tl.load(xw_ptr + row * HW + ow, mask=mw, other=0).to(tl.uint64)
        for r in tl.static_range(WORLD):
            if r != rank:
                dst = (tl.load(bases_ptr + r) + DATA_OFF).to(tl.pointer_type(tl.uint64))
                tl.store(dst + (parity * WORLD + rank) * SLOT_WORDS + row * HW + ow, entry, mask=mw)
    recv = (local + DATA_OFF).to(tl.pointer_type(tl.uint64)) + parity * WORLD * SLOT_WORDS
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, rows, nprog):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):  # rank order: every rank sums the same way
            if r == rank:
                v = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                src = recv + r * SLOT_WORDS + row * HW + ow
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

    x, residual: [T, hidden] contiguous, ``dtype``; weight: [hidden]. Returns two new
    [T, hidden] tensors of ``dtype``; numerically the unfused all-reduce (the sum rounded to
    ``dtype``) followed by ``fused_add_rms_norm``. CUDA-graph capturable. Collective: every
    rank calls it with the same shapes in the same order (see the module docstring).

    Allocates 4 KB of flags + 2 x world x ``max_bytes`` of symmetric memory per rank.
    Raises RuntimeError/AttributeError where torch or the machine cannot set it up.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 max_bytes: int, rank: int, world_size: int, ll: bool = True):
        import torch.distributed._symmetric_memory as symm_mem

        if world_size * MAX_PROGRAMS * 4 > _FLAGS_BYTES:
            raise RuntimeError(f"fused all-reduce + RMSNorm supports at most {_FLAGS_BYTES // (4 * MAX_PROGRAMS)} ranks")
        self.rank, self.world_size, self.dtype, self.ll = rank, world_size, dtype, ll
        self.slot_numel = max_bytes // dtype.itemsize
        self.slot_words = max_bytes // 4
        nbytes = _FLAGS_BYTES + 2 * world_size * max_bytes * (2 if ll else 1)
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed before torch 2.9
        if enable is not None:
            enable(group.group_name)
        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.buffer.zero_()  # flags, counters, and no stale word may carry a valid epoch
        handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self.bases = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        # Zeroed before any peer writes here: the caller meets the other ranks (a CPU-side
        # collective) after this returns.
        torch.cuda.synchronize(device)
        self._parity = 0

    def accepts(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return (x.dtype == self.dtype and x.is_cuda and x.dim() == 2 and x.is_contiguous()
                and residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
                and x.numel() <= self.slot_numel and x.shape[-1] <= 16384
                and x.shape[-1] * x.element_size() % 4 == 0)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        rows, hidden = x.shape
        out = torch.empty_like(x)
        res_out = torch.empty_like(x)
        parity, self._parity = self._parity, self._parity ^ 1
        if rows == 0:
            return out, res_out
        block = triton.next_power_of_2(hidden)
        grid = (min(rows, MAX_PROGRAMS),)
        nw = 8 if block >= 4096 else 4
        if self.ll:
            hw = hidden * x.element_size() // 4
            _all_reduce_add_rms_norm_ll_kernel[grid](
                x, residual, weight, out, res_out, self.bases, self.rank, parity, rows, float(eps),
                WORLD=self.world_size, H=hidden, BLOCK=block, HW=hw, BLOCK_W=triton.next_power_of_2(hw),
                PAIRS=x.element_size() == 2, DATA_OFF=_FLAGS_BYTES, SLOT_WORDS=self.slot_words, num_warps=nw)
        else:
            _all_reduce_add_rms_norm_kernel[grid](
                x, residual, weight, out, res_out, self.bases, self.bases.data_ptr(),
                self.rank, self.world_size, parity, rows, float(eps),
                WORLD=self.world_size, H=hidden, BLOCK=block, DATA_OFF=_FLAGS_BYTES,
                SLOT_NUMEL=self.slot_numel, num_warps=nw)
        return out, res_out


def try_create(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, max_bytes: int,
               rank: int, world_size: int) -> tuple[Optional[AllReduceRMSNorm], Optional[BaseException]]:
    """``(AllReduceRMSNorm, None)``, or ``(None, error)`` where it cannot be set up."""
    try:
        return AllReduceRMSNorm(group, device, dtype, max_bytes, rank, world_size), None
    except Exception as e:
        return None, e
