"""The `emberctl` console script of an installed wheel: runs the emberctl
binary the wheel carries (ember/bin/emberctl) with this process's
arguments."""

import os
import sys


def main():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "emberctl")
    if not os.access(path, os.X_OK):
        sys.exit(f"emberctl: {path} is missing: this ember was not installed from a wheel "
                 "(in a checkout, run bazel-bin/cli/emberctl)")
    os.execv(path, [path] + sys.argv[1:])
