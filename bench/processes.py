"""The benchmark's processes: each server and each load client runs in its own
process on 127.0.0.1, so that neither steals the other's loop or core, and every
server is stopped by its own pid (never by name: other jobs share the machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["FRAMEWORKS", "LOG", "PYTHON", "ROOT", "client", "server", "stop"]

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
LOG = ROOT / "bench" / "results" / "servers.log"
FRAMEWORKS = ("starlette", "aiohttp")


@contextlib.contextmanager
def server(
    framework: str, variant: str, *extra: str, seed: int | None = None
) -> Iterator[tuple[int, str]]:
    """Start a benchmark server; yield its pid and base URL; stop it by pid.

    :param seed: the server's ``PYTHONHASHSEED``. Servers compared with each other
        get the same one: the hash seed alone moves a server's CPU per request by
        up to a quarter (dict and set layouts in the framework's hot paths), which
        would otherwise land on one side of a ratio at random.
    """
    LOG.parent.mkdir(parents=True, exist_ok=True)
    module = f"bench.servers.{framework}_server"
    with LOG.open("a") as log:
        log.write(f"--- {module} --variant {variant} {' '.join(extra)}\n")
        log.flush()
        proc = subprocess.Popen(
            [PYTHON, "-m", module, "--variant", variant, *extra],
            cwd=ROOT,
            env=None if seed is None else {**os.environ, "PYTHONHASHSEED": str(seed)},
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("PORT "):
            raise RuntimeError(f"{module} did not start (see {LOG}): {line!r}")
        yield proc.pid, f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM by pid, then SIGKILL if it lingers."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def client(mode: str, url: str, *options: object) -> dict[str, Any]:
    """Run the load client once in its own process; its one JSON line of results."""
    argv = [PYTHON, "-m", "bench.client", mode, url, *map(str, options)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        raise RuntimeError(f"client failed: {' '.join(argv)}\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
