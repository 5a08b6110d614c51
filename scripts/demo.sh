#!/usr/bin/env bash
# The seed tutorial end to end. Sets up what is missing, builds, then
# (examples/run_seed_tutorial.sh) starts a local cluster of a coordinator and
# 2 worker processes on 127.0.0.1 and, for each of table_wise, row_wise,
# column_wise and data_parallel, creates the seed's four tables
# (examples/seed_tables.json), prints the plan as TorchRec does, runs
# KeyedJaggedTensor lookups and SGD steps through the client SDK, checks them
# against an in-process copy of the collection and prints one result line per
# sharding type. Then examples/train_dlrm.py trains a small DLRM-style model
# from PyTorch through the Python SDK (tables on Ember, row-wise Adagrad
# fused on the workers) and prints its held-out AUC. Exits non-zero if any
# part fails.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
echo "==> building emberctl and the seed tutorial" >&2
bazel build -c opt //:emberctl //examples:seed_tutorial //python/ember:_ember.so >&2
bin="$(bazel info -c opt bazel-bin 2>/dev/null)"

echo "================ planner's choice for 8 GPUs on 2 hosts (a preview, no cluster) ================"
"$bin/cli/emberctl" plan --spec=examples/seed_tables.json --world_size=8 --local_world_size=4 --compute_device=cuda
echo
examples/run_seed_tutorial.sh "$bin/cli/emberctl" "$bin/examples/seed_tutorial" \
  examples/seed_tables.json
echo
echo "================ a DLRM-style model trained from PyTorch (examples/train_dlrm.py) ================"
EMBER_EMBERCTL="$bin/cli/emberctl" .venv/bin/python examples/train_dlrm.py --steps=300
