#!/usr/bin/env bash
# Ember's CPU backend vs PyTorch nn.EmbeddingBag on identical data (a
# benchmark). Installs Debian's python3-torch if missing, builds kernel_bench
# with -c opt, then runs bench/torch_compare.py; extra flags pass through, e.g.
#   bench/torch_compare.sh --dims=64,128 --threads=1,2 --format=json
set -euo pipefail
cd "$(dirname "$0")/.."

PY=/usr/bin/python3   # Debian's interpreter: python3-torch is installed for it
if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "torch_compare: installing python3-torch (Debian) ..." >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get install -y --no-install-recommends python3-torch >&2 ||
    { $SUDO apt-get update >&2 && $SUDO apt-get install -y --no-install-recommends python3-torch >&2; }
fi

scripts/setup.sh >&2
echo "torch_compare: building kernel_bench (-c opt) ..." >&2
bazel build -c opt //bench:kernel_bench >&2
exec "$PY" bench/torch_compare.py --kernel_bench=bazel-bin/bench/kernel_bench "$@"
