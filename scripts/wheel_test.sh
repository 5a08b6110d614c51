#!/usr/bin/env bash
# The wheel as a user installs it: a fresh venv, `pip install` of the wheel
# alone (numpy comes from PyPI or pip's cache), run from a directory outside
# the checkout, with no Bazel output on any path. Checks, each printed as
# "wheel CHECK: ok" or "wheel CHECK: FAILED" (scripts/test.sh counts them):
#   installed   ember and its extension import from the venv's site-packages
#   cluster     ember.LocalCluster() starts the packaged emberctl; a lookup and
#               an SGD step match NumPy
#   emberctl    the console script runs (`emberctl plan`)
#   dlrm        examples/train_dlrm.py trains (torch from the checkout's
#               .venv, by path only: ember still comes from the wheel)
# Usage: scripts/wheel_test.sh WHEEL
set -uo pipefail
whl="$(readlink -f "${1:?usage: wheel_test.sh WHEEL}")"
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
report() { if [ "$2" -eq 0 ]; then echo "wheel $1: ok"; else echo "wheel $1: FAILED"; fi; }

python3 -m venv "$tmp/venv" && "$tmp/venv/bin/pip" install -q --disable-pip-version-check "$whl"
report install $?
py="$tmp/venv/bin/python"
cd "$tmp"

env -u PYTHONPATH -u EMBER_EMBERCTL "$py" - "$root" <<'PY'
import os, sys
import ember
root = sys.argv[1]
here = os.path.dirname(ember.__file__)
assert here.startswith(sys.prefix), here
assert os.path.dirname(ember._ember.__file__) == here, ember._ember.__file__
assert not any(p.startswith(root) for p in sys.path), sys.path
assert ember._find_emberctl() == os.path.join(here, "bin", "emberctl")
# Every library the extension and emberctl load comes from the wheel's
# ember.libs, but the system's own (glibc, the C++ runtime): this machine has
# the Debian libraries too, so resolving to them would hide a missing one.
import re, subprocess
sys.path.append(os.path.join(root, "python", "packaging"))  # after the check above
from make_wheel import SYSTEM as system  # what the wheel leaves to the system
libs = os.path.join(os.path.dirname(here), "ember.libs")
for binary in (ember._ember.__file__, os.path.join(here, "bin", "emberctl")):
    out = subprocess.run(["ldd", binary], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line)
        if m and not system.match(m.group(1)):
            assert os.path.dirname(os.path.realpath(m.group(2))) == os.path.realpath(libs), \
                (binary, line)
PY
report installed $?

env -u PYTHONPATH -u EMBER_EMBERCTL timeout 300 "$py" - <<'PY'
import numpy as np
import ember
with ember.LocalCluster(workers=2) as cluster:
    c = ember.Client(cluster.address, timeout_s=30)
    c.create_collection({"name": "w", "tables": [
        {"name": "t", "num_embeddings": 100, "embedding_dim": 8, "feature_names": ["f"],
         "optimizer": {"type": "SGD", "learning_rate": 0.5}}]}, sharding_type="row_wise")
    table = c.export_table("w", "t")
    kjt = ember.KeyedJaggedTensor(["f"], [2, 1], [3, 97, 50])
    got = c.lookup("w", kjt).values
    np.testing.assert_allclose(got, [table[3] + table[97], table[50]], rtol=1e-6)
    c.apply_gradients("w", kjt, np.ones((2, 8), np.float32))
    np.testing.assert_allclose(c.export_table("w", "t")[97], table[97] - 0.5, rtol=1e-6)
PY
report cluster $?

printf '{"name":"p","tables":[{"name":"t","num_embeddings":1000,"embedding_dim":16,"feature_names":["f"]}]}\n' >"$tmp/spec.json"
env -u PYTHONPATH "$tmp/venv/bin/emberctl" plan --spec="$tmp/spec.json" --world_size=2 \
  --compute_device=cpu --format=json >"$tmp/plan.json" 2>"$tmp/plan.err" &&
  grep -q '"sharding_type"' "$tmp/plan.json"
report emberctl $?

if [ -x "$root/.venv/bin/python" ] && "$root/.venv/bin/python" -c 'import torch' 2>/dev/null; then
  site="$("$root/.venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
  venv_site="$("$py" -c 'import site; print(site.getsitepackages()[0])')"
  echo "$site" >"$venv_site/zz_checkout_torch.pth"  # torch by path; no .pth of it is read
  env -u PYTHONPATH -u EMBER_EMBERCTL timeout 600 "$py" "$root/examples/train_dlrm.py" \
    --steps=30 >"$tmp/dlrm.log" 2>&1 &&
    "$py" -c 'import ember, sys; sys.exit(0 if ember.__file__.startswith(sys.prefix) else 1)'
  rc=$?
  [ $rc -eq 0 ] || tail -n 20 "$tmp/dlrm.log"
  report dlrm $rc
else
  echo "wheel dlrm: skipped (no torch in $root/.venv)"
fi
