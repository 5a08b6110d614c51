#!/usr/bin/env bash
# Builds Ember's wheel into DIR (default dist/): the `ember` package with its
# extension and emberctl, and the shared libraries they load, installable
# with `pip install DIR/ember-*.whl` into a venv of this Python on x86-64
# Linux (python/packaging/make_wheel.py says what it holds).
#
# EMBER_WHEEL_COMPILATION_MODE=fastbuild packs the binaries `bazel test`
# built (scripts/test.sh's wheel check, without a second, optimised build);
# the default is -c opt.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-dist}"
mode="${EMBER_WHEEL_COMPILATION_MODE:-opt}"
bash scripts/setup.sh >&2
bazel build -c "$mode" //python/ember:_ember.so //cli:emberctl 2>&1 | tail -n 1 >&2
bin="$(bazel info -c "$mode" bazel-bin 2>/dev/null)"
rm -f "$out"/ember-*.whl
python3 python/packaging/make_wheel.py --extension="$bin/python/ember/_ember.so" \
  --emberctl="$bin/cli/emberctl" --out="$out"
