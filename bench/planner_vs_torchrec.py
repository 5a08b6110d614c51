#!/usr/bin/env python3
"""Ember's planner against TorchRec's, on the same random collections.

A benchmark, not a test (torchrec from the SDK's .venv). Two parts:

  planning   for each (tables, ranks): TorchRec's EmbeddingShardingPlanner
             and `emberctl plan` on the same tables and pooling factors (H100
             topology, batch 512 per rank): planning time of each, and both
             plans scored by Ember's cost model (`emberctl plan --plan=FILE`
             checks and scores TorchRec's plan as it would any other) and
             by TorchRec's own estimators (EmbeddingPerfEstimator through
             its enumerator, on each plan's exact shards and ranks: the
             slowest rank's summed shard perf, the quantity TorchRec's
             partitioner balances).
  measured   for a few collections on a local CPU cluster (`emberctl up
             --workers=2`, or `--workers`): TorchRec's CPU plan and Ember's
             plan, each created on Ember (TorchRec's through `create_collection(plan=...)` with
             torchrec's own ParameterSharding objects) and trained
             (lookup + update per step, on the same batches): steps/s of
             each and the ratio (> 1: Ember's plan faster). Ember plans
             these with the model `emberctl calibrate` fits on the same
             cluster first. A control: TorchRec's plan created a second
             time (an A/A pair), so each collection shows how far apart two
             identical plans measure. The three take turns step by step
             (`--turn`), the order rotating every turn, so this VM's drifts
             in memory speed fall on all three alike; a round's rate is its
             steps over the time its own steps took. Verdicts compare the
             median ratio of Ember's plan with the run's A/A medians (and
             the ratios of collections where both planners chose the same
             plan): "ahead" at >= 1, "slower" below the lowest of them (a
             deficit no identical pair showed), else "level".

    .venv/bin/python bench/planner_vs_torchrec.py [--sizes 10x8,50x8,100x8]
        [--measured 3] [--steps 20] [--rounds 3] [--turn 1] [--format json]
"""

import argparse
import copy
import json
import logging
import os
import random
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

import ember


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10x8,50x8,100x8,10x64",
                   help="tables x ranks for the planning part")
    p.add_argument("--measured", type=int, default=3, help="collections measured on Ember")
    p.add_argument("--measured_tables", type=int, default=8)
    p.add_argument("--workers", type=int, default=2, help="workers of the measured cluster")
    p.add_argument("--steps", type=int, default=20, help="timed steps per plan and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--turn", type=int, default=1,
                   help="steps each plan takes in a row before the next one's turn")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--calibrate", type=int, default=1,
                   help="1: Ember plans the measured collections with a model calibrated on the "
                        "cluster (emberctl calibrate); 0: with the CPU defaults")
    p.add_argument("--calibrate_caches", type=int, default=0,
                   help="1: the calibrated model includes the workers' caches (emberctl "
                        "calibrate --calibrate_caches)")
    p.add_argument("--emberctl", default="")
    p.add_argument("--format", default="table", choices=["table", "json"])
    args = p.parse_args()
    for name in ("measured_tables", "workers", "steps", "rounds", "turn", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.measured < 0:
        p.error("--measured must be >= 0")
    return args


def random_tables(rng, n, max_rows):
    tables = []
    for i in range(n):
        rows = int(10 ** rng.uniform(3, np.log10(max_rows)))
        tables.append({"name": f"t{i}", "num_embeddings": rows,
                       "embedding_dim": int(rng.choice([16, 32, 64, 128])),
                       "pf": float(rng.integers(1, 50))})
    return tables


def ember_spec(name, tables):
    return {"name": name,
            "tables": [{"name": t["name"], "num_embeddings": t["num_embeddings"],
                        "embedding_dim": t["embedding_dim"], "feature_names": [f"f_{t['name']}"],
                        "pooling": "SUM", "optimizer": {"type": "SGD", "learning_rate": 0.01}}
                       for t in tables],
            "constraints": {t["name"]: {"pooling_factors": [t["pf"]]} for t in tables}}


def torchrec_inputs(tables, world, device):
    """The tables as TorchRec's module on the meta device, with the topology and the
    constraints (pooling factors) its planner and enumerator take."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import ParameterConstraints, Topology
    configs = [EmbeddingBagConfig(name=t["name"], embedding_dim=t["embedding_dim"],
                                  num_embeddings=t["num_embeddings"],
                                  feature_names=[f"f_{t['name']}"]) for t in tables]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    topology = Topology(world_size=world, compute_device=device, local_world_size=min(world, 8))
    constraints = {t["name"]: ParameterConstraints(pooling_factors=[t["pf"]]) for t in tables}
    return ebc, topology, constraints


def torchrec_plan(tables, world, device, batch):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    ebc, topology, constraints = torchrec_inputs(tables, world, device)
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch,
                                       constraints=constraints)
    start = time.perf_counter()
    plan = planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    return plan.plan[""], time.perf_counter() - start


def torchrec_model(tables, world, device, batch):
    """TorchRec's module, enumerator (estimators inside) and sharder for the tables."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    ebc, topology, constraints = torchrec_inputs(tables, world, device)
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=batch, constraints=constraints)
    return ebc, enumerator, EmbeddingBagCollectionSharder()


def plan_entries_of_torchrec(shardings, world):
    """TorchRec's ParameterShardings as Ember's plan entries (table, type, kernel, shards)."""
    entries = []
    for name, ps in shardings.items():
        if ps.sharding_spec is None:  # data_parallel: a full replica on each rank
            shards = [{"offsets": None, "sizes": None, "rank": r}
                      for r in (ps.ranks if ps.ranks is not None else range(world))]
        else:
            shards = [{"offsets": list(sh.shard_offsets), "sizes": list(sh.shard_sizes),
                       "rank": int(re.search(r"rank:(\d+)", str(sh.placement)).group(1))}
                      for sh in ps.sharding_spec.shards]
        entries.append({"table": name, "sharding_type": ps.sharding_type,
                        "compute_kernel": ps.compute_kernel, "shards": shards})
    return entries


def plan_entries_of_ember(plan):
    """`emberctl plan --format=json`'s tables as plan entries (a data_parallel table, which
    lists no shards, as a full replica on each of its ranks)."""
    entries = []
    for e in plan["plan"]:
        shards = [{"offsets": sh["offsets"], "sizes": sh["sizes"], "rank": sh["rank"]}
                  for sh in e["shards"]]
        if not shards:
            shards = [{"offsets": None, "sizes": None, "rank": r} for r in e["ranks"]]
        entries.append({"table": e["table"], "sharding_type": e["sharding_type"],
                        "compute_kernel": e["compute_kernel"], "shards": shards})
    return entries


def same_plan(a, b):
    """Whether two lists of plan entries place every table alike (type, shards, ranks)."""
    def norm(entries):
        return {e["table"]: (e["sharding_type"],
                             sorted((tuple(s["offsets"] or ()), tuple(s["sizes"] or ()), s["rank"])
                                    for s in e["shards"]))
                for e in entries}
    return norm(a) == norm(b)


def torchrec_score(tables, world, device, batch, entries):
    """A plan scored by TorchRec's estimators: each table's option of the plan's sharding type
    and kernel from TorchRec's enumerator, given the plan's exact shards and ranks and estimated
    again; the slowest rank's summed shard perf (ms). None when TorchRec has no such option."""
    from torchrec.distributed.planner.types import Shard
    ebc, enumerator, sharder = torchrec_model(tables, world, device, batch)
    options = {(o.name, o.sharding_type, o.compute_kernel): o
               for o in enumerator.enumerate(ebc, [sharder])}
    rows = {t["name"]: t["num_embeddings"] for t in tables}
    dims = {t["name"]: t["embedding_dim"] for t in tables}
    chosen = []
    for e in entries:
        base = options.get((e["table"], e["sharding_type"], e["compute_kernel"]))
        if base is None:
            return None
        o = copy.copy(base)
        o.shards = [Shard(size=s["sizes"] or [rows[e["table"]], dims[e["table"]]],
                          offset=s["offsets"] or [0, 0], rank=s["rank"])
                    for s in e["shards"]]
        chosen.append(o)
    enumerator.populate_estimates(chosen)
    per_rank = [0.0] * world
    for o in chosen:
        for sh in o.shards:
            per_rank[sh.rank] += sh.perf.total
    return max(per_rank)


def to_json(shardings):
    out = {}
    for name, ps in shardings.items():
        spec = ps.sharding_spec
        out[name] = {"sharding_type": ps.sharding_type, "compute_kernel": ps.compute_kernel,
                     "ranks": list(ps.ranks) if ps.ranks is not None else None,
                     "sharding_spec": None if spec is None else {"shards": [
                         {"shard_offsets": list(s.shard_offsets),
                          "shard_sizes": list(s.shard_sizes), "placement": str(s.placement)}
                         for s in spec.shards]}}
    return out


def emberctl_plan(emberctl, spec_file, world, device, batch, plan_file=None):
    args = [emberctl, "plan", f"--spec={spec_file}", f"--world_size={world}",
            f"--local_world_size={min(world, 8)}", f"--compute_device={device}",
            f"--batch_size={batch}", f"--num_trainers={world}"]
    if plan_file:
        args.append(f"--plan={plan_file}")
    text = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    cost = float(re.search(r"estimated step: max ([0-9.e+-]+) ms", text).group(1))
    ms = float(re.search(r"in ([0-9.e+-]+) ms", text).group(1))
    types = {}
    for line in text.splitlines():
        m = re.match(r"^(t\d+)\s+\|\s+(\w+)\s+\|", line)
        if m:
            types[m.group(2)] = types.get(m.group(2), 0) + 1
    return cost, ms, types


def ember_plan_json(emberctl, spec_file, world, device, batch, cost_model=""):
    args = [emberctl, "plan", f"--spec={spec_file}", f"--world_size={world}",
            f"--compute_device={device}", f"--batch_size={batch}", f"--num_trainers={world}",
            "--format=json"]
    if cost_model:
        args.append(f"--cost_model={cost_model}")
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def training_batches(tables, batch, rng, count=4):
    """`count` random KJT batches over `tables` (uniform ids, each table's
    pooling factor), shared by every plan of one collection."""
    keys = [f"f_{t['name']}" for t in tables]
    rows = {f"f_{t['name']}": t["num_embeddings"] for t in tables}
    pfs = {f"f_{t['name']}": max(1, int(t["pf"])) for t in tables}
    return [ember.KeyedJaggedTensor.from_jagged(
        {k: [list(rng.integers(0, rows[k], size=pfs[k])) for _ in range(batch)] for k in keys})
        for _ in range(count)]


def train_step(client, name):
    """One training step on collection `name`: a lookup, then small fixed
    gradients in the output's layout applied."""
    grads = None

    def step(kjt):
        nonlocal grads
        out = client.lookup(name, kjt)
        if grads is None:
            grads = ember.KeyedTensor(out.keys, out.length_per_key,
                                      np.full(out.values.shape, 1e-4, dtype=np.float32))
        client.apply_gradients(name, kjt, grads)

    return step


def interleaved_rates(steps_by_who, batches, rounds, steps, turn):
    """Steps/s of each named step function, per round. Within a round the
    functions take turns of `turn` steps on the same batches, the order
    rotating every turn, so a drift in the machine's speed (this VM's
    memory bandwidth swings within seconds) falls on all of them alike."""
    who_all = list(steps_by_who)
    for who in who_all:  # warm-up
        for i in range(3):
            steps_by_who[who](batches[i % len(batches)])
    rates = {who: [] for who in who_all}
    for r in range(rounds):
        spent = dict.fromkeys(who_all, 0.0)
        for t in range(0, steps, turn):
            for i in range(len(who_all)):
                who = who_all[(i + r + t // turn) % len(who_all)]
                start = time.perf_counter()
                for s in range(t, min(t + turn, steps)):
                    steps_by_who[who](batches[s % len(batches)])
                spent[who] += time.perf_counter() - start
        for who in who_all:
            rates[who].append(steps / spent[who])
    return rates


def main():
    args = parse_args()
    logging.disable(logging.WARNING)
    rng = np.random.default_rng(args.seed)
    emberctl = args.emberctl or ember._find_emberctl()
    work = tempfile.mkdtemp()
    results = {"planning": [], "measured": []}

    for size in args.sizes.split(","):
        n, world = (int(x) for x in size.split("x"))
        tables = random_tables(rng, n, 10_000_000)
        spec_file = os.path.join(work, f"spec_{n}_{world}.json")
        json.dump(ember_spec(f"p{n}x{world}", tables), open(spec_file, "w"))
        tr, tr_s = torchrec_plan(tables, world, "cuda", 512)
        tr_file = os.path.join(work, f"tr_{n}_{world}.json")
        json.dump(to_json(tr), open(tr_file, "w"))
        tr_cost, _, tr_types = emberctl_plan(emberctl, spec_file, world, "cuda", 512, tr_file)
        em_cost, em_ms, em_types = emberctl_plan(emberctl, spec_file, world, "cuda", 512)
        em_entries = plan_entries_of_ember(
            json.loads(ember_plan_json(emberctl, spec_file, world, "cuda", 512)))
        tr_by_tr = torchrec_score(tables, world, "cuda", 512, plan_entries_of_torchrec(tr, world))
        em_by_tr = torchrec_score(tables, world, "cuda", 512, em_entries)
        row = {"tables": n, "ranks": world, "torchrec_plan_s": tr_s, "ember_plan_ms": em_ms,
               "speedup": tr_s * 1000 / em_ms, "torchrec_plan_cost_ms": tr_cost,
               "ember_plan_cost_ms": em_cost, "torchrec_plan_torchrec_ms": tr_by_tr,
               "ember_plan_torchrec_ms": em_by_tr, "torchrec_types": tr_types,
               "ember_types": em_types}
        results["planning"].append(row)
        print(f"planned {n} tables on {world} ranks: TorchRec {tr_s:.2f} s, Ember {em_ms:.1f} ms",
              file=sys.stderr)

    if args.measured > 0:
        measure(args, rng, emberctl, work, results)
    report(args, results)


def measure(args, rng, emberctl, work, results):
    with ember.LocalCluster(workers=args.workers, emberctl=emberctl) as cluster:
        client = ember.Client(cluster.address, timeout_s=120)
        # Ember plans as a deployment would: with the model calibrated on
        # these workers (emberctl calibrate).
        cost_model = ""
        if args.calibrate:
            cost_model = os.path.join(work, "model.json")
            subprocess.run([emberctl, "calibrate", f"--coordinator={cluster.address}",
                            f"--output={cost_model}", "--calibrate_reps=15",
                            f"--calibrate_caches={'true' if args.calibrate_caches else 'false'}"],
                           check=True, capture_output=True, text=True)
        for k in range(args.measured):
            tables = random_tables(rng, args.measured_tables, 300_000)
            spec = ember_spec(f"m{k}", tables)
            spec_file = os.path.join(work, f"m{k}.json")
            json.dump(spec, open(spec_file, "w"))
            tr, _ = torchrec_plan(tables, args.workers, "cpu", args.batch)
            em = json.loads(ember_plan_json(emberctl, spec_file, args.workers, "cpu", args.batch,
                                             cost_model))
            who_all = ("torchrec", "ember", "control")
            client.create_collection(dict(spec, name=f"m{k}_torchrec"), plan=tr)
            client.create_collection(dict(spec, name=f"m{k}_ember"), plan=em)
            client.create_collection(dict(spec, name=f"m{k}_control"), plan=tr)
            rates = interleaved_rates(
                {who: train_step(client, f"m{k}_{who}") for who in who_all},
                training_batches(tables, args.batch, rng), args.rounds, args.steps, args.turn)
            for who in who_all:
                client.drop_collection(f"m{k}_{who}")
            tr_rate, em_rate = float(np.median(rates["torchrec"])), float(np.median(rates["ember"]))
            ctl_rate = float(np.median(rates["control"]))
            # Ratios within each round (the three ran back to back).
            em_ratios = [e / t for e, t in zip(rates["ember"], rates["torchrec"])]
            aa_ratios = [c / t for c, t in zip(rates["control"], rates["torchrec"])]
            em_ratio = float(np.median(em_ratios))
            em_entries = plan_entries_of_ember(em)
            row = {"collection": k, "tables": len(tables),
                   "same_plan": same_plan(plan_entries_of_torchrec(tr, args.workers), em_entries),
                   "torchrec_types": sorted({ps.sharding_type for ps in tr.values()}),
                   "ember_types": sorted({t["sharding_type"] for t in em["plan"]}),
                   "torchrec_plan_steps_per_s": tr_rate, "ember_plan_steps_per_s": em_rate,
                   "control_steps_per_s": ctl_rate, "ratio": em_ratio,
                   "aa_ratio": float(np.median(aa_ratios)),
                   "aa_range": [float(min(aa_ratios)), float(max(aa_ratios))]}
            results["measured"].append(row)
            print(f"measured collection {k}: TorchRec's plan {tr_rate:.1f} steps/s, "
                  f"Ember's {em_rate:.1f}, TorchRec's again {ctl_rate:.1f}", file=sys.stderr)
        # Identical plans on both sides make Ember's ratio one more A/A pair.
        aa = [r["aa_ratio"] for r in results["measured"]]
        aa += [r["ratio"] for r in results["measured"] if r["same_plan"]]
        floor = min(aa) if aa else 1.0
        results["aa_floor"] = floor
        for r in results["measured"]:
            r["verdict"] = ("same plan" if r["same_plan"] else
                            "ahead" if r["ratio"] >= 1.0 else
                            "level" if r["ratio"] >= floor else "slower")



def report(args, results):
    if args.format == "json":
        print(json.dumps(results))
        return
    def ms(v):
        return "n/a" if v is None else f"{v:.4f}"

    print("tables | ranks | TorchRec planning s | Ember planning ms | speedup | "
          "TorchRec plan, Ember model ms | Ember plan, Ember model ms | "
          "TorchRec plan, TorchRec estimators ms | Ember plan, TorchRec estimators ms | "
          "TorchRec types | Ember types")
    for r in results["planning"]:
        print(f"{r['tables']} | {r['ranks']} | {r['torchrec_plan_s']:.2f} | {r['ember_plan_ms']:.1f} | "
              f"{r['speedup']:.0f}x | {r['torchrec_plan_cost_ms']:.4f} | {r['ember_plan_cost_ms']:.4f} | "
              f"{ms(r['torchrec_plan_torchrec_ms'])} | {ms(r['ember_plan_torchrec_ms'])} | "
              f"{r['torchrec_types']} | {r['ember_types']}")
    print()
    print("collection | tables | TorchRec plan types | Ember plan types | TorchRec plan steps/s | "
          "Ember plan steps/s | ratio (median of rounds) | A/A ratio, median [range of rounds] | "
          "verdict")
    for r in results["measured"]:
        lo, hi = r["aa_range"]
        print(f"{r['collection']} | {r['tables']} | {','.join(r['torchrec_types'])} | "
              f"{','.join(r['ember_types'])} | {r['torchrec_plan_steps_per_s']:.1f} | "
              f"{r['ember_plan_steps_per_s']:.1f} | {r['ratio']:.3f} | "
              f"{r['aa_ratio']:.3f} "
              f"[{lo:.2f}, {hi:.2f}] | {r['verdict']}")
    if results["measured"]:
        verdicts = [r["verdict"] for r in results["measured"]]
        floor = results["aa_floor"]
        print(f"Ember's plan ahead on {verdicts.count('ahead')}, level (at or above the lowest "
              f"A/A median, {floor:.3f}) on {verdicts.count('level')}, slower on "
              f"{verdicts.count('slower')}, the same plan as TorchRec's on "
              f"{verdicts.count('same plan')} of {len(verdicts)} collections")


if __name__ == "__main__":
    main()
