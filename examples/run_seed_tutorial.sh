#!/usr/bin/env bash
# Runs the seed tutorial on a fresh local cluster:
#   run_seed_tutorial.sh EMBERCTL SEED_TUTORIAL SPEC [sharding types...]
# Starts `EMBERCTL up --workers=2`, waits for it (60 s at most), runs
# SEED_TUTORIAL once per sharding type (default: table_wise row_wise
# column_wise data_parallel), prints every type's result line at the end,
# stops the cluster, and exits non-zero if the cluster did not come up or a
# type failed. Used by scripts/demo.sh and //tests:seed_tutorial_test.
set -euo pipefail
emberctl="$1"
tutorial="$2"
spec="$3"
shift 3
types=("$@")
[[ ${#types[@]} -gt 0 ]] || types=(table_wise row_wise column_wise data_parallel)

work="$(mktemp -d)"
up_pid=""
cleanup() {
  if [[ -n "$up_pid" ]] && kill -0 "$up_pid" 2>/dev/null; then
    kill -TERM "$up_pid" 2>/dev/null || true
    wait "$up_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

echo "==> starting a local cluster: emberctl up --workers=2"
"$emberctl" up --workers=2 >"$work/up.out" 2>"$work/up.err" &
up_pid=$!
for _ in $(seq 1 600); do
  grep -q '^ready:' "$work/up.out" && break
  kill -0 "$up_pid" 2>/dev/null || break
  sleep 0.1
done
if ! grep -q '^ready:' "$work/up.out"; then
  echo "the cluster did not come up (within 60 s):" >&2
  cat "$work/up.out" "$work/up.err" >&2
  exit 1
fi
cat "$work/up.out"
coordinator="$(awk '$1 == "coordinator:" {print $2}' "$work/up.out")"
echo
"$emberctl" status --coordinator="$coordinator"

results=()
failed=0
for type in "${types[@]}"; do
  echo
  echo "================ sharding_type=$type on the 2-worker cluster ================"
  if ! "$tutorial" --coordinator="$coordinator" --spec="$spec" --sharding_type="$type" \
       | tee "$work/$type.out"; then
    failed=1
  fi
  results+=("$(tail -n 1 "$work/$type.out")")
done

echo
echo "================ results ================"
printf '%s\n' "${results[@]}"
exit "$failed"
