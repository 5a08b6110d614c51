#!/usr/bin/env bash
# Runs the Python SDK's tests (pytest, Debian's python3 and torch) from Bazel's
# runfiles: the ember package with its extension, and emberctl. The JUnit
# XML goes where Bazel wants it, so scripts/test.sh counts each test case.
set -euo pipefail
emberctl=$(readlink -f "$1")
tests=$PWD/$(dirname "$2")  # every test_*.py beside it (runfiles)
package=$(dirname "$3")  # in the runfiles: the sources and the built extension side by side
pythonpath=$(mktemp -d)
trap 'rm -rf "$pythonpath"' EXIT
mkdir -p "$pythonpath/ember"
for f in "$package"/*.py "$package"/_ember.so; do ln -s "$(readlink -f "$f")" "$pythonpath/ember/"; done
cd "$pythonpath"
EMBER_EMBERCTL="$emberctl" PYTHONPATH="$pythonpath" exec /usr/bin/python3 -m pytest "$tests" -q \
  -p no:cacheprovider --junitxml="${XML_OUTPUT_FILE:-/dev/null}"
