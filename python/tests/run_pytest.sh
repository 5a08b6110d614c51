#!/usr/bin/env bash
# Runs the Python SDK's tests (pytest) from Bazel's runfiles: the ember
# package with its extension, and emberctl. The interpreter is the checkout's
# .venv (PyPI torch + torchrec, prepared by scripts/setup.sh) when it exists,
# else Debian's python3 (the TorchRec parity tests then skip). The JUnit XML
# goes where Bazel wants it, so scripts/test.sh counts each test case.
set -euo pipefail
emberctl=$(readlink -f "$1")
tests=$PWD/$(dirname "$2")  # every test_*.py beside it (runfiles)
package=$(dirname "$3")  # in the runfiles: the sources and the built extension side by side
pythonpath=$(mktemp -d)
trap 'rm -rf "$pythonpath"' EXIT
mkdir -p "$pythonpath/ember"
for f in "$package"/*.py "$package"/_ember.so; do ln -s "$(readlink -f "$f")" "$pythonpath/ember/"; done
# The checkout: the runfiles' test sources are symlinks into it.
checkout=$(dirname "$(dirname "$(dirname "$(readlink -f "$2")")")")
python=/usr/bin/python3
[ -x "$checkout/.venv/bin/python" ] && python="$checkout/.venv/bin/python"
cd "$pythonpath"
EMBER_EMBERCTL="$emberctl" PYTHONPATH="$pythonpath" exec "$python" -m pytest "$tests" -q \
  -p no:cacheprovider --junitxml="${XML_OUTPUT_FILE:-/dev/null}"
