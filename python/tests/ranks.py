"""Test helper: waits for the processes of a multi-process test (one per rank)."""

import subprocess


def communicate_all(procs, timeout):
    """Returns each process's output (stdout with stderr), decoded; kills every process and
    re-raises when one runs past `timeout` seconds."""
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return logs
