"""Tile configs the quantized fused-MoE kernel tests (FP8, INT) run every path with, on their
shapes (hidden 48, intermediate 24): the GEMV path with the k-sum fused and not, split-K, the
grouped GEMM with and without tails."""
GROUPED = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 2, "num_warps": 4,
           "num_stages": 2}
# K tails (hidden 48, intermediate 24 against BLOCK_SIZE_K 32) and N tails (24 against 32)
GROUPED_TAILS = {**GROUPED, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1}
GEMV = {"small_batch": True, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 32, "num_warps": 4}
GEMV_UNFUSED = {**GEMV, "w2": {"FUSE_SUM": False}}
# split-K: gate/up's K 48 in three 16-column chunks over 2 programs, down's K 24 over 2 (a tail)
GEMV_SPLIT_K = {"small_batch": True, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "num_warps": 4, "SPLIT_K": 2}
GEMV_SPLIT_K_UNFUSED = {**GEMV_SPLIT_K, "w2": {"FUSE_SUM": False}}
# (config, tokens) pairs covering every path, and their test ids
CONFIGS = [(GEMV, 1), (GEMV_UNFUSED, 3), (GEMV_SPLIT_K, 2), (GEMV_SPLIT_K_UNFUSED, 2), (GROUPED, 7), (GROUPED_TAILS, 5)]
CONFIG_IDS = ["gemv", "gemv-unfused", "split-k", "split-k-unfused", "grouped", "grouped-tails"]
