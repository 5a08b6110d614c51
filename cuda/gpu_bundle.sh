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
targets=(cuda/cuda_backend_test cuda/device_query_test server/backend/backend_parity_test
         bench/kernel_bench)
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
cat >"$dir/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the bundled CUDA tests and benchmarks; logs and JSON go to $1.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: run.sh OUTDIR}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
rc=0
for t in device_query_test cuda_backend_test backend_parity_test; do
  "$here/$t" --gtest_output="xml:$out/$t.xml" >"$out/$t.log" 2>&1 || rc=1
  echo "$t: $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/$t.log" | tr '\n' ' ')"
done
for backend in cuda cpu; do
  for dim in 64 128; do
    for batch in 2048 16384; do
      "$here/kernel_bench" --backend="$backend" --dim="$dim" --batch="$batch" --threads=16 \
        --format=json >>"$out/kernel_bench.jsonl" 2>>"$out/kernel_bench.err" || rc=1
    done
  done
done
cat "$out/kernel_bench.jsonl"
exit "$rc"
RUN
chmod +x "$dir/run.sh"
du -sh "$dir" >&2
echo "bundle ready: $dir (run on the GPU machine: $dir/run.sh OUTDIR)" >&2
