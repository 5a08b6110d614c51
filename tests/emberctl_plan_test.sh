#!/usr/bin/env bash
# End-to-end tests of `emberctl plan` (the seed tutorial's plans as JSON and
# as TorchRec's table) and clear errors with a non-zero exit for bad input to
# every command.
set -uo pipefail

EMBERCTL="$1"
SEED="$2"
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
failures=0
checks=0

fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# expect_error NAME EXIT_CODE NEEDLE -- ARGS...: runs emberctl, checks the
# exit code and that stderr contains NEEDLE.
expect_error() {
  local name="$1" want_rc="$2" needle="$3"
  shift 4
  checks=$((checks + 1))
  "$EMBERCTL" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  if [ "$rc" -ne "$want_rc" ]; then
    fail "$name: exit $rc, want $want_rc; stderr: $(cat "$TMP/err")"
  elif ! grep -qF -- "$needle" "$TMP/err"; then
    fail "$name: stderr lacks '$needle': $(cat "$TMP/err")"
  fi
}

spec() {  # spec NAME JSON: writes $TMP/NAME.json
  printf '%s\n' "$2" >"$TMP/$1.json"
}

# --- The seed tutorial, as JSON, checked against TorchRec's printed plans.
for type in table_wise row_wise column_wise data_parallel; do
  checks=$((checks + 1))
  if ! "$EMBERCTL" plan --spec="$SEED" --world_size=2 --sharding_type="$type" \
      --compute_device=cuda --format=json >"$TMP/$type.json" 2>"$TMP/err"; then
    fail "seed $type: $(cat "$TMP/err")"
    continue
  fi
  python3 - "$TMP/$type.json" "$type" <<'PY' || fail "seed $type JSON differs from the tutorial"
import json, sys
doc = json.load(open(sys.argv[1]))
kind = sys.argv[2]
# TorchRec tutorial output (shared/seeds/000), 2 GPUs.
rows = {"large_table_0": 4096, "large_table_1": 4096, "small_table_0": 1024, "small_table_1": 1024}
expected = {}
for name, n in rows.items():
    if kind == "table_wise":
        r = 0 if name.endswith("_0") else 1
        expected[name] = ([r], [{"offsets": [0, 0], "sizes": [n, 64], "rank": r}])
    elif kind == "row_wise":
        expected[name] = ([0, 1], [{"offsets": [0, 0], "sizes": [n // 2, 64], "rank": 0},
                                    {"offsets": [n // 2, 0], "sizes": [n // 2, 64], "rank": 1}])
    elif kind == "column_wise":
        expected[name] = ([0, 1], [{"offsets": [0, 0], "sizes": [n, 32], "rank": 0},
                                    {"offsets": [0, 32], "sizes": [n, 32], "rank": 1}])
    else:
        expected[name] = ([0, 1], [])
got = {t["table"]: (t["ranks"], t["shards"]) for t in doc["plan"]}
assert list(got) == list(rows), got.keys()
for name in rows:
    assert got[name] == expected[name], (name, got[name], expected[name])
    t = [x for x in doc["plan"] if x["table"] == name][0]
    assert t["sharding_type"] == kind
    assert t["compute_kernel"] == ("dense" if kind == "data_parallel" else "fused")
stats = doc["stats"]
assert [r["rank"] for r in stats["per_rank"]] == [0, 1]
for r in stats["per_rank"]:
    assert r["hbm_bytes"] > 0 and r["cost_ms"] > 0 and r["ddr_bytes"] == 0
assert abs(stats["balance"] - 1.0) < 1e-6, stats["balance"]
PY
done

# --- TorchRec's printed form.
checks=$((checks + 1))
"$EMBERCTL" plan --spec="$SEED" --world_size=2 --sharding_type=row_wise --compute_device=cuda \
  >"$TMP/table.txt" 2>&1 ||
  fail "table format run failed"
for needle in "param         | sharding type | compute kernel | ranks" \
              "large_table_0 | row_wise      | fused          | [0, 1]" \
              "param         | shard offsets | shard sizes | placement" \
              "large_table_0 | [2048, 0]     | [2048, 64]  | rank:1/cuda:1" \
              "balance (max/mean) 1.000"; do
  grep -qF -- "$needle" "$TMP/table.txt" || fail "table output lacks '$needle'"
done

# --- Planner's own choice on CPU workers: every table, host memory only.
checks=$((checks + 1))
"$EMBERCTL" plan --spec="$SEED" --world_size=3 --compute_device=cpu --format=json >"$TMP/cpu.json" 2>"$TMP/err" ||
  fail "cpu plan: $(cat "$TMP/err")"
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
assert len(d["plan"]) == 4
assert all(r["hbm_bytes"] == 0 and r["ddr_bytes"] > 0 for r in d["stats"]["per_rank"] if r["cost_ms"] > 0)
' "$TMP/cpu.json" || fail "cpu plan JSON"

# --- No --compute_device: this machine's kind, said on stderr, and the plan
# is for it (host memory only for cpu, HBM for cuda).
checks=$((checks + 1))
"$EMBERCTL" plan --spec="$SEED" --world_size=2 --format=json >"$TMP/auto.json" 2>"$TMP/auto.err" ||
  fail "plan without --compute_device: $(cat "$TMP/auto.err")"
if grep -q "planning for cpu workers (this machine has no CUDA device" "$TMP/auto.err"; then
  kind=cpu
elif grep -q "planning for cuda workers (this machine has a CUDA device" "$TMP/auto.err"; then
  kind=cuda
else
  kind=none
  fail "plan without --compute_device did not say which kind: $(cat "$TMP/auto.err")"
fi
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
ranks = [r for r in d["stats"]["per_rank"] if r["cost_ms"] > 0]
if sys.argv[2] == "cpu":
    assert all(r["hbm_bytes"] == 0 and r["ddr_bytes"] > 0 for r in ranks), ranks
elif sys.argv[2] == "cuda":
    assert all(r["hbm_bytes"] > 0 for r in ranks), ranks
' "$TMP/auto.json" "$kind" || fail "plan without --compute_device: not a $kind plan"

# --- Bad input: clear errors, non-zero exit.
T='{"name": "NAME", "num_embeddings": ROWS, "embedding_dim": DIM, "feature_names": ["FEAT"]}'
table() { local s="${T/NAME/$1}"; s="${s/ROWS/$2}"; s="${s/DIM/$3}"; echo "${s/FEAT/$4}"; }

expect_error "missing spec file" 1 "cannot open spec file" -- plan --spec="$TMP/nope.json"
spec malformed '{"tables": [ {"name": "a", '
expect_error "malformed JSON" 1 "malformed collection spec" -- plan --spec="$TMP/malformed.json"
spec unknown_field "{\"tables\": [$(table a 10 8 fa)], \"colour\": 1}"
expect_error "unknown field" 1 "malformed collection spec" -- plan --spec="$TMP/unknown_field.json"
spec zero_rows "{\"tables\": [$(table a 0 8 fa)]}"
expect_error "zero rows" 1 "table 'a': num_embeddings must be > 0, got 0" -- plan --spec="$TMP/zero_rows.json"
spec bad_dim "{\"tables\": [$(table a 10 10 fa)]}"
expect_error "dim on CUDA" 1 "table 'a': embedding_dim 10 is not a multiple of 4, which CUDA workers need" -- plan --spec="$TMP/bad_dim.json" --compute_device=cuda
"$EMBERCTL" plan --spec="$TMP/bad_dim.json" --compute_device=cpu >/dev/null 2>"$TMP/err" ||
  fail "dim 10 on CPU workers (TorchRec's CPU modules take it): $(cat "$TMP/err")"
spec zero_dim "{\"tables\": [$(table a 10 0 fa)]}"
expect_error "zero dim" 1 "table 'a': embedding_dim must be > 0, got 0" -- plan --spec="$TMP/zero_dim.json"
spec dup_table "{\"tables\": [$(table a 10 8 fa), $(table a 10 8 fb)]}"
expect_error "duplicate table" 1 "table 'a': duplicate table name" -- plan --spec="$TMP/dup_table.json"
spec dup_feature "{\"tables\": [$(table a 10 8 f), $(table b 10 8 f)]}"
expect_error "duplicate feature" 1 "duplicate feature name 'f' (also in table 'a')" -- plan --spec="$TMP/dup_feature.json"
spec bad_type "{\"tables\": [$(table a 10 8 fa)], \"constraints\": {\"a\": {\"sharding_types\": [\"zigzag\"]}}}"
expect_error "unknown sharding type in spec" 1 "unknown sharding type 'zigzag'" -- plan --spec="$TMP/bad_type.json"
spec bad_ref "{\"tables\": [$(table a 10 8 fa)], \"constraints\": {\"b\": {\"sharding_types\": [\"row_wise\"]}}}"
expect_error "constraint naming unknown table" 1 "constraints for 'b': no table named 'b'" -- plan --spec="$TMP/bad_ref.json"
expect_error "unknown sharding type flag" 2 "unknown sharding type 'diagonal'" -- plan --spec="$SEED" --sharding_type=diagonal
spec huge "{\"tables\": [$(table huge 1000000000 128 fh)], \"constraints\": {\"huge\": {\"sharding_types\": [\"table_wise\"]}}}"
expect_error "infeasible" 1 "table 'huge' (1000000000 x 128, FP32, SGD)" -- plan --spec="$TMP/huge.json" --world_size=2 --compute_device=cuda
expect_error "infeasible remedy" 1 "to fit: allow row_wise" -- plan --spec="$TMP/huge.json" --world_size=2 --compute_device=cuda
expect_error "world size" 1 "world_size must be >= 1" -- plan --spec="$SEED" --world_size=0
expect_error "bad format" 2 "--format must be table or json" -- plan --spec="$SEED" --format=xml
expect_error "bad device" 2 "--compute_device must be cuda or cpu" -- plan --spec="$SEED" --compute_device=tpu
# Cluster commands: bad flags are refused before anything starts.
expect_error "up workers" 2 "--workers must be >= 1" -- up --workers=0
expect_error "up device" 2 "--device must be cpu, cuda or cuda_emulated" -- up --device=tpu
expect_error "up message limit" 2 "--max_message_mb must be in [1, 1024]" -- up --max_message_mb=0
expect_error "coordinator message limit" 2 "--max_message_mb must be in [1, 1024]" -- coordinator --max_message_mb=4096
expect_error "coordinator lease" 2 "--lease_ms must be >= 100" -- coordinator --lease_ms=5
expect_error "worker heap" 2 "--keep_freed_heap_mib must be >= 0" -- worker --keep_freed_heap_mib=-1
expect_error "create without coordinator" 1 "needs --coordinator" -- create --spec="$SEED"
expect_error "lookup without input" 2 "lookup needs --collection" -- lookup --coordinator=127.0.0.1:1
expect_error "unreachable coordinator" 1 "UNAVAILABLE" -- status --coordinator=127.0.0.1:1 --timeout_s=2
expect_error "set-trainers without a count" 2 "set-trainers needs --collection=NAME, --trainers=N (>= 1) and --from_step=S (>= 0)" -- set-trainers --coordinator=127.0.0.1:1 --collection=c --from_step=3
expect_error "set-trainers with a negative step" 2 "set-trainers needs" -- set-trainers --coordinator=127.0.0.1:1 --collection=c --trainers=2 --from_step=-2
expect_error "unknown command" 2 "unknown command 'plant'" -- plant
expect_error "no command" 2 "missing command" --

echo "$checks checks, $failures failure(s)"
[ "$failures" -eq 0 ]
