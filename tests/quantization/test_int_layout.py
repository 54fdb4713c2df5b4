"""The packed-integer layer form ``finalize_int`` gives (pyengine/layers/quantization/utils.py):
symmetric zero points (every one 2**(bits - 1): GPTQ ``sym``, compressed-tensors symmetric)
keep no zeros tensor, the kernels using the constant; the packed form stands for the same
dequantized weight either way."""
from __future__ import annotations

import torch
from torch import nn

from pyengine.layers.quantization import utils
from pyengine.ops import quant


def test_symmetric_int_layers_keep_no_zeros(monkeypatch):
    monkeypatch.setattr(utils, "use_quant_kernels", lambda t: True)  # the kernels' form on the CPU too
    g = torch.Generator().manual_seed(3)
    for bits in (4, 8):
        q = torch.randint(0, 1 << bits, (64, 8), generator=g, dtype=torch.int32)
        scales = torch.rand(2, 8, generator=g) + 0.1
        asym = torch.randint(0, 1 << bits, (2, 8), generator=g).float()
        asym[0, 0] = 1 << (bits - 1) if asym[0, 0] != 1 << (bits - 1) else 0  # not all 2**(bits-1), one is
        for zeros, kept in ((torch.full((2, 8), float(1 << (bits - 1))), False), (asym, True)):
            layer = nn.Module()
            layer.weight = nn.Parameter(torch.zeros(8, 64))
            utils.finalize_int(layer, q, scales, zeros, bits, 32, torch.float32)
            assert hasattr(layer, "zeros") == kept and not hasattr(layer, "weight")
            dense = quant.dequant_int_ref(layer.qweight, layer.scales, getattr(layer, "zeros", None), bits, 32)
            assert torch.equal(dense, utils.dequantize_int(q, scales, zeros, torch.arange(64) // 32))
