#!/usr/bin/env python3
"""Checks deploy/ offline (there is no API server to apply to):

1. `kubectl kustomize` renders every overlay;
2. the output validates against the Kubernetes schemas (kubernetes-validate
   --strict) for the oldest and newest versions supported;
3. what schemas cannot see: every emberctl flag in a container's args is one
   `emberctl --helpfull` knows; probes point at the --health_port the args
   open, and that port, --listen's and --metrics_port's are container ports;
   the Prometheus annotation names --metrics_port; workers take their memory
   cap from the pod's limit (no --memory_gib, limits.memory set); the device
   flag and GPU requests agree with the overlay.

    deploy/check_manifests.py EMBERCTL [--kubectl kubectl]

Prints one line per check and exits non-zero if any failed.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
OVERLAYS = ["cpu", "gpu"]
K8S_VERSIONS = ["1.25.0", "1.32.0"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("emberctl")
    p.add_argument("--kubectl", default="kubectl")
    return p.parse_args()


def flag_values(args):
    out = {}
    for a in args:
        m = re.match(r"--([a-z_]+)(=(.*))?$", a)
        if m:
            out[m.group(1)] = m.group(3) if m.group(2) else "true"
    return out


def check_pod(kind, name, pod, overlay, known_flags, problems):
    annotations = pod.get("metadata", {}).get("annotations", {})
    spec = pod["spec"]
    for c in spec["containers"]:
        where = f"{overlay}: {kind}/{name} container {c['name']}"
        args = c.get("args", [])
        flags = flag_values(args)
        for f in flags:
            if f not in known_flags:
                problems.append(f"{where}: emberctl has no flag --{f}")
        ports = {p["containerPort"]: p.get("name") for p in c.get("ports", [])}
        listen = int(flags["listen"].rsplit(":", 1)[1]) if "listen" in flags else None
        health = int(flags.get("health_port", 0))
        metrics = int(flags.get("metrics_port", 0))
        for what, port in (("--listen", listen), ("--health_port", health),
                           ("--metrics_port", metrics)):
            if port and port not in ports:
                problems.append(f"{where}: {what} port {port} is not a container port")
        for probe in ("readinessProbe", "livenessProbe"):
            p = c.get(probe)
            if p is None:
                problems.append(f"{where}: no {probe}")
                continue
            if p.get("grpc", {}).get("port") != health or not health:
                problems.append(f"{where}: {probe} is not a gRPC probe of --health_port "
                                f"({p}, health port {health})")
        if annotations.get("prometheus.io/port") != str(metrics):
            problems.append(f"{where}: prometheus.io/port "
                            f"{annotations.get('prometheus.io/port')} != --metrics_port {metrics}")
        limits = c.get("resources", {}).get("limits", {})
        if args and args[0] == "worker":
            if "memory_gib" in flags:
                problems.append(f"{where}: --memory_gib overrides the pod's memory limit")
            if "memory" not in limits:
                problems.append(f"{where}: no memory limit (the worker's cap comes from it)")
            device = flags.get("device", "cpu")
            gpus = int(limits.get("nvidia.com/gpu", 0))
            want = "cuda" if overlay == "gpu" else "cpu"
            if device != want:
                problems.append(f"{where}: --device={device} in the {overlay} overlay")
            if (device == "cuda") != (gpus == 1):
                problems.append(f"{where}: --device={device} with {gpus} GPU(s) requested")


def main():
    a = parse_args()
    help_text = subprocess.run([a.emberctl, "--helpfull"], capture_output=True, text=True)
    known = set(re.findall(r"-([a-z_]+) \(", help_text.stdout + help_text.stderr))
    if "health_port" not in known:
        sys.exit(f"check_manifests: cannot read emberctl's flags from {a.emberctl} --helpfull")
    problems, checks = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for overlay in OVERLAYS:
            render = subprocess.run([a.kubectl, "kustomize", os.path.join(HERE, "overlays", overlay)],
                                    capture_output=True, text=True)
            checks += 1
            if render.returncode != 0:
                problems.append(f"{overlay}: kubectl kustomize failed: {render.stderr.strip()}")
                continue
            print(f"ok   {overlay}: kustomize renders", flush=True)
            path = os.path.join(tmp, f"{overlay}.yaml")
            with open(path, "w") as f:
                f.write(render.stdout)
            for version in K8S_VERSIONS:
                checks += 1
                v = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict",
                                    "-k", version, path], capture_output=True, text=True)
                if v.returncode != 0:
                    problems.append(f"{overlay}: not valid for Kubernetes {version}:\n"
                                    f"{v.stdout}{v.stderr}")
                else:
                    print(f"ok   {overlay}: valid for Kubernetes {version} (--strict)", flush=True)
            docs = [d for d in yaml.safe_load_all(render.stdout) if d]
            before = len(problems)
            for d in docs:
                if d["kind"] in ("Deployment", "StatefulSet"):
                    checks += 1
                    check_pod(d["kind"], d["metadata"]["name"], d["spec"]["template"], overlay,
                              known, problems)
            if len(problems) == before:
                print(f"ok   {overlay}: flags, ports, probes, metrics and memory agree", flush=True)
    for p in problems:
        print(f"FAIL {p}", flush=True)
    print(f"check_manifests: {checks} checks, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
