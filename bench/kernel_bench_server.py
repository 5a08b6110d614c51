"""kernel_bench --serve as a child process, for the scripts that time it.

Its tables are set up once; each measure() asks for fresh forward and
backward timings (one JSON line). Used by bench/torch_compare.py and
bench/kernel_ab.py.
"""

import json
import subprocess
import sys
import tempfile
import time


class KernelBenchServer:
    """One `kernel_bench --serve`; `who` prefixes its error messages."""

    def __init__(self, cmd, who):
        self.cmd = list(cmd)
        self.who = who
        # stderr to a file: a pipe nobody reads could fill and stall it.
        self.err = tempfile.TemporaryFile(mode="w+")
        try:
            self.proc = subprocess.Popen(self.cmd + ["--serve"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.err, text=True)
        except OSError as e:
            sys.exit(f"{who}: cannot start {self.cmd[0]}: {e}")

    def measure(self, pause=0.25):
        """Fresh timings, `pause` seconds after the caller's last work.

        The pause is for PyTorch's OpenMP threads, which spin for a while
        after each parallel region (libgomp: GOMP_SPINCOUNT, tens of ms with
        PAUSE's latency on these cores); timed right after the peer, Ember's
        threads would share the cores with that spin and read slower than
        they are (docs/lab-notes/2026-11-benchmarks.md).
        """
        time.sleep(pause)
        try:
            self.proc.stdin.write("measure\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.proc.wait()
            self.err.seek(0)
            sys.exit(f"{self.who}: {' '.join(self.cmd)} failed (exit {self.proc.returncode}): "
                     f"{self.err.read().strip()}")
        return json.loads(line)

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait()
        self.err.close()
