#!/usr/bin/env bash
# The Python environment of the SDK's tests, examples and benchmarks: a venv
# at .venv/ (git-ignored) on Debian's python3 with PyPI's torch 2.14.1,
# torchrec 1.9.2 and the CPU build of FBGEMM 1.9.0 (TorchRec's local
# reference for the parity tests and train_bench), numpy, pytest and
# kubernetes-validate (deploy/manifests_test).
# Idempotent: a stamp names what was installed; when it matches, this returns
# at once. Called by scripts/setup.sh.
#
# The quirk (../shared/TOOLCHAIN.md): `pip install torchrec` pulls the CUDA
# fbgemm_gpu, which shadows fbgemm_gpu-cpu and fails to load without
# libnvidia-ml, so it is replaced by fbgemm-gpu-cpu==1.9.0 afterwards
# (FBGEMM 1.9.0 does not load with torch 2.15: torch is pinned).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
want="torch==2.14.1 torchrec==1.9.2 fbgemm-gpu-cpu==1.9.0 numpy pytest kubernetes-validate==1.37.0"
stamp="$venv/.ember-python-stamp"
# `import ember` from any directory: a .pth naming this checkout's python/
# (the package loads its extension from bazel-bin when it is not beside it).
link_package() {
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$PWD/python" >"$site/ember-checkout.pth"
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  link_package
  exit 0
fi
echo "setup: preparing the Python environment in $venv (PyPI torch is ~5 GB; a few minutes)" >&2
start=$(date +%s)
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install "torch==2.14.1" numpy pytest "kubernetes-validate==1.37.0"
echo "setup: torch installed ($(( $(date +%s) - start )) s); torchrec next" >&2
"${pip[@]}" install "torchrec==1.9.2"
"${pip[@]}" uninstall -y fbgemm_gpu fbgemm_gpu-cpu >/dev/null 2>&1 || true
"${pip[@]}" install --no-deps "fbgemm-gpu-cpu==1.9.0"
"$venv/bin/python" - <<'PY'
import torch, torchrec, fbgemm_gpu  # noqa: F401  (fails loudly if the CUDA build came back)
print(f"setup: torch {torch.__version__}, torchrec {torchrec.__version__}", flush=True)
PY
link_package
echo "$want" >"$stamp"
echo "setup: Python environment ready ($(( $(date +%s) - start )) s)" >&2
