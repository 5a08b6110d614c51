"""Shared by the tests that run one process per rank over gloo
(test_torchrec_dropin's and test_training's): not a test itself."""

import os
import socket
import subprocess
import sys


def run_rank_processes(script, args_of, world=2, timeout=240):
    """Runs `world` processes of `script` (beside this file), rank r with
    --rank=r --world=world --port=P (a free port for gloo) and args_of(r);
    fails with their output unless each prints "rank R ok"."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
    procs = [subprocess.Popen([sys.executable, path, f"--rank={r}", f"--world={world}",
                               f"--port={port}"] + args_of(r),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {r} ok" in out, out[-3000:]
