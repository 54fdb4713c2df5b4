"""Linear layers, tensor-parallel (mirrors vllm/model_executor/layers/linear.py).

* ``ColumnParallelLinear``: the output dim is split over the ranks; each rank computes
  its slice (no communication). ``MergedColumnParallelLinear`` (gate/up) and
  ``QKVParallelLinear`` (q/k/v) fuse several such projections of one input, each part
  split on its own, so every rank holds [part0 slice | part1 slice | ...].
* ``RowParallelLinear``: the input dim is split (its input is a column-parallel output);
  each rank's partial product is summed over the ranks by one all-reduce, then the bias
  is added once. With ``reduce_results=False`` it returns this rank's partial sum (rank 0's
  with the bias) and the caller sums it, fused with what follows (the decoder layers'
  all-reduce + residual add + RMSNorm, ``RMSNorm.forward(..., all_reduce_x=True)``).

``tp_group`` is a ``pyengine.distributed.GroupCoordinator`` or None (one rank). With one
rank every layer is exactly one ``F.linear`` — no extra op or launch — or, for one bf16/fp16
row on CUDA, one Triton GEMV (``pyengine.ops.linear``).

Every parameter carries ``weight_loader(param, loaded, shard_id=None)``, used by
``pyengine.models.loader``. A layer quantized by a method (``set_quant_method``, a
``pyengine.layers.quantization`` linear method) holds that method's parameters instead of
``weight``; their attributes (``output_dim``, ``input_dim``, ``row_factors``,
``per_shard``; see ``quantization.base_config.set_weight_attrs``) tell
the same loaders which part of each checkpoint tensor is this rank's, and ``forward``
calls the method's ``apply``. ``loaded`` is the *whole* checkpoint tensor: a torch tensor,
or a safetensors slice (``safe_open(...).get_slice(name)``), in which case only this
rank's part is read from the file. Fused layers take each checkpoint part (q/k/v,
gate/up) by shard id, or an already fused tensor with ``shard_id=None``. Shape mismatches
raise ValueError. Weights are created uninitialized on the current default device/dtype.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pyengine.ops import linear as _linear


# ---- checkpoint tensors (torch tensors or safetensors slices) ---------------------------
def weight_shape(loaded) -> tuple[int, ...]:
    """Shape of a checkpoint tensor or safetensors slice."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def narrow_weight(loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """``loaded[..., start:start+size, ...]`` along ``dim`` as a tensor; from a safetensors
    slice only that part is read."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


def full_weight(loaded) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def _check_shape(loaded, expected: Sequence[int], what: str = "") -> None:
    got = weight_shape(loaded)
    if got != tuple(expected):
        raise ValueError(f"shape mismatch{what}: expected {tuple(expected)} in the checkpoint, got {got}")


def _check_same_for_parts(param: torch.Tensor, loaded, shard_id) -> None:
    """For a ``same_for_parts`` parameter of a fused layer (e.g. GPTQ's ``g_idx``), which
    every part's checkpoint holds: the first part's copy is taken, each later one must equal
    what was loaded. The checkpoint tensor is brought to the parameter's device and dtype
    for the comparison (a CUDA parameter against a host tensor). Raises ValueError when a
    part differs."""
    if not (getattr(param, "same_for_parts", False) and shard_id is not None):
        return
    seen = param.__dict__.setdefault("loaded_parts", set())
    if seen and not torch.equal(param.data, full_weight(loaded).to(device=param.device, dtype=param.dtype)):
        raise ValueError(f"shard {shard_id!r} differs from the parts already loaded into this fused layer "
                         f"({sorted(map(str, seen))}); it must be the same for all of them")
    seen.add(shard_id)


def default_weight_loader(param: torch.Tensor, loaded, shard_id=None) -> None:
    """Copy a whole checkpoint tensor into ``param`` (dtype/device converted).
    Raises ValueError on a shape mismatch."""
    _check_shape(loaded, param.shape)
    _check_same_for_parts(param, loaded, shard_id)
    param.data.copy_(full_weight(loaded))


def divide(n: int, d: int, what: str = "size") -> int:
    if n % d:
        raise ValueError(f"{what} {n} is not divisible by tensor_parallel_size {d}")
    return n // d


def _param(*shape: int, loader=default_weight_loader, **attrs) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def _units(param, dim: int, rows: int) -> int:
    """``rows`` logical rows along ``dim`` in entries of ``param`` (a packed or grouped dim
    holds ``row_factors[dim]`` rows per entry). Raises ValueError when they do not divide."""
    factor = getattr(param, "row_factors", {}).get(dim, 1)
    if rows % factor:
        raise ValueError(f"{rows} rows along dim {dim} do not split into whole entries of {factor} "
                         f"(packed values, or groups/blocks of a quantization scale)")
    return rows // factor


def _load_whole(param: torch.Tensor, loaded, parts: Sequence | None = None, shard_id=None) -> None:
    """A tensor every rank holds whole; a ``per_shard`` one ([len(parts)]) takes one value
    per fused part by shard id."""
    if getattr(param, "per_shard", False) and shard_id is not None:
        if parts is None or shard_id not in parts:
            raise ValueError(f"unknown shard id {shard_id!r}")
        value = full_weight(loaded)
        if value.numel() != 1:
            raise ValueError(f"expected one value for shard {shard_id!r}, got shape {tuple(value.shape)}")
        param.data[list(parts).index(shard_id)] = value.reshape(())
        return
    if getattr(param, "per_shard", False) and weight_shape(loaded) in ((), (1,)):
        param.data.fill_(full_weight(loaded).reshape(()).item())  # one value for every part
        return
    _check_shape(loaded, param.shape)
    _check_same_for_parts(param, loaded, shard_id)
    param.data.copy_(full_weight(loaded))


class LinearBase(nn.Module):
    """y = x @ W^T (+ b) on this rank's shard. ``tp_rank`` / ``tp_size`` from ``tp_group``."""

    def __init__(self, input_size: int, output_size: int, tp_group=None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        # Kept out of the module tree: it is not a module, and shared by every layer.
        self.__dict__["tp_group"] = tp_group
        self.tp_rank = tp_group.rank if tp_group is not None else 0
        self.tp_size = tp_group.world_size if tp_group is not None else 1
        self.quant_method = None  # a quantization LinearMethodBase, set by set_quant_method

    # (input size of this rank, this rank's output rows of each fused part): set by subclasses
    input_size_per_partition: int
    output_partition_sizes: list[int]

    def set_quant_method(self, method) -> None:
        """Run this layer with ``method`` (a ``pyengine.layers.quantization`` linear method):
        ``weight`` is replaced by the method's parameters, each given this layer's loader.
        The bias, if any, stays in the compute dtype."""
        dtype = self.weight.dtype
        del self.weight
        self.quant_method = method
        method.create_weights(self, self.input_size_per_partition, list(self.output_partition_sizes),
                              self.input_size, self.output_size, dtype)
        for name, p in self.named_parameters(recurse=False):
            if name != "bias" and not hasattr(p, "weight_loader"):
                p.weight_loader = self.weight_loader
                if getattr(self, "shard_ids", None) is not None:
                    p.shard_ids = tuple(self.shard_ids)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return _linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
                f"tp_size={self.tp_size}")


class ColumnParallelLinear(LinearBase):
    """Output dim split: weight [output_size / tp, input_size], bias [output_size / tp].
    ``forward(x [T, input_size]) -> [T, output_size / tp]`` (this rank's slice, not gathered)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_group=None,
                 output_size_per_partition: int | None = None):
        super().__init__(input_size, output_size, tp_group)
        self.output_size_per_partition = (output_size_per_partition if output_size_per_partition is not None
                                          else divide(output_size, self.tp_size, "output size"))
        self.input_size_per_partition = input_size
        self.output_partition_sizes = [self.output_size_per_partition]
        self.weight = _param(self.output_size_per_partition, input_size, loader=self.weight_loader, output_dim=0)
        self.bias = _param(self.output_size_per_partition, loader=self.weight_loader, output_dim=0) if bias else None

    def weight_loader(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:
            _load_whole(param, loaded, [shard_id], shard_id)
            return
        full = list(param.shape)
        full[dim] = _units(param, dim, self.output_size)
        _check_shape(loaded, full)
        n = param.shape[dim]
        param.data.copy_(narrow_weight(loaded, dim, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused along the output dim
    (gate/up: ``output_sizes=[I, I]``, shard ids 0, 1). Each part is split over the ranks,
    so a rank holds [part 0 slice | part 1 slice | ...]. ``param.shard_ids`` lets the
    loader name parts the checkpoint lacked."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, tp_group=None,
                 shard_ids: Sequence | None = None):
        self.output_sizes = list(output_sizes)
        self.shard_ids = list(shard_ids) if shard_ids is not None else list(range(len(output_sizes)))
        rank, tp = (tp_group.rank, tp_group.world_size) if tp_group is not None else (0, 1)
        slices = self._part_slices(rank, tp)
        super().__init__(input_size, sum(output_sizes), bias, tp_group, sum(n for _, n in slices))
        # shard id -> (row offset in the checkpoint part, row offset in this rank's weight, rows)
        self._parts: dict = {}
        off = 0
        for sid, (src, size) in zip(self.shard_ids, slices):
            self._parts[sid] = (src, off, size)
            off += size
        self.output_partition_sizes = [n for _, n in slices]
        for p in (self.weight, self.bias):
            if p is not None:
                p.shard_ids = tuple(self.shard_ids)

    def _part_slices(self, rank: int, tp: int) -> list[tuple[int, int]]:
        """(row offset in the checkpoint part, rows) of rank ``rank``'s slice of each part."""
        out = []
        for size in self.output_sizes:
            n = divide(size, tp, "output size")
            out.append((rank * n, n))
        return out

    def weight_loader(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        if shard_id is not None and shard_id not in self._parts:
            raise ValueError(f"unknown shard id {shard_id!r}; expected one of {self.shard_ids}")
        dim = getattr(param, "output_dim", None)
        if dim is None:
            _load_whole(param, loaded, self.shard_ids, shard_id)
            return

        def rows(n: int) -> int:
            return _units(param, dim, n)

        def shape_with(n: int) -> list[int]:
            full = list(param.shape)
            full[dim] = rows(n)
            return full

        if shard_id is None:  # an already fused checkpoint tensor: load it part by part
            _check_shape(loaded, shape_with(self.output_size))
            start = 0
            for sid, size in zip(self.shard_ids, self.output_sizes):
                src, dst, n = self._parts[sid]
                param.data.narrow(dim, rows(dst), rows(n)).copy_(narrow_weight(loaded, dim, rows(start + src), rows(n)))
                start += size
            return
        size = self.output_sizes[self.shard_ids.index(shard_id)]
        _check_shape(loaded, shape_with(size), f" for shard {shard_id!r}")
        src, dst, n = self._parts[shard_id]
        param.data.narrow(dim, rows(dst), rows(n)).copy_(narrow_weight(loaded, dim, rows(src), rows(n)))


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q/k/v projection with heads split over the ranks: a rank holds
    ``num_heads = total_num_heads / tp`` query heads and ``num_kv_heads`` KV heads —
    ``total_num_kv_heads / tp`` of them, or, when there are fewer KV heads than ranks,
    one KV head replicated on ``tp / total_num_kv_heads`` ranks (the one its query heads
    use). Output = cat(q [num_heads*D], k [num_kv_heads*D], v [num_kv_heads*D]);
    shard ids ``"q"``, ``"k"``, ``"v"``."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False, tp_group=None):
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp = tp_group.world_size if tp_group is not None else 1
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads")
        if tp >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp, total_num_kv_heads, "num_key_value_heads: tensor_parallel_size")
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        # Checkpoint part sizes are the full ones; _part_slices picks this rank's heads.
        super().__init__(hidden_size, [total_num_heads * head_size, total_num_kv_heads * head_size,
                                       total_num_kv_heads * head_size], bias, tp_group, shard_ids=("q", "k", "v"))

    def _part_slices(self, rank: int, tp: int) -> list[tuple[int, int]]:
        kv_shard = rank // self.num_kv_head_replicas
        return [(rank * self.q_size, self.q_size), (kv_shard * self.kv_size, self.kv_size),
                (kv_shard * self.kv_size, self.kv_size)]

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q+2kv] -> (q [T, num_heads*D], k [T, num_kv_heads*D], v [T, num_kv_heads*D]) views."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(LinearBase):
    """Input dim split: weight [output_size, input_size / tp], bias [output_size] (whole).
    ``forward(x [T, input_size / tp]) -> [T, output_size]``, summed over the ranks (one
    all-reduce) when tp > 1, bias added once after the sum. ``reduce_results=False``
    (vLLM's flag): no all-reduce, each rank returns its partial product, rank 0's plus the
    bias, so the ranks' outputs sum to the layer's output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_group=None,
                 reduce_results: bool = True):
        super().__init__(input_size, output_size, tp_group)
        self.input_size_per_partition = divide(input_size, self.tp_size, "input size")
        self.output_partition_sizes = [output_size]
        self.weight = _param(output_size, self.input_size_per_partition, loader=self.weight_loader, input_dim=1)
        self.bias = _param(output_size) if bias else None
        self.reduce_results = reduce_results

    def weight_loader(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is None:
            _load_whole(param, loaded, [shard_id], shard_id)
            return
        full = list(param.shape)
        full[dim] = _units(param, dim, self.input_size)
        _check_shape(loaded, full)
        n = param.shape[dim]
        param.data.copy_(narrow_weight(loaded, dim, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._matmul(x, self.bias)
        if not self.reduce_results:
            return self._matmul(x, self.bias if self.tp_rank == 0 else None)
        y = self.tp_group.all_reduce(self._matmul(x, None))
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (vLLM's ``ReplicatedLinear``): weight
    [output_size, input_size], bias [output_size]. ``forward(x [T, input_size]) ->
    [T, output_size]``, no communication. For small projections every rank needs whole
    (MoE routers, Qwen2-MoE's shared-expert gate)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, None)
        self.weight = _param(output_size, input_size)
        self.bias = _param(output_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.bias)
