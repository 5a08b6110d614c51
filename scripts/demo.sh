#!/usr/bin/env bash
# Sets up what is missing, builds emberctl, then plans the seed tutorial's
# four tables (examples/seed_tables.json) on 2 workers for each sharding type,
# as TorchRec's tutorial does, and once more with the planner free to choose.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
echo "==> building emberctl" >&2
bazel build -c opt //:emberctl >&2
emberctl="$(bazel info -c opt bazel-bin 2>/dev/null)/cli/emberctl"

for type in table_wise row_wise column_wise data_parallel; do
  echo
  echo "================ sharding_type=$type, world_size=2 ================"
  "$emberctl" plan --spec=examples/seed_tables.json --world_size=2 --sharding_type="$type"
done

echo
echo "================ planner's choice, 8 GPUs on 2 hosts ================"
"$emberctl" plan --spec=examples/seed_tables.json --world_size=8 --local_world_size=4

echo
echo "================ same, as JSON ================"
"$emberctl" plan --spec=examples/seed_tables.json --world_size=2 --sharding_type=row_wise --format=json
