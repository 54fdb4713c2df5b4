"""Decode-attention kernel micro-benchmark: effective KV bandwidth of the triton paged
decode kernel (pyengine/ops/paged_attention.py) vs SDPA's cuDNN backend on the same K/V
laid out contiguously.

Effective bandwidth = bytes of K and V that the step must read (sum of context lengths x
num_kv_heads x head_dim x 2 (K, V) x dtype size) / kernel time. Default shape: Qwen3-0.6B
attention (16 query heads, 8 KV heads, head_dim 128, bf16), block_size 16, blocks of each
request scattered randomly over the cache.

    python benchmarks/attention_kernels.py                 # markdown table
    python benchmarks/attention_kernels.py --sweep         # also try kernel configs
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton
import triton.testing

from pyengine.attention.triton_backend import TritonAttentionBackend
from pyengine.ops.paged_attention import paged_decode

DEVICE = "cuda"


def make_case(batch, ctx, hq, hkv, d, block_size, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    nblk_per = math.ceil(ctx / block_size)
    num_blocks = batch * nblk_per
    kv = torch.randn(2, num_blocks, block_size, hkv, d, device=DEVICE, dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=g).to(torch.int32)
    block_table = perm.view(batch, nblk_per).contiguous()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, hq, d, device=DEVICE, dtype=dtype, generator=g)
    return q, kv, block_table, seq_lens


def contiguous_kv(kv, block_table, ctx):
    # [B, Hkv, ctx, D] for SDPA
    k = kv[0][block_table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    v = kv[1][block_table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    return k, v


def bench(fn, rep=100):
    if DEVICE != "cuda":  # smoke-testing on CPU (TRITON_INTERPRET=1)
        import time
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return triton.testing.do_bench(fn, warmup=25, rep=rep) * 1e-3  # seconds


def run(args):
    dtype = getattr(torch, args.dtype)
    hq, hkv, d, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    scale = d ** -0.5
    rows = []
    for batch in args.batch:
        for ctx in args.context:
            q, kv, bt, sl = make_case(batch, ctx, hq, hkv, d, bs, dtype)
            kv_bytes = batch * ctx * hkv * d * 2 * kv.element_size()
            be = TritonAttentionBackend(hq, hkv, d, scale, bs, dtype, torch.device(DEVICE))
            splits = be.num_splits(batch)
            max_s = max([splits] + (args.sweep_splits if args.sweep else []))
            part_out = torch.empty(batch * hq * max_s * d, dtype=torch.float32, device=DEVICE)
            part_lse = torch.empty(batch * hq * max_s, dtype=torch.float32, device=DEVICE)
            out = torch.empty_like(q)

            def tri(splits=splits, **kw):
                return paged_decode(q, kv[0], kv[1], bt, sl, out, scale, splits,
                                    part_out, part_lse, **kw)

            t_tri = bench(tri)
            ref_out = tri().clone()
            row = dict(batch=batch, context=ctx, kv_mb=kv_bytes / 1e6, splits=splits,
                       triton_us=t_tri * 1e6, triton_tbs=kv_bytes / t_tri / 1e12)
            best = (t_tri, f"splits={splits} default")
            if args.sweep:
                for s in args.sweep_splits:
                    for (bn, nw, ns) in [(32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2),
                                         (128, 8, 3), (64, 2, 3)]:
                        try:
                            t = bench(lambda: tri(splits=s, block_n=bn, num_warps=nw, num_stages=ns),
                                      rep=40)
                        except Exception as e:  # noqa: BLE001
                            print(f"# config s={s} bn={bn} w={nw} st={ns} failed: {e!r}"[:200])
                            continue
                        if args.verbose:
                            print(f"# B={batch} ctx={ctx} s={s} bn={bn} w={nw} st={ns}: "
                                  f"{t*1e6:.1f} us {kv_bytes/t/1e12:.2f} TB/s")
                        if t < best[0]:
                            best = (t, f"splits={s} block_n={bn} warps={nw} stages={ns}")
                row["best_us"] = best[0] * 1e6
                row["best_tbs"] = kv_bytes / best[0] / 1e12
                row["best_cfg"] = best[1]

            # SDPA cuDNN on contiguous K/V
            k, v = contiguous_kv(kv, bt, ctx)
            q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
            from torch.nn.attention import SDPBackend, sdpa_kernel
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("flash", SDPBackend.FLASH_ATTENTION)):
                note = ""
                try:
                    with sdpa_kernel(backend):
                        def fn():
                            return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
                        o = fn()
                        t = bench(fn)
                except Exception:  # noqa: BLE001
                    try:  # backend without GQA support: expand K/V to all query heads
                        ke = k.repeat_interleave(hq // hkv, dim=1)
                        ve = v.repeat_interleave(hq // hkv, dim=1)
                        with sdpa_kernel(backend):
                            def fn():
                                return F.scaled_dot_product_attention(q4, ke, ve, scale=scale)
                            o = fn()
                            t = bench(fn)
                        note = "kv expanded"
                        del ke, ve
                    except Exception as e:  # noqa: BLE001
                        row[f"{name}_us"] = None
                        row[f"{name}_note"] = repr(e)[:80]
                        continue
                err = (o.squeeze(2).float() - ref_out.float()).abs().max().item()
                row[f"{name}_us"] = t * 1e6
                row[f"{name}_tbs"] = kv_bytes / t / 1e12
                row[f"{name}_note"] = note
                row[f"{name}_maxdiff"] = err
            rows.append(row)
            del q, kv, bt, sl, k, v, be
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    return rows


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sweep", action="store_true", help="also time other kernel configs")
    p.add_argument("--sweep-splits", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--json", help="write rows to this file")
    p.add_argument("--device", default="cuda", help="cpu only for smoke tests under TRITON_INTERPRET=1")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    rows = run(args)
    print(f"\nDecode attention, {torch.cuda.get_device_name() if DEVICE == 'cuda' else DEVICE}, heads {args.num_heads}/{args.num_kv_heads}, "
          f"head_dim {args.head_dim}, {args.dtype}, block_size {args.block_size}, "
          f"torch {torch.__version__}, triton {triton.__version__}\n")
    hdr = "| batch | context | KV MB | triton µs | triton TB/s | splits | cuDNN µs | cuDNN TB/s | flash µs | flash TB/s |"
    if args.sweep:
        hdr += " best µs | best TB/s | best config |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in rows:
        line = (f"| {r['batch']} | {r['context']} | {r['kv_mb']:.0f} | {r['triton_us']:.1f} | "
                f"{r['triton_tbs']:.2f} | {r['splits']} | {fmt(r.get('cudnn_us'), '.1f')} | "
                f"{fmt(r.get('cudnn_tbs'), '.2f')} | {fmt(r.get('flash_us'), '.1f')} | "
                f"{fmt(r.get('flash_tbs'), '.2f')} |")
        if args.sweep:
            line += f" {r['best_us']:.1f} | {r['best_tbs']:.2f} | {r['best_cfg']} |"
        print(line)
    notes = [f"B={r['batch']} ctx={r['context']}: {n}={r.get(n + '_note')} maxdiff={r.get(n + '_maxdiff')}"
             for r in rows for n in ("cudnn", "flash")]
    print("\n" + "\n".join(notes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
