#!/usr/bin/env bash
# Smoke tests of the benchmark tools (they assert no figures): kernel_bench
# reports the prefetch its backend resolved, its ceiling reads every line of
# every row it should, it answers --serve requests and refuses unknown ones
# and impossible flags; bench/kernel_ab.py pairs two sides and names a side
# that cannot start; dynamic_bench measures a dynamic table beside a fixed
# one (on the CPU backend, and on the CUDA backend's adapter over the host
# runtime where the build has CUDA) and refuses bad flags; key_value_bench
# runs a table on the key_value kernel beside one in memory and refuses bad
# flags. Tiny tables, a few seconds.
set -uo pipefail

KB="$1"
AB="$2"
DB="${3:-}"
KVB="${4:-}"
DBH="${5:-}"  # dynamic_bench over the host CUDA runtime (builds with CUDA)
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
tiny=(--rows=1000 --dim=8 --batch=16 --pooling_factor=4 --iters=1)

# json_field FILE KEY: the value of "KEY": in kernel_bench's one-line JSON.
json_field() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }

# The prefetch kernel_bench reports is LookupPrefetchFor's / FixedPrefetch's
# (cpu_backend.h), worked by hand: a shard of at most 4 MiB is 24 ahead in
# either style, two_stage adding the first line half as far (at most 16);
# outer sends every line of rows of at most 512 bytes 16 ahead into L1 when
# the call's shards total at most 6 MiB, as l1 does any shard's.
check_prefetch() {  # check_prefetch NAME OUTER L1 INTO_L1 -- FLAGS...
  local name="$1" outer="$2" l1="$3" into_l1="$4"
  shift 5
  if ! "$KB" "${tiny[@]}" --format=json "$@" >"$TMP/kb.json" 2>"$TMP/kb.err"; then
    fail "$name: kernel_bench failed: $(cat "$TMP/kb.err")"
    return
  fi
  local got
  got=$(json_field "$TMP/kb.json" prefetch_outer)/$(json_field "$TMP/kb.json" prefetch_l1)
  got="$got/$(json_field "$TMP/kb.json" prefetch_outer_into_l1)"
  [ "$got" = "$outer/$l1/$into_l1" ] || fail "$name: prefetch $got, want $outer/$l1/$into_l1"
}
check_prefetch "outer, small shard" 16 0 True -- --prefetch_style=outer
check_prefetch "outer, 4 MiB of 1 KiB rows" 24 0 False -- --prefetch_style=outer --dim=256 --rows=4096
check_prefetch "two_stage, small shard" 24 12 False -- --prefetch_style=two_stage
check_prefetch "two_stage, fixed 40" 40 16 False -- --prefetch_style=two_stage --prefetch_distance=40
check_prefetch "outer, none" 0 0 False -- --prefetch_style=outer --prefetch_distance=0
check_prefetch "l1, fixed 8" 8 0 True -- --prefetch_style=l1 --prefetch_distance=8
# 4 MiB + one row of fp32 dim 8: past the small-shard rule.
check_prefetch "two_stage, 32-byte rows" 64 16 False -- --prefetch_style=two_stage --rows=131073
# 6 MiB + one row of fp32 dim 8.
check_prefetch "outer, past 6 MiB" 64 0 False -- --prefetch_style=outer --rows=196609
# Eight 1 MiB shards read in each call: 8 MiB in all, no longer into L1.
check_prefetch "outer, 8 x 1 MiB" 24 0 False -- --prefetch_style=outer --rows=32768 --tables=8

# --ceiling: the bare gather reads one word of every line of every id's row
# in every call (3 warm-ups and --iters timed, for each of the three
# prefetch distances of each round), in the order the calls cycle the sets; its checksum against that sum worked here, over the
# table's fill (word i holds i * 0x9E3779B97F4A7C15 mod 2^64, row_ceiling.cc).
ceiling=(--rows=1000 --dim=32 --batch=16 --pooling_factor=4 --iters=2 --id_sets=3
         --ceiling --ceiling_rounds=2 --format=json --dump_ids="$TMP/ids.bin")
if ! "$KB" "${ceiling[@]}" >"$TMP/ceiling.json" 2>"$TMP/ceiling.err"; then
  fail "--ceiling: kernel_bench failed: $(cat "$TMP/ceiling.err")"
else
  python3 - "$TMP/ceiling.json" "$TMP/ids.bin" <<'PY' || fail "--ceiling: $(cat "$TMP/ceiling.json")"
import json, struct, sys
d = json.load(open(sys.argv[1]))
raw = open(sys.argv[2], "rb").read()
ids = struct.unpack("<%dq" % (len(raw) // 8), raw)
per_set = 16 * 4
sets = [ids[k * per_set:(k + 1) * per_set] for k in range(3)]
row_bytes = 32 * 4
want = 0
for _ in range(2 * 3):                  # rounds x prefetch distances
    for first, count in ((0, 3), (3, 2)):   # warm-ups, then --iters
        for call in range(first, first + count):
            for r in sets[call % 3]:
                for line in range(0, row_bytes, 64):
                    want += ((r * row_bytes + line) // 8) * 0x9E3779B97F4A7C15
want %= 1 << 64
assert d["ceiling_checksum"] == want, (d["ceiling_checksum"], want)
assert d["ceiling_lookups_per_s"] > 0 and d["of_ceiling"] > 0, d
PY
fi
# --id_sets=0: a batch for every call, 3 warm-ups and --iters per caller.
if "$KB" "${tiny[@]}" --iters=2 --callers=2 --id_sets=0 --format=json >"$TMP/fresh.json" 2>"$TMP/fresh.err"; then
  [ "$(json_field "$TMP/fresh.json" id_sets)" = 10 ] ||
    fail "--id_sets=0: want 10 sets, got $(json_field "$TMP/fresh.json" id_sets)"
else
  fail "--id_sets=0: kernel_bench failed: $(cat "$TMP/fresh.err")"
fi
# What --ceiling and --id_sets=0 cannot do is refused, with the reason.
refused() {  # refused WHAT MESSAGE -- FLAGS...
  local what="$1" message="$2"
  shift 3
  if "$KB" "${tiny[@]}" "$@" >/dev/null 2>"$TMP/refused.err"; then
    fail "$what: accepted"
  elif ! grep -qF -- "$message" "$TMP/refused.err"; then
    fail "$what: refused without '$message': $(cat "$TMP/refused.err")"
  fi
}
refused "--ceiling over two tables" "--ceiling times one table" -- --ceiling --tables=2
refused "--ceiling with --serve" "--ceiling is for the CPU backend, without --serve" -- --ceiling --serve
refused "--ceiling_rounds=0" "--ceiling_rounds must be >= 1" -- --ceiling --ceiling_rounds=0
refused "--id_sets=0 with --serve" "--serve repeats its calls" -- --id_sets=0 --serve
refused "--id_sets=-1" "--id_sets >= 0" -- --id_sets=-1
refused "--uvm on the CPU backend" "--uvm (fused_uvm tables) is for --backend=cuda" -- --uvm

# --serve: one JSON line per "measure", then "quit".
printf 'measure\nmeasure\nquit\n' | "$KB" "${tiny[@]}" --serve >"$TMP/serve.out" 2>"$TMP/serve.err"
[ "$(grep -c '"lookups_per_s"' "$TMP/serve.out")" = 2 ] ||
  fail "--serve: want 2 timing lines, got: $(cat "$TMP/serve.out") $(cat "$TMP/serve.err")"
if printf 'meausre\n' | "$KB" "${tiny[@]}" --serve >/dev/null 2>"$TMP/serve.err"; then
  fail "--serve accepted an unknown request"
elif ! grep -q "unknown request 'meausre'" "$TMP/serve.err"; then
  fail "--serve's refusal does not name the request: $(cat "$TMP/serve.err")"
fi

# kernel_ab.py: two configurations of one binary, paired.
if ! python3 "$AB" --a="$KB --dtype=fp32" --b="$KB --dtype=fp16" --pairs=2 --pause=0 -- \
    "${tiny[@]}" >"$TMP/ab.out" 2>"$TMP/ab.err"; then
  fail "kernel_ab: $(cat "$TMP/ab.err")"
else
  for what in forward backward; do
    grep -qE "^$what +A [0-9.e+]+ +B [0-9.e+]+ ids/s +B/A [0-9.]+ \[[0-9.]+-[0-9.]+\] +\(2 pairs\)" \
      "$TMP/ab.out" || fail "kernel_ab: no $what line: $(cat "$TMP/ab.out")"
  done
  [ "$(grep -c '^  pair ' "$TMP/ab.err")" = 2 ] || fail "kernel_ab: want 2 progress lines: $(cat "$TMP/ab.err")"
fi
# A side that cannot start, and one that exits, are named with the reason.
if python3 "$AB" --a="$TMP/no_such_binary" --b="$KB" --pairs=1 -- "${tiny[@]}" >/dev/null 2>"$TMP/ab.err"; then
  fail "kernel_ab accepted a missing binary"
elif ! grep -q "kernel_ab: side A: cannot start $TMP/no_such_binary" "$TMP/ab.err"; then
  fail "kernel_ab: missing binary not named: $(cat "$TMP/ab.err")"
fi
if python3 "$AB" --a="$KB" --b="$KB --dtype=fp8" --pairs=1 -- "${tiny[@]}" >/dev/null 2>"$TMP/ab.err"; then
  fail "kernel_ab accepted a side that exits"
elif ! grep -q "kernel_ab: side B: .* failed (exit 1): kernel_bench: --dtype=fp8 is not one of fp32, fp16, bf16" \
    "$TMP/ab.err"; then
  fail "kernel_ab: exiting side not reported with its reason: $(cat "$TMP/ab.err")"
fi

# dynamic_bench: every figure present and positive on a tiny table; bad
# flags refused with its usage.
if [ -n "$DB" ]; then
  if ! "$DB" --rows=2000 --dim=8 --batch=16 --pooling_factor=4 --iters=1 --id_sets=2 \
      --format=json >"$TMP/db.json" 2>"$TMP/db.err"; then
    fail "dynamic_bench failed: $(cat "$TMP/db.err")"
  else
    for key in lookup_fixed lookup_dynamic update_fixed update_dynamic admit_dynamic find insert; do
      v=$(json_field "$TMP/db.json" "$key")
      python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) > 0 else 1)' "$v" ||
        fail "dynamic_bench: $key is $v"
    done
  fi
  if "$DB" --rows=0 >/dev/null 2>"$TMP/db.err" || ! grep -q "bad flags" "$TMP/db.err"; then
    fail "dynamic_bench accepted --rows=0: $(cat "$TMP/db.err")"
  fi
  if "$DB" --device_resident >/dev/null 2>"$TMP/db.err" || ! grep -q "bad flags" "$TMP/db.err"; then
    fail "dynamic_bench accepted --device_resident on the CPU backend: $(cat "$TMP/db.err")"
  fi
fi

# key_value_bench: both kernels measured on a tiny table (the key_value one
# once its cache is full), hit rates in [0, 1], the drive's rates; bad flags
# refused.
if [ -n "$KVB" ]; then
  # Fixed tables, then dynamic ones (--dynamic: hashed ids).
  for dyn in false true; do
    if ! "$KVB" --rows=20000 --dim=8 --batch=16 --pooling_factor=4 --steps=3 --warmup=1 \
        --cache_fractions=0.01 --ssd_dir="$TMP" --dynamic=$dyn --format=json \
        >"$TMP/kv.json" 2>"$TMP/kv.err"; then
      fail "key_value_bench --dynamic=$dyn failed: $(cat "$TMP/kv.err")"
    elif ! python3 - "$TMP/kv.json" "$dyn" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))
assert [r["kernel"] for r in runs] == ["fused", "key_value"], runs
for r in runs:
    assert r["steps_per_s"] > 0 and 0 <= r["hit_rate"] <= 1 and 0 <= r["lru_hit_rate"] <= 1, r
    assert r["drive_reads_per_s"] > 0 and r["drive_writes_per_s"] > 0, r
    assert r["dynamic"] == (sys.argv[2] == "true"), r
assert runs[1]["cache_fraction"] == 0.01 and runs[1]["warm_steps"] >= 1, runs[1]
PY
    then
      fail "key_value_bench --dynamic=$dyn: bad figures in $(cat "$TMP/kv.json")"
    fi
  done
  if "$KVB" --cache_fractions=2 >/dev/null 2>"$TMP/kv.err" || ! grep -q "not in (0, 1]" "$TMP/kv.err"; then
    fail "key_value_bench accepted --cache_fractions=2: $(cat "$TMP/kv.err")"
  fi
fi

# dynamic_bench --backend=cuda over the host CUDA runtime: both tables on
# the CUDA backend's adapter, lookups with ids and outputs in device memory
# too (their first call checked against the host path's output by the
# tool itself: it exits 1 on a difference).
if [ -n "$DBH" ]; then
  if ! "$DBH" --backend=cuda --device_resident --rows=2000 --dim=8 --batch=16 --pooling_factor=4 \
      --iters=1 --id_sets=2 --format=json >"$TMP/dbh.json" 2>"$TMP/dbh.err"; then
    fail "dynamic_bench --backend=cuda failed: $(cat "$TMP/dbh.err")"
  else
    for key in lookup_fixed lookup_dynamic lookup_fixed_device lookup_dynamic_device update_dynamic; do
      v=$(json_field "$TMP/dbh.json" "$key")
      python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) > 0 else 1)' "$v" ||
        fail "dynamic_bench --backend=cuda: $key is $v"
    done
    [ "$(json_field "$TMP/dbh.json" backend)" = cuda ] || fail "dynamic_bench: backend not cuda"
  fi
fi

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checks passed"
