#!/usr/bin/env bash
# Ember's CPU backend vs PyTorch nn.EmbeddingBag on identical data (a
# benchmark). The peer is PyPI's torch (FBGEMM-backed) in the SDK's .venv,
# which scripts/setup.sh creates; builds kernel_bench with -c opt, then runs
# bench/torch_compare.py; extra flags pass through, e.g.
#   bench/torch_compare.sh --dims=32,64,128,256 --threads=1,2 --format=json
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh >&2
PY=.venv/bin/python
echo "torch_compare: building kernel_bench (-c opt) ..." >&2
bazel build -c opt //bench:kernel_bench >&2
exec "$PY" bench/torch_compare.py --kernel_bench=bazel-bin/bench/kernel_bench "$@"
