#!/usr/bin/env bash
# Sets up what is missing, builds everything and runs every test with Bazel,
# builds and installs the wheel in a fresh venv (scripts/wheel_test.sh),
# checks the generated references and the docs' links (scripts/reference.py),
# checks the layers (scripts/check_layers.py) and fuzzes each target briefly,
# then prints a closing line "N passed, N failed" (test cases, counted from
# each test target's JUnit XML, plus one per layer rule and fuzz target).
# Exits non-zero if anything failed.
#
# Extra arguments go to `bazel test` (e.g. scripts/test.sh //planner/...).
set -uo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh || { echo "0 passed, 1 failed"; exit 1; }

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(//...)

log=$(mktemp)
trap 'rm -f "$log"' EXIT
bazel test --test_output=errors "${targets[@]}" 2>&1 | tee "$log"
bazel_rc=${PIPESTATUS[0]}

passed=0
failed=0
skipped_total=0
testlogs=$(bazel info bazel-testlogs 2>/dev/null)
# Lines of Bazel's summary: "//pkg:target   PASSED in 0.1s", "FAILED", ...
while read -r target status; do
  xml="$testlogs/${target#//}"
  xml="${xml/://}/test.xml"
  if [ -f "$xml" ] && [ "$status" = PASSED -o "$status" = FAILED ]; then
    cases=$(grep -o '<testcase ' "$xml" | wc -l)
    fails=$(grep -o '<failure' "$xml" | wc -l)
    errs=$(grep -o '<error' "$xml" | wc -l)
    skipped=$(grep -Eo '<skipped|status="notrun"' "$xml" | wc -l)
    bad=$((fails + errs))
    if [ "$status" = FAILED ] && [ "$bad" -eq 0 ]; then bad=1; fi
    ok=$((cases - bad - skipped))
    [ "$ok" -ge 0 ] || ok=0
    passed=$((passed + ok))
    skipped_total=$((skipped_total + skipped))
    failed=$((failed + bad))
  elif [ "$status" = PASSED ]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
  fi
done < <(grep -E '^//[^ ]+ +(\(cached\) +)?(PASSED|FAILED|TIMEOUT|FLAKY|NO STATUS|FAILED TO BUILD|INCOMPLETE)' "$log" |
         sed -E 's/\(cached\) +//' | awk '{print $1, $2}')

if [ "$bazel_rc" -ne 0 ] && [ "$failed" -eq 0 ]; then
  # The build itself failed before any test ran.
  failed=1
fi

# Adds LOG's "PREFIX ...: ok" lines to the passed tests and its
# "PREFIX ...: FAILED" lines to the failed ones; one failure when it has
# neither (the check did not run).
count_checks() {
  local log=$1 prefix=$2 ok bad
  ok=$(grep -cE "^$prefix .*: ok\$" "$log")
  bad=$(grep -cE "^$prefix .*: FAILED\$" "$log")
  [ "$ok" -gt 0 ] || bad=$((bad + 1))
  passed=$((passed + ok))
  failed=$((failed + bad))
}

# The wheel as a user installs it (scripts/wheel.sh, then
# scripts/wheel_test.sh in a fresh venv): each of its checks is one test.
# Packed from the binaries `bazel test` built above. Skipped when specific
# Bazel targets were asked for.
if [ $# -eq 0 ]; then
  wheel_dir=$(mktemp -d)
  wheel_log=$(mktemp)
  if EMBER_WHEEL_COMPILATION_MODE=fastbuild bash scripts/wheel.sh "$wheel_dir" >"$wheel_log" 2>&1; then
    tail -n 1 "$wheel_log"
    bash scripts/wheel_test.sh "$wheel_dir"/ember-*.whl 2>&1 | tee -a "$wheel_log"
  else
    cat "$wheel_log"
    echo "wheel build: FAILED" | tee -a "$wheel_log"
  fi
  count_checks "$wheel_log" wheel
  rm -rf "$wheel_dir" "$wheel_log"
fi

# The generated references (docs/reference/) against their sources, and the
# docs' links (scripts/reference.py --check): each check is one test.
if [ $# -eq 0 ]; then
  docs_log=$(mktemp)
  py=python3
  [ -x .venv/bin/python ] && py=.venv/bin/python
  "$py" scripts/reference.py --check 2>&1 | tee "$docs_log"
  count_checks "$docs_log" docs
  rm -f "$docs_log"
fi

# The layers of docs/design.md (scripts/check_layers.py): each rule is one
# test, passed when no include or dependency path breaks it. Skipped when
# specific Bazel targets were asked for.
if [ $# -eq 0 ]; then
  layers_log=$(mktemp)
  python3 scripts/check_layers.py 2>&1 | tee "$layers_log"
  count_checks "$layers_log" layers
  rm -f "$layers_log"
fi

# A short fuzzing run of every libFuzzer target (scripts/fuzz.sh): each
# target is one test, passed when it ran and found no crash. Skipped when
# specific Bazel targets were asked for; EMBER_FUZZ_SECONDS sets the time.
if [ $# -eq 0 ]; then
  fuzz_log=$(mktemp)
  bash scripts/fuzz.sh --seconds="${EMBER_FUZZ_SECONDS:-15}" 2>&1 | tee "$fuzz_log"
  ok=$(grep -cE '^fuzz [a-z_]+: [1-9][0-9]* executions in [0-9]+ s, 0 crash' "$fuzz_log")
  bad=$(grep -cE '^fuzz [a-z_]+: ' "$fuzz_log")
  bad=$((bad - ok))
  [ "$ok" -gt 0 ] || bad=$((bad + 1))  # no target ran at all
  passed=$((passed + ok))
  failed=$((failed + bad))
  rm -f "$fuzz_log"
fi
echo "$passed passed, $failed failed, $skipped_total skipped"
[ "$failed" -eq 0 ] && [ "$bazel_rc" -eq 0 ]
