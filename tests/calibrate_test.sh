#!/usr/bin/env bash
# emberctl calibrate end to end: on a local 2-worker cluster it writes a
# cost model that loads, whose constants are positive and finite, and leaves
# no scratch collection behind; emberctl plan and a coordinator take it with
# --cost_model and refuse one made for another device; a malformed model
# file keeps the coordinator from starting.
#   calibrate_test.sh EMBERCTL SPEC
set -euo pipefail
emberctl="$1"
spec="$2"
work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/calibrate.XXXXXX")"
pids=()
cleanup() {
  for p in "${pids[@]}"; do
    kill -TERM "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# Starts `emberctl up` with the given flags; prints its coordinator address.
up() {
  local out="$work/up$#.$RANDOM"
  "$emberctl" up --workers=2 "$@" >"$out.out" 2>"$out.err" &
  pids+=($!)
  for _ in $(seq 1 600); do
    grep -q '^ready:' "$out.out" && break
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  grep -q '^ready:' "$out.out" || { cat "$out.err" >&2; return 1; }
  awk '$1 == "coordinator:" {print $2}' "$out.out"
}

coordinator=$(up) || fail "the cluster did not come up"
"$emberctl" calibrate --coordinator="$coordinator" --output="$work/model.json" \
  --calibrate_rows=140000 --calibrate_reps=3 | tee "$work/calibrate.out"
grep -q '^fit: .* ns per id' "$work/calibrate.out" || fail "no fit printed"
# Both widths timed: 8 shapes of each.
[ "$(grep -cE '^ 16 \|' "$work/calibrate.out")" = 8 ] && [ "$(grep -cE '^128 \|' "$work/calibrate.out")" = 8 ] ||
  fail "calibrate did not time both row widths"
python3 - "$work/model.json" <<'EOF' || fail "the model file is not what calibrate should write"
import json, math, sys
m = json.load(open(sys.argv[1]))
assert m["device"] == "cpu", m
for k in ("ddr_bw_gbps", "network_bw_gbps", "bwd_compute_multiplier"):
    assert math.isfinite(m[k]) and m[k] > 0, (k, m[k])
assert m["per_shard_overhead_ms"] >= 0 and m["lookup_efficiency"] == 1, m
assert math.isfinite(m["per_id_ms"]) and m["per_id_ms"] >= 0, m
# The caches: both or neither.
assert m["cache_bytes"] >= 0 and m["cache_bw_gbps"] >= 0, m
assert (m["cache_bytes"] > 0) == (m["cache_bw_gbps"] > 0), m
EOF
grep -q '^caches: ' "$work/calibrate.out" || fail "no caches line printed"
grep -q "SSD tier not measured: not every worker serves key_value" "$work/calibrate.out" ||
  fail "no word on the SSD tier without one"
python3 - "$work/model.json" <<'EOF' || fail "ssd_bw_gbps moved without an SSD tier"
import json, sys
assert json.load(open(sys.argv[1]))["ssd_bw_gbps"] == 2
EOF

# Workers with an SSD tier: the key_value files' read rate is measured and
# written as ssd_bw_gbps (a drive, not the cache: under 5 GB/s, 10M reads/s of 512-byte rows).
mkdir -p "$work/ssd"
with_ssd=$(up --ssd_dir="$work/ssd" --ssd_gib=1) || fail "up --ssd_dir did not come up"
# Traffic on a key_value table first: its shard learns a hit-rate curve,
# which calibrate collects and writes. Five lookups of the same 400 rows:
# the first misses at every cache size, the next four hit wherever 400 rows
# fit (0.05 of 10,000 rows and up), not at 0.01 or 0.02 (100, 200 rows).
cat >"$work/kv.json" <<'EOF'
{"name": "kv", "tables": [{"name": "t_kv", "num_embeddings": 10000, "embedding_dim": 8,
  "feature_names": ["f_kv"]}],
 "constraints": {"t_kv": {"compute_kernels": ["key_value"], "sharding_types": ["table_wise"]}}}
EOF
"$emberctl" create --coordinator="$with_ssd" --spec="$work/kv.json" >/dev/null ||
  fail "the key_value collection was not created"
python3 -c 'import json; print(json.dumps({"keys": ["f_kv"], "lengths": [1] * 400, "values": list(range(0, 8000, 20))}))' >"$work/kjt.json"
for _ in 1 2 3 4 5; do
  "$emberctl" lookup --coordinator="$with_ssd" --collection=kv --input="$work/kjt.json" \
    --output="$work/out.json" || fail "lookup on the key_value table failed"
done
"$emberctl" status --coordinator="$with_ssd" --rate_window=0s >"$work/kv_status.out"
grep -qF "t_kv: an LRU cache would hit 0.800 of its rows' accesses at 5% of its rows, 0.800 at 20%, 0.800 at 50% (learned from 2000 sampled accesses)" \
  "$work/kv_status.out" || { cat "$work/kv_status.out" >&2; fail "status shows no learned curve for t_kv"; }
"$emberctl" calibrate --coordinator="$with_ssd" --output="$work/ssd_model.json" \
  --calibrate_rows=140000 --calibrate_reps=3 | tee "$work/ssd.out"
grep -qF "hit-rate curve of table 't_kv': 0.800 at a 5% cache, 0.800 at 20%, 0.800 at 50% (2000 sampled accesses)" \
  "$work/ssd.out" || fail "no hit-rate curve printed for t_kv"
python3 - "$work/ssd_model.json" <<'EOF' || fail "the hit-rate curve was not written"
import json, sys
curves = json.load(open(sys.argv[1]))["hit_rate_curves"]
assert list(curves) == ["t_kv"], curves  # calibrate's own tables left out
assert curves["t_kv"] == [0, 0, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8], curves
EOF
grep -qE 'SSD tier: [0-9]+ random row reads/s of 512-byte rows' "$work/ssd.out" ||
  fail "the SSD tier was not probed"
grep -qE '^ssd: rows read from the key_value files at [0-9.]+ GB/s' "$work/ssd.out" ||
  fail "no ssd line printed"
python3 - "$work/ssd_model.json" <<'EOF' || fail "ssd_bw_gbps not written"
import json, sys
m = json.load(open(sys.argv[1]))
assert 1e-4 < m["ssd_bw_gbps"] < 5 and m["ssd_bw_gbps"] != 2, m["ssd_bw_gbps"]  # 5: 10M reads/s
EOF
grep -q 'training steps on every worker at once, rows from 1 MiB, 16 MiB' "$work/calibrate.out" || fail "the caches were not probed"
# The scratch collection is gone.
"$emberctl" status --coordinator="$coordinator" >"$work/status.out"
if grep -q "_calibrate_" "$work/status.out" || grep -qE "[1-9][0-9]* shard\(s\)" "$work/status.out"; then
  cat "$work/status.out" >&2
  fail "calibrate left its scratch collection"
fi

# emberctl plan takes the model for CPU workers and refuses it for CUDA.
"$emberctl" plan --spec="$spec" --world_size=2 --compute_device=cpu \
  --cost_model="$work/model.json" >"$work/plan.out" || fail "plan --cost_model failed"
grep -q "planned 4 table(s) on 2 worker(s)" "$work/plan.out" || fail "no plan"
if "$emberctl" plan --spec="$spec" --world_size=2 --compute_device=cuda \
     --cost_model="$work/model.json" 2>"$work/plan.err"; then
  fail "a CPU model planned CUDA workers"
fi
grep -q "is for cpu workers" "$work/plan.err" || fail "unclear refusal: $(cat "$work/plan.err")"

# A coordinator with the model plans with it; one with a CUDA model
# refuses to plan for these CPU workers.
with_model=$(up --cost_model="$work/model.json") || fail "up --cost_model did not come up"
"$emberctl" create --coordinator="$with_model" --spec="$spec" >/dev/null ||
  fail "create with a calibrated coordinator failed"
# status shows each table as it runs: no optimizer given, so SGD at the
# default learning rate the coordinator filled in.
"$emberctl" status --coordinator="$with_model" --rate_window=0s >"$work/status2.out"
grep -qE '^    table large_table_0 \[4096 x 64\] FP32 SUM, SGD lr 0\.01$' "$work/status2.out" ||
  fail "status does not show the tables' optimizer values: $(cat "$work/status2.out")"
[ "$(grep -c '^    table ' "$work/status2.out")" = 4 ] || fail "status does not list the 4 tables"
printf '{"device": "cuda", "network_bw_gbps": 10}\n' >"$work/cuda.json"
cuda_model=$(up --cost_model="$work/cuda.json") || fail "up with a CUDA model did not come up"
if "$emberctl" create --coordinator="$cuda_model" --spec="$spec" 2>"$work/create.err"; then
  fail "a CUDA model planned CPU workers"
fi
grep -q "FAILED_PRECONDITION.*is for CUDA workers" "$work/create.err" ||
  fail "unclear refusal: $(cat "$work/create.err")"

# A malformed model keeps the coordinator from starting.
printf '{"device": "cpu", "ddr_bw_gbsp": 5}\n' >"$work/typo.json"
if "$emberctl" coordinator --listen=127.0.0.1:0 --cost_model="$work/typo.json" \
     >"$work/coord.out" 2>"$work/coord.err"; then
  fail "the coordinator started with a malformed cost model"
fi
grep -q "unknown field 'ddr_bw_gbsp'" "$work/coord.err" ||
  fail "unclear refusal: $(cat "$work/coord.err")"
echo "PASSED"
