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
targets=(cuda/cuda_backend_test cuda/device_query_test cuda/cuda_fault_test
         cuda/emulation_match_test cuda/peer_link_test
         server/backend/backend_parity_test server/backend/embedding_math_test
         bench/kernel_bench bench/service_bench cli/emberctl)
labels=()
for t in "${targets[@]}"; do labels+=("//${t%/*}:${t##*/}"); done
bazel build -c opt "${labels[@]}" 2>&1 | tail -n 2 >&2
bin="$(bazel info -c opt bazel-bin 2>/dev/null)"
rm -rf "$dir"
mkdir -p "$dir/lib"
for t in "${targets[@]}"; do
  cp "$bin/$t" "$dir/"
  ldd "$bin/$t" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | ld-linux* | libcuda.so*) ;;
      *) cp -nL "$lib" "$dir/lib/" ;;
    esac
  done
done
# NCCL is loaded when first needed (dlopen), so ldd does not list it.
nccl="$(ldconfig -p | awk '/libnccl\.so\.2 / {print $NF; exit}')"
cp -L "${nccl:-/usr/local/cuda/lib64/libnccl.so.2}" "$dir/lib/libnccl.so.2"
cp bench/torch_compare.py "$dir/"
cat >"$dir/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the bundled CUDA tests (plain, then under compute-sanitizer's memcheck,
# racecheck, synccheck and initcheck where it is installed; $SANITIZERS picks
# the tools, $SANITIZER_TIMEOUT bounds each run, 150 s by default), the kernel
# benchmark on both backends, and torch_compare.py against PyTorch's CUDA
# nn.EmbeddingBag where python3 has torch, and service_bench with CUDA and
# CPU workers (emberctl up on 127.0.0.1). Logs, gtest XML and JSON go to $1;
# a one-line summary per step goes to stdout.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: run.sh OUTDIR}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
head -n 12 "$out/nvidia-smi.txt"
rc=0
summary() { grep -E '^\[  (PASSED|FAILED)  \]|(ERROR|RACECHECK) SUMMARY' "$1" | tr '\n' ' '; }
# cuda_fault_test plants an illegal address: plain runs only, never under
# the sanitizers (which would report it).
# peer_link_test's NCCL cases need two GPUs (they skip on one).
for t in device_query_test cuda_backend_test backend_parity_test embedding_math_test \
         emulation_match_test peer_link_test cuda_fault_test; do
  timeout 120 "$here/$t" --gtest_output="xml:$out/$t.xml" >"$out/$t.log" 2>&1 || rc=1
  echo "$t: $(summary "$out/$t.log")"
done
if command -v compute-sanitizer >/dev/null; then
  for tool in ${SANITIZERS-memcheck racecheck synccheck initcheck}; do
    for t in cuda_backend_test backend_parity_test; do
      log="$out/sanitizer.log"
      echo "=== $tool $t" >>"$log"
      timeout "${SANITIZER_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 3 "$here/$t" \
        --gtest_brief=1 >>"$log" 2>&1 || rc=1
      echo "compute-sanitizer $tool $t: $(sed -n "/^=== $tool $t\$/,\$p" "$log" | summary /dev/stdin)"
    done
  done
else
  echo "compute-sanitizer: not installed here"
fi
for config in "cuda 1" "cpu 16"; do
  set -- $config
  for dim in 64 128; do
    for batch in 2048 16384; do
      timeout 120 "$here/kernel_bench" --backend="$1" --threads="$2" --dim="$dim" \
        --batch="$batch" --format=json >>"$out/kernel_bench.jsonl" 2>>"$out/kernel_bench.err" \
        || rc=1
    done
  done
done
for args in "--dtype=fp16" "--dtype=bf16" "--optimizer=adagrad" "--optimizer=rowwise_adagrad" \
            "--optimizer=adam" "--distribution=zipf" "--pooling=mean" "--dim=256" "--dim=32" \
            "--callers=2" "--callers=4"; do
  timeout 120 "$here/kernel_bench" --backend=cuda --batch=16384 $args --format=json \
    >>"$out/kernel_bench.jsonl" 2>>"$out/kernel_bench.err" || rc=1
done
cat "$out/kernel_bench.jsonl"
# The whole service with CUDA workers (emberctl up --device=cuda on GPU 0)
# against CPU workers, and each against the in-process CPU collection.
for config in "cuda 1 1" "cuda 2 1" "cpu 2 8"; do
  set -- $config
  timeout 180 "$here/service_bench" --emberctl="$here/emberctl" --device="$1" --workers="$2" \
    --worker_threads="$3" --inprocess_threads=16 --iters=100 --format=json \
    >>"$out/service_bench.jsonl" 2>>"$out/service_bench.err" || rc=1
done
cat "$out/service_bench.jsonl"
if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  for batch in 2048 16384; do
    timeout 300 python3 "$here/torch_compare.py" --kernel_bench="$here/kernel_bench" \
      --device=cuda --dims=64,128 --threads=1 --batch="$batch" --format=json \
      >>"$out/torch_compare.jsonl" 2>>"$out/torch_compare.err" || rc=1
  done
  cat "$out/torch_compare.jsonl"
else
  echo "torch_compare: python3 has no CUDA torch here"
fi
exit "$rc"
RUN
chmod +x "$dir/run.sh"
du -sh "$dir" >&2
echo "bundle ready: $dir (run on the GPU machine: $dir/run.sh OUTDIR)" >&2
