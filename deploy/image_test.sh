#!/usr/bin/env bash
# The container image end to end, with podman (no Docker engine or registry
# is needed): builds deploy/Dockerfile's runtime stage around the emberctl
# Bazel just built, on a Debian 12 base made by debootstrap (cached as
# localhost/ember-base:bookworm), runs a coordinator and two workers as
# containers (unprivileged, read-only root), and checks that a lookup through
# them equals the same lookup on a host `emberctl up` cluster.
#
# Root only, and needs podman, runc and debootstrap (scripts/setup.sh
# installs them); skipped with a message otherwise. Bounded: every podman
# step has a timeout and the containers are removed on exit.
#
# Args: EMBERCTL DOCKERFILE
set -uo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # debootstrap; Bazel's test PATH leaves these out
emberctl=$(readlink -f "$1")
dockerfile=$(readlink -f "$2")
work=${TEST_TMPDIR:-$(mktemp -d)}/image_test
rm -rf "$work" && mkdir -p "$work"
tag="localhost/ember-test:$$"
base="localhost/ember-base:bookworm"
names=("ember-it-c-$$" "ember-it-w0-$$" "ember-it-w1-$$")
up_pid=""

# A skipped case still shows in scripts/test.sh's count (JUnit <skipped/>).
skip() {
  echo "SKIPPED: $*"
  if [ -n "${XML_OUTPUT_FILE:-}" ]; then
    cat >"$XML_OUTPUT_FILE" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<testsuites><testsuite name="image_test" tests="1" skipped="1">
<testcase name="image_test" classname="deploy"><skipped message="$*"/></testcase>
</testsuite></testsuites>
EOF
  fi
  exit 0
}
fail() {
  echo "FAIL: $*" >&2
  for n in "${names[@]}"; do
    podman logs "$n" 2>&1 | sed "s/^/$n| /" | tail -20 >&2
  done
  exit 1
}
cleanup() {
  for n in "${names[@]}"; do timeout 30 podman rm -f -t 2 "$n" >/dev/null 2>&1; done
  timeout 30 podman rmi -f "$tag" >/dev/null 2>&1
  timeout 30 podman image prune -f >/dev/null 2>&1  # the build's untagged stages
  [ -n "$up_pid" ] && kill "$up_pid" 2>/dev/null && wait "$up_pid" 2>/dev/null
  rm -rf "$work"
}

[ "$(id -u)" -eq 0 ] || skip "needs root (podman with runc, debootstrap)"
for tool in podman runc debootstrap; do
  command -v "$tool" >/dev/null || skip "$tool is not installed (scripts/setup.sh installs it)"
done
trap cleanup EXIT

# runc with ulimits the sandbox allows (crun fails on these hybrid cgroups).
cat >"$work/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF="$work/containers.conf"

if ! podman image exists "$base"; then
  echo "==> base image: debootstrap --variant=minbase bookworm (once per machine)"
  timeout 600 debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian \
    >"$work/debootstrap.log" 2>&1 || { tail -5 "$work/debootstrap.log"; fail "debootstrap failed"; }
  tar -C "$work/rootfs" -c . | timeout 300 podman import - "$base" >"$work/import.log" 2>&1 ||
    fail "podman import failed"
  rm -rf "$work/rootfs"
fi

echo "==> runtime image around $emberctl"
# The Dockerfile's runtime stage verbatim, after a build stage that only
# brings the binary.
mkdir -p "$work/context"
cp "$emberctl" "$work/context/emberctl"
{
  echo 'ARG BASE'
  echo 'FROM scratch AS build'
  echo 'COPY emberctl /out/emberctl'
  sed -n '/^FROM .* AS runtime$/,$p' "$dockerfile"
} >"$work/context/Dockerfile"
grep -q "AS runtime" "$work/context/Dockerfile" || fail "no runtime stage in $dockerfile"
timeout 600 podman build --network=host --build-arg BASE="$base" \
  -t "$tag" "$work/context" >"$work/build.log" 2>&1 ||
  { tail -20 "$work/build.log"; fail "podman build failed"; }
[ "$(podman image inspect --format '{{.Config.User}}' "$tag")" = "65532:65532" ] ||
  fail "the image does not run as the unprivileged user"

# The containers: host network (ports on 127.0.0.1), read-only root without
# even a writable /tmp (as readOnlyRootFilesystem in the manifests).
run() {
  local name=$1
  shift
  timeout 60 podman run -d --rm --read-only --read-only-tmpfs=false --network=host --name "$name" "$tag" "$@" >/dev/null ||
    fail "podman run $name failed"
}
# The first line of a container's output starting with $2 (up to 30 s).
wait_line() {
  local i line
  for i in $(seq 150); do
    line=$(podman logs "$1" 2>/dev/null | grep -m1 "^$2") && { echo "${line#"$2"}"; return 0; }
    sleep 0.2
  done
  return 1
}
run "${names[0]}" coordinator --listen=127.0.0.1:0 --lease_ms=3000
coordinator=$(wait_line "${names[0]}" "coordinator listening on ") || fail "no coordinator"
echo "==> coordinator (container) at $coordinator"
for i in 0 1; do
  run "${names[$((i + 1))]}" worker --coordinator="$coordinator" --listen=127.0.0.1:0 --memory_gib=1
  wait_line "${names[$((i + 1))]}" "worker " >/dev/null || fail "worker $i did not start"
done
[ "$(podman exec "${names[0]}" id -u)" = 65532 ] || fail "the coordinator runs as root"

cat >"$work/spec.json" <<'EOF'
{"name": "img", "tables": [
  {"name": "t0", "num_embeddings": 1000, "embedding_dim": 16, "feature_names": ["f0"], "pooling": "SUM"},
  {"name": "t1", "num_embeddings": 300, "embedding_dim": 8, "feature_names": ["f1"], "pooling": "MEAN"}]}
EOF
cat >"$work/kjt.json" <<'EOF'
{"keys": ["f0", "f1"], "lengths": [2, 0, 3, 1, 2, 1], "values": [1, 999, 5, 500, 7, 0, 299, 13, 42]}
EOF
lookup() {  # coordinator output
  "$emberctl" create --coordinator="$1" --spec="$work/spec.json" --sharding_type=row_wise \
    >"$work/create.out" 2>&1 || { cat "$work/create.out"; return 1; }
  "$emberctl" lookup --coordinator="$1" --collection=img --input="$work/kjt.json" --output="$2"
}
lookup "$coordinator" "$work/container.json" || fail "lookup through the containers failed"
echo "==> lookup through the containers: $(head -c 120 "$work/container.json")..."

# The reference: the same binary on the host.
"$emberctl" up --workers=2 >"$work/up.out" 2>"$work/up.err" &
up_pid=$!
for i in $(seq 300); do grep -q "^ready:" "$work/up.out" && break; sleep 0.1; done
host=$(awk '/^coordinator:/ {print $2; exit}' "$work/up.out")
[ -n "$host" ] || { cat "$work/up.err"; fail "emberctl up did not start"; }
lookup "$host" "$work/host.json" || fail "lookup on the host cluster failed"
cmp -s "$work/container.json" "$work/host.json" ||
  fail "the containers' lookup differs from the host's: $(diff "$work/container.json" "$work/host.json" | head -5)"
echo "PASSED: a coordinator and two workers in containers served the lookup the host serves"
