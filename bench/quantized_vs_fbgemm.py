#!/usr/bin/env python3
"""Ember's INT8 / INT4 lookups (CPU backend) against FBGEMM's CPU kernels.

A benchmark, not a test. For every (dtype, dim, threads) it starts
bench/kernel_bench --serve --dtype=int8|int4 (which writes the ids it uses
with --dump_ids and times its backend's fused lookups on request), sets up
FBGEMM's IntNBitTableBatchedEmbeddingBagsCodegen (fbgemm_gpu's inference
TBE, on the CPU: EmbeddingLocation.HOST, the same SparseType, rows, dim,
SUM pooling and fp32 output) and PyTorch's quantized EmbeddingBag ops
(torch.ops.quantized.embedding_bag_byte_rowwise_offsets and _4bit_:
FBGEMM's JIT-generated kernels, what torch.ao's quantized EmbeddingBag
runs; their rows carry an fp32 scale and bias at the end for 8 bits) on
exactly those ids, and times the three in turn, --pairs times. It prints
lookups per second (ids gathered) for each, the median ratio Ember / peer
over the pairs (> 1: Ember is faster), and the bytes of a row each reads.
Ember's fp32 and fp16 lookups of the same shape are timed in the same run
(the bytes a quantized row saves).

The rows differ (Ember's are its initializer's, quantized; FBGEMM's its
fill_random_weights()), which changes no timing; the ids, batches and
pooling are the same. --id_sets batches (16 by default: 655,360 ids, whose
rows pass the last-level cache) are cycled by both.

  .venv/bin/python bench/quantized_vs_fbgemm.py [--dims=32,64,128] [--threads=1]
      [--rows=4000000] [--batch=2048] [--pairs=5] [--format=table|json]

Needs torch and fbgemm_gpu (the SDK's venv has both) and a built
kernel_bench (bazel build -c opt //bench:kernel_bench).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from kernel_bench_server import KernelBenchServer


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel_bench", default="bazel-bin/bench/kernel_bench")
    p.add_argument("--rows", type=int, default=4000000)
    p.add_argument("--dims", default="32,64,128")
    p.add_argument("--dtypes", default="int8,int4")
    p.add_argument("--threads", default="1")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--pooling_factor", type=int, default=20)
    p.add_argument("--id_sets", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--format", choices=["table", "json"], default="table")
    return p.parse_args()


def fbgemm_timer(args, dtype, dim, ids_path, threads):
    import numpy as np
    import torch
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (EmbeddingLocation,
                                                                      PoolingMode)
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen)
    torch.set_num_threads(threads)
    sparse = {"int8": SparseType.INT8, "int4": SparseType.INT4}[dtype]
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        [("t", args.rows, dim, sparse, EmbeddingLocation.HOST)], device="cpu",
        pooling_mode=PoolingMode.SUM, output_dtype=SparseType.FP32)
    tbe.fill_random_weights()
    row_bytes = tbe.split_embedding_weights()[0][0].shape[1] + 4  # values, then scale and bias
    per = args.batch * args.pooling_factor
    ids = np.fromfile(ids_path, dtype=np.int64)
    if ids.size != per * args.id_sets:
        sys.exit(f"quantized_vs_fbgemm: {ids_path} holds {ids.size} ids, expected "
                 f"{per * args.id_sets}")
    sets = [torch.from_numpy(ids[k * per:(k + 1) * per].astype(np.int32))
            for k in range(args.id_sets)]
    offsets = torch.arange(0, per + 1, args.pooling_factor, dtype=torch.int32)

    def measure():
        for k in range(3):
            tbe(sets[k % len(sets)], offsets)
        start = time.perf_counter()
        for i in range(args.iters):
            tbe(sets[(3 + i) % len(sets)], offsets)
        return per * args.iters / (time.perf_counter() - start)

    # PyTorch's quantized EmbeddingBag ops on the same ids (random rows of
    # the same shape, packed by their own prepack).
    pack, op = {"int8": (torch.ops.quantized.embedding_bag_byte_prepack,
                         torch.ops.quantized.embedding_bag_byte_rowwise_offsets),
                "int4": (torch.ops.quantized.embedding_bag_4bit_prepack,
                         torch.ops.quantized.embedding_bag_4bit_rowwise_offsets)}[dtype]
    packed = pack(torch.randn(args.rows, dim))
    long_sets = [s.long() for s in sets]
    bag_starts = torch.arange(0, per, args.pooling_factor, dtype=torch.int64)

    def measure_ao():
        call = lambda ids: op(packed, ids, bag_starts, mode=0, pruned_weights=False,
                              include_last_offset=False)
        for k in range(3):
            call(long_sets[k % len(long_sets)])
        start = time.perf_counter()
        for i in range(args.iters):
            call(long_sets[(3 + i) % len(long_sets)])
        return per * args.iters / (time.perf_counter() - start)

    return measure, row_bytes, measure_ao, packed.shape[1]


def ember_rate(args, dtype, dim, threads, dump=None):
    cmd = [args.kernel_bench, f"--dtype={dtype}", f"--dim={dim}", f"--rows={args.rows}",
           f"--batch={args.batch}", f"--pooling_factor={args.pooling_factor}",
           f"--threads={threads}", f"--id_sets={args.id_sets}", f"--iters={args.iters}"]
    if dump:
        cmd.append(f"--dump_ids={dump}")
    return KernelBenchServer(cmd, "quantized_vs_fbgemm")


def main():
    args = parse_args()
    if not os.path.exists(args.kernel_bench):
        sys.exit(f"quantized_vs_fbgemm: no {args.kernel_bench}: "
                 "bazel build -c opt //bench:kernel_bench first")
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        for dim in [int(d) for d in args.dims.split(",")]:
            # Ember's fp32 and fp16 of the same shape, for the bytes saved.
            plain = {}
            for dtype in ("fp32", "fp16"):
                server = ember_rate(args, dtype, dim, threads)
                plain[dtype] = statistics.median(server.measure()["lookups_per_s"]
                                                 for _ in range(args.pairs))
                server.close()
            for dtype in args.dtypes.split(","):
                with tempfile.NamedTemporaryFile(suffix=".ids") as dump:
                    print(f"{dtype} dim {dim}, {threads} thread(s): setting up ...",
                          file=sys.stderr, flush=True)
                    server = ember_rate(args, dtype, dim, threads, dump.name)
                    ember = [server.measure()]  # also waits for the ids' file
                    peer, peer_row, ao_peer, ao_row = fbgemm_timer(args, dtype, dim, dump.name,
                                                                   threads)
                    fb, ao = [], []
                    for _ in range(args.pairs):
                        fb.append(peer())
                        ao.append(ao_peer())
                        ember.append(server.measure())
                    server.close()
                e = [m["lookups_per_s"] for m in ember[1:]]
                ratios = [a / b for a, b in zip(e, fb)]
                ao_ratios = [a / b for a, b in zip(e, ao)]
                bits = 8 if dtype == "int8" else 4
                results.append({
                    "dtype": dtype, "dim": dim, "threads": threads, "rows": args.rows,
                    "ember_lookups_per_s": statistics.median(e),
                    "fbgemm_lookups_per_s": statistics.median(fb),
                    "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "ember_row_bytes": 4 + (dim * bits + 7) // 8, "fbgemm_row_bytes": peer_row,
                    "torch_quantized_lookups_per_s": statistics.median(ao),
                    "torch_quantized_ratio": statistics.median(ao_ratios),
                    "torch_quantized_ratio_min": min(ao_ratios),
                    "torch_quantized_ratio_max": max(ao_ratios),
                    "torch_quantized_row_bytes": ao_row,
                    "ember_fp32_lookups_per_s": plain["fp32"],
                    "ember_fp16_lookups_per_s": plain["fp16"],
                    "vs_fp32": statistics.median(e) / plain["fp32"],
                    "vs_fp16": statistics.median(e) / plain["fp16"],
                })
                r = results[-1]
                if args.format == "json":
                    print(json.dumps(r), flush=True)
                else:
                    print(f"{dtype} dim {dim:4d} threads {threads}: Ember {r['ember_lookups_per_s']/1e6:7.1f}"
                          f" M/s, FBGEMM TBE {r['fbgemm_lookups_per_s']/1e6:6.1f} M/s, ratio "
                          f"{r['ratio']:.1f} [{r['ratio_min']:.1f}-{r['ratio_max']:.1f}]; torch "
                          f"quantized {r['torch_quantized_lookups_per_s']/1e6:6.1f} M/s, ratio "
                          f"{r['torch_quantized_ratio']:.2f} [{r['torch_quantized_ratio_min']:.2f}-"
                          f"{r['torch_quantized_ratio_max']:.2f}]; rows "
                          f"{r['ember_row_bytes']} / {r['fbgemm_row_bytes']} B; Ember fp32 "
                          f"{plain['fp32']/1e6:.1f}, fp16 {plain['fp16']/1e6:.1f} M/s: "
                          f"{r['vs_fp32']:.2f}x fp32, {r['vs_fp16']:.2f}x fp16", flush=True)


if __name__ == "__main__":
    main()
