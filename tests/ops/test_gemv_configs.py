"""The GEMV launch-config tables (pyengine/ops/gemv_configs.py): what a sweep writes is
what the kernels read, bad files are refused naming the entry, and a shape without an
entry (or a CPU tensor) gets the kernel's default."""
from __future__ import annotations

import json

import pytest
import torch

from pyengine.ops import gemv_configs


def test_table_round_trip(tmp_path):
    table = {"fp8": {"6144x4096": {"block_n": 8, "block_k": 2048, "num_warps": 4, "num_stages": 3}},
             "int4": {"4096x14336": {"block_n": 16, "num_warps": 2}}}
    name = gemv_configs.config_file_name("NVIDIA H200")
    assert name == "gemv,device_name=NVIDIA_H200.json"
    (tmp_path / name).write_text(json.dumps(table))
    assert gemv_configs.load_table("NVIDIA H200", str(tmp_path)) == table
    assert gemv_configs.load_table("NVIDIA H100", str(tmp_path)) == {}  # no file: no table


@pytest.mark.parametrize("raw, word", [
    ([], "not a GEMV config table"),
    ({"fp4": {}}, "unknown kernel kind 'fp4'"),
    ({"fp8": {"6144": {}}}, "'6144' is not 'NxK'"),
    ({"int4": {"8x8": {"block_n": 8}}}, "expected positive integers block_n, num_warps"),
    ({"int4": {"8x8": {"block_n": 0, "num_warps": 2}}}, "expected positive integers"),
    ({"int4": {"8x8": {"block_n": True, "num_warps": 2}}}, "expected positive integers"),
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
