#!/usr/bin/env bash
# Prepares a run on a GPU machine that has the NVIDIA driver but no Bazel and
# none of Debian's libraries (see ../shared/TOOLCHAIN.md): builds the CUDA
# tests and kernel_bench with -c opt and copies them, with every shared
# library they load except glibc's and the driver's, into DIR (default
# .device/bundle, git-ignored). On the GPU machine, `DIR/run.sh OUT` runs the
# tests and the CPU/CUDA benchmarks and writes their logs and JSON to OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.device/bundle}"
targets=(server/backend/cuda/cuda_backend_test cuda/device_query_test
         server/backend/cuda/cuda_fault_test server/backend/cuda/emulation_match_test
         link/peer_link_test
         server/backend/backend_parity_test server/backend/embedding_math_test
         bench/kernel_bench bench/dynamic_bench bench/service_bench cli/emberctl)
labels=()
for t in "${targets[@]}"; do labels+=("//${t%/*}:${t##*/}"); done
bazel build -c opt "${labels[@]}" 2>&1 | tail -n 2 >&2
bin="$(bazel info -c opt bazel-bin 2>/dev/null)"
rm -rf "$dir"
mkdir -p "$dir/lib"
for t in "${targets[@]}"; do
  cp "$bin/$t" "$dir/"
  chmod u+w "$dir/${t##*/}" && strip --strip-unneeded "$dir/${t##*/}"
  ldd "$bin/$t" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | ld-linux* | libcuda.so*) ;;
      *) cp -nL "$lib" "$dir/lib/" ;;
    esac
  done
done
# Stripped, the bundle is about 59 MiB (unstripped 65, over the 64 MiB the
# device tool carries with the working tree; each binary holds the fatbin).
chmod -R u+w "$dir/lib" && strip --strip-unneeded "$dir"/lib/*
# NCCL is loaded when first needed (dlopen), so ldd does not list it. It is
# not carried (218 MB, over the device tool's 64 MiB); run.sh finds the one in
# the GPU machine's Python (nvidia-nccl-cu13) or its CUDA toolkit.
cp bench/torch_compare.py bench/kernel_ab.py bench/kernel_bench_server.py "$dir/"
cat >"$dir/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs on the GPU machine, step by step ($STEPS, in this order by default):
#   tests       the bundled tests, plain (gtest XML and logs in OUT)
#   bench       kernel_bench on the CUDA backend (dims, dtypes, optimizers,
#               zipf, MEAN, --callers) and the CPU backend, dynamic_bench
#               (dynamic tables against fixed ones) on both, and fp16 against
#               fp32 weights on the CPU backend past the caches (kernel_ab.py)
#   service     service_bench with CUDA and CPU workers (emberctl up on
#               127.0.0.1)
#   torch       torch_compare.py against PyTorch's CUDA nn.EmbeddingBag,
#               where python3 has a CUDA torch
#   sanitizers  cuda_backend_test and backend_parity_test under
#               compute-sanitizer's memcheck, racecheck, synccheck and
#               initcheck ($SANITIZERS picks tools), all at once, each bounded
#               by $SANITIZER_TIMEOUT seconds (300 by default: racecheck takes
#               about 190 s over cuda_backend_test on an H100); after the
#               benchmarks, so they do not disturb the timings
# Logs and JSON go to $1; a one-line summary per step goes to stdout. Exits
# non-zero if anything failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: run.sh OUTDIR}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [[ -z "${EMBER_NCCL_LIBRARY:-}" ]]; then
  nccl="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)"
  [[ -f "$nccl" ]] && export EMBER_NCCL_LIBRARY="$nccl"
fi
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
head -n 12 "$out/nvidia-smi.txt"
echo "NCCL: ${EMBER_NCCL_LIBRARY:-not found, the loader path}"
rc=0
summary() { grep -E '^\[  (PASSED|FAILED)  \]|(ERROR|RACECHECK) SUMMARY|Timed out' "$1" | tr '\n' ' '; }
step_tests() {
  # cuda_fault_test plants an illegal address: plain runs only, never under
  # the sanitizers (which would report it). peer_link_test's NCCL cases need
  # two GPUs (they skip on one).
  for t in device_query_test cuda_backend_test backend_parity_test embedding_math_test \
           emulation_match_test peer_link_test cuda_fault_test; do
    local start=$SECONDS
    timeout 120 "$here/$t" --gtest_output="xml:$out/$t.xml" >"$out/$t.log" 2>&1 || rc=1
    echo "$t: $(summary "$out/$t.log") ($((SECONDS - start)) s)"
  done
}
bench() { timeout 120 "$here/kernel_bench" "$@" --format=json >>"$out/kernel_bench.jsonl" \
            2>>"$out/kernel_bench.err" || rc=1; }
step_bench() {
  for config in "cuda 1" "cpu 16"; do
    set -- $config
    for dim in 64 128; do
      for batch in 2048 16384; do
        bench --backend="$1" --threads="$2" --dim="$dim" --batch="$batch"
      done
    done
  done
  for args in "--dtype=fp16" "--dtype=bf16" "--optimizer=adagrad" "--optimizer=rowwise_adagrad" \
              "--optimizer=adam" "--distribution=zipf" "--pooling=mean" "--dim=256" "--dim=32" \
              "--callers=2" "--callers=4"; do
    bench --backend=cuda --batch=16384 $args
  done
  # fused_uvm: the same tables in host memory mapped into the GPU (the
  # bus's rate against HBM's, each line named "... fused_uvm").
  for dim in 64 128; do
    bench --backend=cuda --uvm --dim="$dim" --batch=16384
    bench --backend=cuda --uvm --dim="$dim" --batch=16384 --distribution=zipf
  done
  echo "kernel_bench: $(wc -l <"$out/kernel_bench.jsonl") runs in OUT/kernel_bench.jsonl"
  # Dynamic (hash-keyed) tables against fixed ones on each backend: the CUDA
  # backend finds the ids on the device (find + gather, keys/s; with
  # --device_resident also with ids and outputs kept in device memory).
  for config in "cuda 1 --device_resident" "cpu 16"; do
    set -- $config
    for rows in 1000000 10000000; do
      for dist in uniform zipf; do
        timeout 240 "$here/dynamic_bench" --backend="$1" --threads="$2" ${3:-} --rows="$rows" \
          --dim=64 --batch=16384 --distribution="$dist" --format=json >>"$out/dynamic_bench.jsonl" \
          2>>"$out/dynamic_bench.err" || rc=1
      done
    done
  done
  echo "dynamic_bench: $(wc -l <"$out/dynamic_bench.jsonl") runs in OUT/dynamic_bench.jsonl"
  # fp16 weights read half the bytes: forward against fp32 on a table far
  # past the caches, timed in turn (bench/kernel_ab.py), 1 and 16 threads.
  for threads in 1 16; do
    timeout 240 python3 "$here/kernel_ab.py" --a="$here/kernel_bench --dtype=fp32" \
      --b="$here/kernel_bench --dtype=fp16" --pairs=6 -- --dim=32 --rows=10000000 \
      --threads="$threads" --id_sets=16 >>"$out/fp16_vs_fp32.txt" 2>&1 || rc=1
  done
  cat "$out/fp16_vs_fp32.txt"
}
step_service() {
  # The whole service with CUDA workers (emberctl up --device=cuda on GPU 0)
  # against CPU workers, and each against the in-process CPU collection.
  for config in "cuda 1 1" "cuda 2 1" "cpu 2 8"; do
    set -- $config
    timeout 180 "$here/service_bench" --emberctl="$here/emberctl" --device="$1" --workers="$2" \
      --worker_threads="$3" --inprocess_threads=16 --iters=100 --format=json \
      >>"$out/service_bench.jsonl" 2>>"$out/service_bench.err" || rc=1
  done
  cat "$out/service_bench.jsonl"
}
step_torch() {
  if ! python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "torch_compare: python3 has no CUDA torch here"
    return
  fi
  for batch in 2048 16384; do
    timeout 300 python3 "$here/torch_compare.py" --kernel_bench="$here/kernel_bench" \
      --device=cuda --dims=64,128 --threads=1 --batch="$batch" --format=json \
      >>"$out/torch_compare.jsonl" 2>>"$out/torch_compare.err" || rc=1
  done
  cat "$out/torch_compare.jsonl"
}
step_sanitizers() {
  if ! command -v compute-sanitizer >/dev/null; then
    echo "compute-sanitizer: not installed here"
    return
  fi
  local jobs=()
  for tool in ${SANITIZERS-memcheck racecheck synccheck initcheck}; do
    for t in cuda_backend_test backend_parity_test; do
      timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --error-exitcode 3 \
        "$here/$t" --gtest_brief=1 >"$out/sanitizer.$tool.$t.log" 2>&1 &
      jobs+=("$!:$tool $t")
    done
  done
  for job in "${jobs[@]}"; do
    local status=0 name="${job#*:}"
    local log="$out/sanitizer.${name/ /.}.log"
    wait "${job%%:*}" || status=$?
    [[ $status == 124 ]] && echo "Timed out" >>"$log"
    [[ $status == 0 ]] || rc=1
    echo "compute-sanitizer $name: $(summary "$log") (exit $status)"
  done
}
for step in ${STEPS-tests bench service torch sanitizers}; do
  start=$SECONDS
  "step_$step"
  echo "--- $step: $((SECONDS - start)) s"
done
exit "$rc"
RUN
chmod +x "$dir/run.sh"
du -sh "$dir" >&2
echo "bundle ready: $dir (run on the GPU machine: $dir/run.sh OUTDIR)" >&2
