#!/usr/bin/env bash
# Builds Ember's libFuzzer targets (tests/fuzz/*.cc: every worker and
# coordinator request decoder and validator, the coordinator with tokens on
# against every credential, and the text formats) with
# clang-14, AddressSanitizer and UndefinedBehaviorSanitizer, and runs each
# for a set time. Prints one line per target:
#   fuzz NAME: N executions in S s, C crash(es)
# and exits non-zero if any target crashed (the input that did is saved
# under out/fuzz/NAME/, with the log). Corpora persist in out/fuzz/corpus/.
#
#   scripts/fuzz.sh [--seconds=N] [TARGET...]     (default 60 s each, all targets)
set -uo pipefail
cd "$(dirname "$0")/.."

seconds=60
targets=()
for a in "$@"; do
  case "$a" in
    --seconds=*) seconds=${a#--seconds=} ;;
    *) targets+=("$a") ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(worker_fuzz coordinator_fuzz coordinator_auth_fuzz formats_fuzz)

CXX=clang++-14
command -v $CXX >/dev/null || { echo "fuzz: $CXX is missing (scripts/setup.sh installs it)" >&2; exit 1; }
bazel build //proto:all >/dev/null 2>&1 || { echo "fuzz: bazel build //proto:all failed" >&2; exit 1; }

out=out/fuzz
obj=$out/obj
mkdir -p "$obj"
gen=$(bazel info bazel-bin 2>/dev/null)
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
cxxflags="-std=c++17 -O1 -g -fno-omit-frame-pointer $san -I. -I$gen -w"
libs="$(pkg-config --libs grpc++ protobuf) -lglog -lgflags -lleveldb -lz -lcrypto -lpthread"

# Sources each target links (object files are shared and rebuilt when older
# than their source or a header it includes).
common="$gen/proto/collection.pb.cc $gen/proto/plan.pb.cc $gen/proto/service.pb.cc
  $gen/proto/service.grpc.pb.cc server/backend/embedding_backend.cc server/common/auth.cc
  server/checkpoint/checkpoint_files.cc"
worker="$common server/worker/worker_service.cc server/worker/request_codec.cc server/worker/worker_shards.cc server/worker/worker_rows.cc server/worker/replication.cc server/worker/applied_ids.cc server/worker/step_barrier.cc server/worker/shm_channels.cc
  server/backend/cpu/cpu_backend.cc server/backend/cpu/cpu_kernels.cc
  server/backend/cpu/cpu_kernels_avx2.cc server/backend/cpu/cpu_kernels_avx512.cc
  server/backend/cpu/stochastic_round.cc server/backend/cpu/quantized_rows.cc
  server/backend/overflow_guard.cc
  server/backend/table_spec.cc server/checkpoint/recut.cc server/common/host_memory.cc
  server/backend/dynamic/dynamic_index.cc server/backend/dynamic/dynamic_backend.cc
  server/checkpoint/rehash.cc"
planner="planner/backups.cc planner/cost_model.cc planner/planner.cc planner/plan_options.cc planner/plan_bounds.cc
  planner/plan_search.cc planner/plan_stats.cc planner/plan_view.cc planner/shard_geometry.cc
  planner/sharding_types.cc planner/spec_validation.cc planner/plan_format.cc"
coordinator="$common $planner server/coordinator/coordinator_service.cc
  server/coordinator/coordinator_workers.cc server/coordinator/coordinator_collections.cc
  server/coordinator/coordinator_checkpoints.cc server/coordinator/coordinator_recovery.cc
  server/coordinator/state_store.cc server/coordinator/assignments.cc
  server/coordinator/replacement_policy.cc server/coordinator/live_move.cc
  server/coordinator/move_plan.cc server/coordinator/coordinator_scale.cc
  server/coordinator/coordinator_replicas.cc server/backend/table_spec.cc"
formats="$common $planner cli/json_io.cc cli/spec_io.cc client/kjt.cc client/shared_buffer.cc"

# Whether object $1 must be rebuilt from source $2: missing, or older than
# the source or any header it included (its depfile, $1.d).
stale() {
  local o=$1 src=$2 f
  if [ ! -f "$o" ] || [ ! -f "$o.d" ] || [ "$src" -nt "$o" ]; then return 0; fi
  for f in $(sed -e 's/^[^:]*://' -e 's/\\$//' "$o.d"); do
    if [ "$f" -nt "$o" ]; then return 0; fi
  done
  return 1
}

compile() {  # source -> object path
  local src=$1 o
  o=$obj/$(echo "$src" | sed 's|^/||; s|/|_|g').o
  if stale "$o" "$src"; then
    local extra=""
    case "$src" in
      *cpu_kernels_avx2.cc) extra="-mavx2 -mfma -mf16c" ;;
      *cpu_kernels_avx512.cc) extra="-mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx2 -mfma -mf16c" ;;
      *cpu_backend.cc) extra="-fno-math-errno -ffp-contract=off" ;;
    esac
    $CXX $cxxflags -fsanitize=fuzzer-no-link $extra -MMD -MF "$o.d" -c "$src" -o "$o" || return 1
  fi
  echo "$o"
}

failed=0
for t in "${targets[@]}"; do
  case "$t" in
    worker_fuzz) srcs=$worker ;;
    coordinator_fuzz | coordinator_auth_fuzz) srcs=$coordinator ;;
    formats_fuzz) srcs=$formats ;;
    *) echo "fuzz: unknown target $t" >&2; exit 2 ;;
  esac
  objs=()
  for s in $srcs; do
    o=$(compile "$s") || { echo "fuzz $t: build failed ($s)"; failed=1; continue 2; }
    objs+=("$o")
  done
  mkdir -p "$out/bin"
  bin=$out/bin/$t
  $CXX $cxxflags -fsanitize=fuzzer "tests/fuzz/$t.cc" "${objs[@]}" $libs -o "$bin" ||
    { echo "fuzz $t: link failed"; failed=1; continue; }
  mkdir -p "$out/corpus/$t" "$out/$t"
  log=$out/$t/log.txt
  start=$(date +%s)
  GLOG_minloglevel=2 ASAN_OPTIONS=detect_leaks=0 "$bin" "$out/corpus/$t" -max_total_time="$seconds" -timeout=20 \
    -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$out/$t/" > "$log" 2>&1
  rc=$?
  execs=$(grep -ao 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  crashes=$(ls "$out/$t" | grep -cE '^(crash|leak|timeout|oom)-' || true)
  [ "$rc" -eq 0 ] || [ "$crashes" -gt 0 ] || crashes=1
  echo "fuzz $t: ${execs:-0} executions in $(( $(date +%s) - start )) s, $crashes crash(es)"
  if [ "$crashes" -gt 0 ]; then
    failed=1
    grep -a -m 20 -E 'ERROR|SUMMARY|runtime error' "$log" | sed 's/^/  /'
  fi
done
exit $failed
