#!/usr/bin/env bash
# Installs everything Ember needs to build and test on Debian 12, offline
# apart from Debian's package archive. Idempotent: when everything is present
# it only checks and returns (well under a second).
#
# The CUDA toolkit is not installed here: when /usr/local/cuda/bin/nvcc (or
# $CUDA_PATH/bin/nvcc) exists the CUDA targets build, otherwise they are left
# out and the CPU backend serves.
set -euo pipefail

PACKAGES=(
  bazel-bootstrap build-essential pkg-config python3
  protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev
  libabsl-dev libgflags-dev libgoogle-glog-dev libgtest-dev libgmock-dev
  zlib1g-dev libleveldb-dev liburing-dev clang-14 libclang-rt-14-dev
  python3-dev python3-numpy python3-pytest pybind11-dev python3-torch python3-venv
  openssl libssl-dev prometheus-cpp-dev prometheus patchelf
  podman netavark runc debootstrap
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "setup: done" >&2
fi

# The SDK's Python environment (.venv: PyPI torch, torchrec, FBGEMM's CPU
# build), for the TorchRec parity tests, the DLRM example and train_bench.
bash "$(dirname "$0")/setup_python.sh"

# Sanity: the tools the build calls by absolute path.
for tool in /usr/bin/bazel /usr/bin/protoc /usr/bin/grpc_cpp_plugin; do
  if [ ! -x "$tool" ]; then
    echo "setup: $tool is missing after install" >&2
    exit 1
  fi
done
