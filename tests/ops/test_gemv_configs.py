"""The GEMV launch-config tables (pyengine/ops/gemv_configs.py): what a sweep writes is
what the kernels read, bad files are refused naming the entry, and a shape without an
entry (or a CPU tensor) gets the kernel's default."""
from __future__ import annotations

import json

import pytest
import torch

from pyengine.ops import gemv_configs


def test_table_round_trip(tmp_path):
    table = {"fp8": {"6144x4096": {"block_n": 8, "block_k": 2048, "num_warps": 4, "num_stages": 3},
                     "4096x4096": {"block_n": 4, "block_k": 1024, "num_warps": 4, "num_stages": 4, "split_k": 2},
                     "4096x14336": {"block_n": 32, "block_k": 512, "num_warps": 4, "num_stages": 1, "fma": True}},
             "int4": {"4096x14336": {"block_n": 16, "num_warps": 2},
                      "4096x4096": {"block_n": 16, "num_warps": 1, "split_k": 2, "prefetch": True}}}
    name = gemv_configs.config_file_name("NVIDIA H200")
    assert name == "gemv,device_name=NVIDIA_H200.json"
    (tmp_path / name).write_text(json.dumps(table))
    assert gemv_configs.load_table("NVIDIA H200", str(tmp_path)) == table
    assert gemv_configs.load_table("NVIDIA H100", str(tmp_path)) == {}  # no file: no table


@pytest.mark.parametrize("raw, word", [
    ([], "not a GEMV config table"),
    ({"fp4": {}}, "unknown kernel kind 'fp4'"),
    ({"fp8": {"6144": {}}}, "'6144' is not 'NxK'"),
    ({"int4": {"8x8": {"block_n": 8}}}, "int4 8x8: missing num_warps"),
    ({"int4": {"8x8": {"block_n": 0, "num_warps": 2}}}, r"block_n must be a power of two in \[1, 64\], got 0"),
    ({"int4": {"8x8": {"block_n": True, "num_warps": 2}}}, "block_n must be a power of two"),
    ({"int4": {"8x8": {"block_n": 12, "num_warps": 2}}}, "block_n must be a power of two"),
    ({"int4": {"8x8": 7}}, "expected a JSON object"),
    ({"int4": {"8x8": {"block_n": 8, "num_warps": 2, "block_k": 1024}}}, r"unknown field\(s\) block_k"),
    ({"fp8": {"8x8": {"block_n": 8, "block_k": 1024, "num_warps": 4, "num_stages": 3, "prefetch": True}}},
     r"unknown field\(s\) prefetch"),
    ({"fp8": {"8x8": {"block_n": 8, "block_k": 128, "num_warps": 4, "num_stages": 3}}},
     "block_k must be a power of two in \\[256"),
    ({"fp8": {"8x8": {"block_n": 8, "block_k": 1024, "num_warps": 4, "num_stages": 0}}}, "num_stages must be"),
    ({"fp8": {"8x8": {"block_n": 8, "block_k": 1024, "num_warps": 4, "num_stages": 3, "split_k": 0}}},
     r"split_k must be an integer in \[1, 64\], got 0"),
    ({"int8": {"8x8": {"block_n": 8, "num_warps": 2, "split_k": 2.0}}}, "split_k must be an integer"),
    ({"int4": {"8x8": {"block_n": 8, "num_warps": 2, "prefetch": 1}}}, "prefetch must be true or false, got 1"),
    ({"fp8": {"8x8": {"block_n": 8, "block_k": 1024, "num_warps": 4, "num_stages": 1, "fma": 1}}},
     "fma must be true or false, got 1"),
    ({"int4": {"8x8": {"block_n": 8, "num_warps": 2, "fma": True}}}, r"unknown field\(s\) fma"),
    ({"int4": {"8x8": {"block_n": 8, "num_warps": 2, "half2": 1}}}, "half2 must be true or false, got 1"),
    ({"int8": {"8x8": {"block_n": 8, "num_warps": 2, "half2": True}}}, r"unknown field\(s\) half2"),
    ({"int4": {"8x8": {"block_n": 8, "num_warps": 2, "persistent": 33}}}, r"persistent must be an integer in \[0, 32\]"),
    ({"int4": {"8x8": {"block_n": 8, "num_warps": 2, "vec": 3}}}, "vec must be 0 .by the group size., 1, 2, 4 or 8"),
    ({"int4": {"8x8": {"block_n": 8, "num_warps": 2, "stages": 0}}}, r"stages must be an integer in \[1, 8\]"),
    ({"fp8": {"8x8": {"block_n": 8, "block_k": 1024, "num_warps": 4, "num_stages": 3, "stages": 2}}},
     r"unknown field\(s\) stages"),
])
def test_bad_tables_are_refused(raw, word):
    with pytest.raises(ValueError, match=word):
        gemv_configs.parse_table(raw, "f.json")


def test_bad_file_names_itself(tmp_path):
    (tmp_path / gemv_configs.config_file_name("GPU X")).write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        gemv_configs.load_table("GPU X", str(tmp_path))


def test_cpu_has_no_swept_config():
    assert gemv_configs.lookup("fp8", 6144, 4096, torch.device("cpu")) is None


def test_shipped_tables_parse():
    for path in sorted(gemv_configs.CONFIG_DIR.glob("gemv,*.json")):
        gemv_configs.parse_table(json.loads(path.read_text()), str(path))


class _Spy:
    """Stands in for a Triton kernel: each launch appended to ``launches`` as (grid, kwargs),
    or (name, grid, kwargs) when named; nothing runs."""

    def __init__(self, launches: list, name: str | None = None):
        self.launches, self.name = launches, name

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append((grid, kw) if self.name is None else (self.name, grid, kw))
        return launch


def test_swept_knobs_reach_the_kernels(tmp_path, monkeypatch):
    """A table entry's optional knobs (split_k, prefetch) are what the GEMV launches with,
    and an entry without them runs the one-pass kernel: the config a launch reads is the
    entry, merged over nothing."""
    from pyengine.ops import quant

    seen = []
    monkeypatch.setattr(gemv_configs, "lookup", lambda kind, n, k, device: seen.append(kind) or
                        {"block_n": 4, "num_warps": 1, "split_k": 2, "prefetch": True})
    monkeypatch.setattr(quant, "_split_sum", lambda part, bias, y: seen.append(tuple(part.shape)))
    launches = []

    monkeypatch.setattr(quant, "_int_gemv_kernel", _Spy(launches))
    qw = torch.zeros(20, 4096 // 8, dtype=torch.int32)  # 4 chunks of 128 words at 1 warp
    s = torch.ones(32, 20)
    quant.int_gemv(torch.ones(1, 4096), qw, s, s, 4, 128)
    (grid, kw), = launches
    assert grid == (5, 2) and kw["SPLIT_K"] == 2 and kw["PREFETCH"] is True and kw["BLOCK_N"] == 4
    assert seen == ["int4", (2, 20)]
    monkeypatch.setattr(gemv_configs, "lookup", lambda kind, n, k, device: {"block_n": 8, "num_warps": 2})
    launches.clear()
    seen.clear()
    quant.int_gemv(torch.ones(1, 4096), qw, s, s, 4, 128)
    (grid, kw), = launches
    assert grid == (3, 1) and kw["SPLIT_K"] == 1 and kw["PREFETCH"] is False and seen == []


def test_persistent_knobs_reach_the_stream_kernel(monkeypatch):
    """An int4 entry with ``persistent`` launches the stream kernel on a grid of that many
    programs (on the CPU: in all; at most one a block) with its ``stages`` and ``vec``;
    ``half2`` stays off for CPU tensors (the f16x2 path is GPU only)."""
    from pyengine.ops import quant

    monkeypatch.setattr(gemv_configs, "lookup", lambda kind, n, k, device: {
        "block_n": 4, "num_warps": 1, "persistent": 2, "stages": 3, "vec": 2, "half2": True})
    launches = []

    monkeypatch.setattr(quant, "_int_gemv_stream_kernel", _Spy(launches))
    monkeypatch.setattr(quant, "_int_gemv_kernel", None)  # the one-pass kernel must not run
    qw = torch.zeros(20, 4096 // 8, dtype=torch.int32)
    s = torch.ones(32, 20)
    quant.int_gemv(torch.ones(1, 4096, dtype=torch.bfloat16), qw, s, s, 4, 128)
    (grid, kw), = launches
    assert grid == (2,) and kw["STAGES"] == 3 and kw["CW"] == 2 and kw["BLOCK_N"] == 4 and kw["HALF2"] is False


def test_fp8_persistent_knob_reaches_the_stream_kernel(monkeypatch):
    """An FP8 entry with ``persistent`` launches ``_fp8_gemv_stream_kernel`` on that many
    programs (on the CPU: in all) with ``num_stages`` as its pipeline's buffers."""
    from pyengine.ops import quant

    monkeypatch.setattr(gemv_configs, "lookup", lambda kind, n, k, device: {
        "block_n": 4, "block_k": 512, "num_warps": 4, "num_stages": 3, "persistent": 2})
    launches = []

    monkeypatch.setattr(quant, "_fp8_gemv_stream_kernel", _Spy(launches))
    monkeypatch.setattr(quant, "_fp8_gemv_kernel", None)  # the one-pass kernel must not run
    w = torch.zeros(20, 1024, dtype=quant.FP8_DTYPE)
    quant.fp8_gemv(torch.ones(1, 1024), w, torch.ones(20), act="token")
    (grid, kw), = launches
    assert grid == (2,) and kw["STAGES"] == 3 and kw["BLOCK_N"] == 4 and kw["BLOCK_K"] == 512


def test_fma_knob_picks_the_cuda_core_kernel(monkeypatch):
    """An FP8 entry with ``fma`` launches the CUDA-core kernel with its tile (one pass, or
    split-K and the sum pass); without it, or with block scales, the tensor-core kernel."""
    from pyengine.ops import quant

    entry = {"block_n": 16, "block_k": 512, "num_warps": 2, "num_stages": 1, "fma": True}
    monkeypatch.setattr(gemv_configs, "lookup", lambda kind, n, k, device: dict(entry))
    monkeypatch.setattr(quant, "_split_sum", lambda part, bias, y: launches.append(("sum", tuple(part.shape))))
    launches = []

    monkeypatch.setattr(quant, "_fp8_gemv_fma_kernel", _Spy(launches, "fma"))
    monkeypatch.setattr(quant, "_fp8_gemv_kernel", _Spy(launches, "mma"))
    w = torch.zeros(40, 2048, dtype=quant.FP8_DTYPE)
    ws = torch.ones(40)
    quant.fp8_gemv(torch.ones(1, 2048), w, ws, act="token")
    (name, grid, kw), = launches
    assert (name, grid, kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"], kw["SPLIT_K"]) == ("fma", (3, 1), 16, 512, 2, 1)
    launches.clear()
    entry["split_k"] = 2
    quant.fp8_gemv(torch.ones(1, 2048), w, ws, act="token")
    assert [x[:2] for x in launches] == [("fma", (3, 2)), ("sum", (2, 40))]
    launches.clear()
    quant.fp8_gemv(torch.ones(1, 2048), w, torch.ones(5, 32), block=(8, 64), act="group")  # block scales
    assert [x[0] for x in launches] == ["mma", "sum"]
    launches.clear()
    del entry["fma"], entry["split_k"]
    quant.fp8_gemv(torch.ones(1, 2048), w, ws, act="token")
    assert [x[0] for x in launches] == ["mma"]
