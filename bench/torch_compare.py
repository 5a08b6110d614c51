#!/usr/bin/env python3
"""Ember's CPU or CUDA backend against PyTorch's nn.EmbeddingBag on identical data.

A benchmark, not a test. For every (dim, threads) it starts bench/kernel_bench
--serve (which writes the ids it used with --dump_ids and then times its
backend on request), sets torch.nn.EmbeddingBag up on exactly those ids, and
times the two in turn, --pairs times (each pair one Ember and one PyTorch
timing, seconds apart), over --rounds such rounds (each with fresh tables on
both sides). It prints the median ratio Ember / PyTorch over all pairs (> 1
means Ember is faster) and their range.

  Forward:  EmbeddingBag(ids, offsets) under torch.no_grad().
  Backward: one training step (forward with autograd, backward of a constant
            gradient, sparse SGD or Adagrad step) minus the autograd forward,
            i.e. the backward + optimizer part, against kernel_bench's
            ApplyGradients (duplicates merged, the same optimizer, one update
            per row).

--id_sets=N gives both sides the same N batches of ids, the calls cycling
through them. With one (the default) every call gathers the same rows, which
stay in the caches when they fit (a hot-batch figure); with enough sets that
their rows pass the last-level cache (e.g. 16: 655,360 ids), the table is
read as training's fresh batches read it, from memory.

--tables=T compares a collection: T tables of --rows x dim, one feature
each; Ember looks them up in one fused call, PyTorch with one EmbeddingBag
per table called in turn (its plain API), the optimizer over all of them.
--tables=8 --rows=500000 --batch=4096 --dims=64 is service_bench's
collection. Figures count the ids of all tables.

--dtype=fp16 puts both sides' weights in half precision (PyTorch's
EmbeddingBag in torch.float16, its output fp16; Ember's output is fp32).

With --device=cuda both run on GPU 0. Ember's backend takes host arrays and
returns host arrays (a worker's gRPC payloads live in host memory), so the
peer figure that ratios use copies the ids to the device and the output back
in every call too; PyTorch's device-resident figure (ids already on the GPU,
output left there) is printed beside it as the kernel-only bound.

Usually run through bench/torch_compare.sh, which runs it with the SDK's
.venv (PyPI torch) and builds kernel_bench first. Needs torch and numpy.
"""

import argparse
import json
import os
import sys
import tempfile
import time

from kernel_bench_server import KernelBenchServer


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel_bench", default="bazel-bin/bench/kernel_bench",
                   help="path of the built kernel_bench binary")
    p.add_argument("--rows", type=int, default=1000000)
    p.add_argument("--dims", default="64,128", help="comma-separated embedding dims")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--pooling_factor", type=int, default=20)
    p.add_argument("--distribution", default="uniform", choices=["uniform", "zipf"])
    p.add_argument("--pooling", default="sum", choices=["sum", "mean"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16"], help="weights")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adagrad"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tables", type=int, default=1,
                   help="tables (one feature each) per call; > 1: a collection")
    p.add_argument("--id_sets", type=int, default=1,
                   help="batches of ids the calls cycle through (1: the same batch every call)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per (dim, threads), each with its own kernel_bench process and "
                        "PyTorch tables (where memory places a table moves its speed)")
    p.add_argument("--pairs", type=int, default=3,
                   help="Ember / PyTorch measurements taken in turn per round, on the same "
                        "tables; the figures are medians over all pairs, the ratio the median "
                        "of the pairs' ratios and the range theirs (this kind of VM's memory "
                        "speed drifts from minute to minute, which pairs side-step)")
    p.add_argument("--format", default="table", choices=["table", "json"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    return p.parse_args()


def time_it(fn, iters, sync=lambda: None):
    """Seconds per call of fn(i), i counting the calls (3 warm-ups first)."""
    for i in range(3):
        fn(i)
    sync()
    start = time.perf_counter()
    for i in range(3, 3 + iters):
        fn(i)
    sync()
    return (time.perf_counter() - start) / iters


def torch_timer(torch, np, ids_path, a, dim, threads):
    """Sets PyTorch's tables up on the ids kernel_bench wrote; returns a
    function that times them: (forward, backward) ids/s, on cuda also the
    device-resident pair."""
    torch.set_num_threads(threads)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    all_ids = torch.from_numpy(np.fromfile(ids_path, dtype="<i8"))
    n = a.batch * a.pooling_factor  # ids per table per call
    want = n * a.tables * a.id_sets
    if all_ids.numel() != want:
        sys.exit(f"torch_compare: {ids_path} holds {all_ids.numel()} ids, expected {want}")
    # host_sets[k][t]: batch k's ids of table t (kernel_bench's --dump_ids order).
    host_sets = [[all_ids[(k * a.tables + t) * n:(k * a.tables + t + 1) * n]
                  for t in range(a.tables)] for k in range(a.id_sets)]
    host_offsets = torch.arange(0, n, a.pooling_factor, dtype=torch.int64)
    dtype = torch.float16 if a.dtype == "fp16" else torch.float32
    bags = [torch.nn.EmbeddingBag(a.rows, dim, mode=a.pooling, sparse=True, device=dev, dtype=dtype)
            for _ in range(a.tables)]
    params = [p for bag in bags for p in bag.parameters()]
    opt = (torch.optim.Adagrad(params, lr=0.01) if a.optimizer == "adagrad"
           else torch.optim.SGD(params, lr=0.01))
    host_grad = torch.full((a.batch, dim), 1e-3, dtype=dtype)
    dev_sets = [[ids.to(dev) for ids in per_table] for per_table in host_sets]
    dev_offsets, dev_grad = host_offsets.to(dev), host_grad.to(dev)

    # Pageable host tensors, as Ember's backend is handed them.
    def inputs(resident, i, t):
        k = i % a.id_sets
        if resident or a.device == "cpu":
            return dev_sets[k][t], dev_offsets
        return host_sets[k][t].to(dev), host_offsets.to(dev)

    def gradient(resident):
        return dev_grad if resident or a.device == "cpu" else host_grad.to(dev)

    def figures(resident):
        def forward(i):
            with torch.no_grad():
                for t, bag in enumerate(bags):
                    out = bag(*inputs(resident, i, t))
                    if not resident:
                        out.cpu()

        def forward_autograd(i):
            for t, bag in enumerate(bags):
                bag(*inputs(resident, i, t))

        def train_step(i):
            opt.zero_grad(set_to_none=True)
            outs = [bag(*inputs(resident, i, t)) for t, bag in enumerate(bags)]
            torch.autograd.backward(outs, [gradient(resident)] * len(outs))
            opt.step()

        fwd_s = time_it(forward, a.iters, sync)
        fwd_ag_s = time_it(forward_autograd, a.iters, sync)
        step_s = time_it(train_step, a.iters, sync)
        ids = n * a.tables
        return ids / fwd_s, ids / max(step_s - fwd_ag_s, 1e-9)

    if a.device == "cpu":
        return lambda: figures(True) + (None, None)
    return lambda: figures(False) + figures(True)


def main():
    a = parse_args()
    try:
        import numpy as np
        import torch
    except ImportError as e:
        sys.exit(f"torch_compare: {e}; run bench/torch_compare.sh, which uses the SDK's .venv")
    if not os.access(a.kernel_bench, os.X_OK):
        sys.exit(f"torch_compare: {a.kernel_bench} is not built; "
                 "run: bazel build -c opt //bench:kernel_bench")
    peer = f"torch {torch.__version__}"
    if a.format == "table":
        print(f"Ember {a.device} backend vs PyTorch nn.EmbeddingBag ({peer}); rows={a.rows} "
              f"batch={a.batch} L={a.pooling_factor} {a.distribution} {a.pooling}, {a.dtype}, "
              f"{a.optimizer}, tables={a.tables}, id_sets={a.id_sets}")
        print(f"{'dim':>4} {'thr':>3} | {'ember fwd':>12} {'torch fwd':>12} {'ratio [range]':>18} | "
              f"{'ember bwd':>12} {'torch bwd':>12} {'ratio [range]':>18}   (ids/s; medians of "
              f"{a.rounds} rounds x {a.pairs} alternating pairs)")
    with tempfile.TemporaryDirectory() as tmp:
        ids_path = os.path.join(tmp, "ids.bin")
        for dim in [int(d) for d in a.dims.split(",")]:
            for threads in [int(t) for t in a.threads.split(",")]:
                cmd = [a.kernel_bench, f"--rows={a.rows}", f"--dim={dim}", f"--batch={a.batch}",
                       f"--pooling_factor={a.pooling_factor}", f"--threads={threads}",
                       f"--distribution={a.distribution}", f"--pooling={a.pooling}",
                       f"--dtype={a.dtype}", f"--optimizer={a.optimizer}", f"--iters={a.iters}",
                       f"--id_sets={a.id_sets}", f"--tables={a.tables}",
                       "--format=json", f"--dump_ids={ids_path}", f"--backend={a.device}"]
                # Each round's pairs alternate Ember and PyTorch on the same
                # ids and tables, so a drift of the machine's speed reaches
                # both alike.
                rounds = []  # (ember, torch fwd, torch bwd, resident fwd, resident bwd)
                for _ in range(max(1, a.rounds)):
                    server = KernelBenchServer(cmd, "torch_compare")
                    ember = server.measure()  # the ids file is written once this answers
                    torch_time = torch_timer(torch, np, ids_path, a, dim, threads)
                    for pair in range(max(1, a.pairs)):
                        if pair > 0:
                            ember = server.measure()
                        rounds.append((ember,) + torch_time())
                    server.close()
                    del torch_time  # free this round's tables before the next round's
                med = lambda v: float(np.median(v))
                ember = rounds[0][0]
                e_fwd = med([r[0]["lookups_per_s"] for r in rounds])
                e_bwd = med([r[0]["bwd_lookups_per_s"] for r in rounds])
                t_fwd = med([r[1] for r in rounds])
                t_bwd = med([r[2] for r in rounds])
                t_fwd_res = None if rounds[0][3] is None else med([r[3] for r in rounds])
                t_bwd_res = None if rounds[0][4] is None else med([r[4] for r in rounds])
                fwd_ratios = [r[0]["lookups_per_s"] / r[1] for r in rounds]
                bwd_ratios = [r[0]["bwd_lookups_per_s"] / r[2] for r in rounds]
                row = {
                    "dim": dim, "threads": threads, "rows": a.rows, "batch": a.batch,
                    "pooling_factor": a.pooling_factor, "distribution": a.distribution,
                    "pooling": a.pooling, "dtype": a.dtype, "optimizer": a.optimizer,
                    "id_sets": a.id_sets, "tables": a.tables,
                    "backend": ember["backend"], "peer": peer,
                    "rounds": max(1, a.rounds), "pairs_per_round": max(1, a.pairs),
                    "lookups_per_s": e_fwd, "torch_lookups_per_s": t_fwd,
                    "ratio": med(fwd_ratios), "ratio_range": [min(fwd_ratios), max(fwd_ratios)],
                    "bwd_lookups_per_s": e_bwd,
                    "torch_bwd_lookups_per_s": t_bwd,
                    "bwd_ratio": med(bwd_ratios),
                    "bwd_ratio_range": [min(bwd_ratios), max(bwd_ratios)],
                    "device": a.device,
                }
                if t_fwd_res is not None:
                    row["torch_resident_lookups_per_s"] = t_fwd_res
                    row["torch_resident_bwd_lookups_per_s"] = t_bwd_res
                if a.format == "json":
                    print(json.dumps(row), flush=True)
                else:
                    lo, hi = row["ratio_range"]
                    blo, bhi = row["bwd_ratio_range"]
                    print(f"{dim:>4} {threads:>3} | {row['lookups_per_s']:>12.3e} "
                          f"{t_fwd:>12.3e} {row['ratio']:>5.2f}x [{lo:.2f}-{hi:.2f}] | "
                          f"{row['bwd_lookups_per_s']:>12.3e} {t_bwd:>12.3e} "
                          f"{row['bwd_ratio']:>5.2f}x [{blo:.2f}-{bhi:.2f}]", flush=True)
                    if t_fwd_res is not None:
                        print(f"{'':>8} | torch, ids/output already on the GPU: "
                              f"fwd {t_fwd_res:.3e}, bwd {t_bwd_res:.3e}", flush=True)


if __name__ == "__main__":
    main()
