#!/usr/bin/env bash
# Runs deploy/check_manifests.py (kustomize render, schema validation,
# flag/port/probe/memory consistency) with the checkout's .venv, which
# scripts/setup.sh prepares with kubernetes-validate. kubectl (with
# kustomize) comes with the machine image, not from Debian: where it is
# missing the test says so and passes without checking.
set -euo pipefail
emberctl=$(readlink -f "$1")
script=$(readlink -f "$2")  # the source tree's copy: overlays are read beside it
checkout=$(dirname "$(dirname "$script")")
if ! command -v kubectl >/dev/null; then
  echo "SKIPPED: kubectl is not installed; deploy/ was not checked"
  exit 0
fi
exec "$checkout/.venv/bin/python" "$script" "$emberctl"
