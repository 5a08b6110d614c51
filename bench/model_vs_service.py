#!/usr/bin/env python3
"""Does the planner's cost model rank plans the way the service runs them?

A benchmark, not a test (timings on a shared machine). On a local CPU
cluster (`emberctl up --workers=N`): `emberctl calibrate` fits the model,
then for random collections and every forced sharding type (and the
planner's own choice) the plan is made with that model (`emberctl plan
--cost_model --sharding_type --format=json`: its predicted step time, the
slowest worker's forward + backward), created on the cluster with that exact
plan, and trained (lookup + SGD update per step, interleaved rounds). Prints
per collection the predicted and measured step times, their Spearman rank
correlation, and the measured / predicted ratios; then the correlation over
every plan.

    .venv/bin/python bench/model_vs_service.py [--collections 4] [--workers 2]
        [--steps 15] [--rounds 2] [--format json]
"""

import argparse
import collections
import json
import logging
import os
import subprocess
import sys
import tempfile

import numpy as np

import ember
from planner_vs_torchrec import ember_spec, random_tables, train_rate

TYPES = ["table_wise", "row_wise", "column_wise", "data_parallel", ""]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collections", type=int, default=4)
    p.add_argument("--tables", type=int, default=6)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--calibrate_caches", type=int, default=0,
                   help="1: the model includes the workers' caches (emberctl calibrate "
                        "--calibrate_caches)")
    p.add_argument("--emberctl", default="")
    p.add_argument("--format", default="table", choices=["table", "json"])
    return p.parse_args()


def spearman(a, b):
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    if np.std(ra) == 0 or np.std(rb) == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def plan_types(plan):
    """'table_wise 4, column_wise 2': the sharding types of a plan's tables."""
    if not plan:
        return "nothing"
    counts = collections.Counter(t["sharding_type"] for t in plan["plan"])
    return ", ".join(f"{t} {n}" for t, n in counts.most_common())


def main():
    args = parse_args()
    logging.disable(logging.WARNING)
    rng = np.random.default_rng(args.seed)
    emberctl = args.emberctl or ember._find_emberctl()
    work = tempfile.mkdtemp()
    w = args.workers
    report = {"collections": []}
    with ember.LocalCluster(workers=w, emberctl=emberctl) as cluster:
        client = ember.Client(cluster.address, timeout_s=120)
        model = os.path.join(work, "model.json")
        cal = subprocess.run([emberctl, "calibrate", f"--coordinator={cluster.address}",
                              f"--output={model}", "--calibrate_reps=15",
                              f"--calibrate_caches={'true' if args.calibrate_caches else 'false'}"],
                             check=True, capture_output=True, text=True)
        report["fit"] = next((l for l in cal.stdout.splitlines() if l.startswith("fit:")), "")
        report["caches"] = next((l for l in cal.stdout.splitlines() if l.startswith("caches:")), "")
        all_pred, all_meas = [], []
        for k in range(args.collections):
            tables = random_tables(rng, args.tables, 200_000)
            spec = ember_spec(f"c{k}", tables)
            spec_file = os.path.join(work, f"c{k}.json")
            json.dump(spec, open(spec_file, "w"))
            plans = {}
            for t in TYPES:
                cmd = [emberctl, "plan", f"--spec={spec_file}", f"--world_size={w}",
                       "--compute_device=cpu", f"--batch_size={args.batch}", "--num_trainers=1",
                       f"--cost_model={model}", "--format=json"]
                if t:
                    cmd.append(f"--sharding_type={t}")
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    continue
                plans[t or "planner"] = json.loads(r.stdout)
            names = list(plans)
            for n in names:
                client.create_collection(dict(spec, name=f"c{k}_{n}"), plan=plans[n])
            rates = {n: [] for n in names}
            for _ in range(args.rounds):
                for n in names:
                    rates[n].append(train_rate(client, f"c{k}_{n}", tables, args.batch,
                                               args.steps, rng))
            for n in names:
                client.drop_collection(f"c{k}_{n}")
            pred = [plans[n]["stats"]["max_cost_ms"] for n in names]
            meas = [1000.0 / float(np.median(rates[n])) for n in names]
            all_pred += pred
            all_meas += meas
            row = {"collection": k, "plans": names, "predicted_ms": pred, "measured_ms": meas,
                   "spearman": spearman(pred, meas),
                   "planner_chose": plan_types(plans.get("planner"))}
            report["collections"].append(row)
            print(f"collection {k}: spearman {row['spearman']:.2f}", file=sys.stderr)
        report["spearman_all"] = spearman(all_pred, all_meas)
        ratios = np.array(all_meas) / np.array(all_pred)
        report["measured_over_predicted"] = [float(ratios.min()), float(np.median(ratios)),
                                             float(ratios.max())]
    if args.format == "json":
        print(json.dumps(report))
        return
    print(report["fit"])
    print(report["caches"])
    for row in report["collections"]:
        print(f"collection {row['collection']} (Spearman {row['spearman']:.2f}; the planner "
              f"chose {row['planner_chose']})")
        for n, p, m in zip(row["plans"], row["predicted_ms"], row["measured_ms"]):
            print(f"  {n:14s} predicted {p:8.3f} ms  measured {m:8.3f} ms  ratio {m / p:5.2f}")
    lo, med, hi = report["measured_over_predicted"]
    print(f"all plans: Spearman {report['spearman_all']:.2f}; measured / predicted "
          f"{lo:.2f} .. {hi:.2f} (median {med:.2f})")


if __name__ == "__main__":
    main()
