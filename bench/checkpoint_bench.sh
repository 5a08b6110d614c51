#!/usr/bin/env bash
# Checkpoint and restore figures for GIB GiB of tables (default 1) on a local
# 2-worker cluster: the update pause (fence), the write rate and the restore
# time, as emberctl prints them. Usage: bench/checkpoint_bench.sh [GIB] [ROOT]
set -euo pipefail
cd "$(dirname "$0")/.."
gib=${1:-1}
root=${2:-$(mktemp -d /tmp/ember_ckpt_bench_XXXXXX)}
bazel build -c opt //:emberctl >/dev/null 2>&1
ctl=bazel-bin/cli/emberctl
rows=$(( gib * 1024 * 1024 * 1024 / (128 * 4) / 4 ))  # 4 tables of dim 128, fp32, SGD
spec=$(mktemp /tmp/ember_ckpt_bench_spec_XXXXXX.json)
{
  echo '{"name": "bench", "tables": ['
  for t in 0 1 2 3; do
    sep=$([ $t -lt 3 ] && echo , || true)
    echo "{\"name\": \"t$t\", \"num_embeddings\": $rows, \"embedding_dim\": 128, \"feature_names\": [\"f$t\"], \"optimizer\": {\"type\": \"SGD\", \"learning_rate\": 0.01}}$sep"
  done
  echo ']}'
} > "$spec"
log=$(mktemp)
$ctl up --workers=2 > "$log" 2>/dev/null &
up=$!
trap 'kill $up 2>/dev/null; wait $up 2>/dev/null; rm -rf "$spec" "$log" "$root"' EXIT
for _ in $(seq 100); do grep -q '^ready:' "$log" && break; sleep 0.2; done
addr=$(awk '/^coordinator:/ {print $2}' "$log")
echo "== $gib GiB in 4 tables of [$rows, 128] fp32, row-wise on 2 CPU workers; ROOT $root"
$ctl create --coordinator="$addr" --spec="$spec" --sharding_type=row_wise >/dev/null
for i in 1 2 3; do
  $ctl checkpoint --coordinator="$addr" --collection=bench --dir="$root" | grep -v "^checkpoint"
done
start=$(date +%s.%N)
$ctl restore --coordinator="$addr" --from="$root" --collection=restored | tail -1
awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN {printf "restore wall time: %.2f s\n", e - s}'
