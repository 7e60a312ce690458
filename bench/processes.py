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
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "FRAMEWORKS",
    "LOG",
    "MALLOC_ENV",
    "PIN_ENV",
    "PYTHON",
    "ROOT",
    "client",
    "client_plan",
    "pin_to",
    "server",
    "stop",
]

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
LOG = ROOT / "bench" / "results" / "servers.log"

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "4194304"}
"""glibc's thresholds, pinned for every server alike. Left dynamic, they decide at
random whether a process serves asyncio's 256 KiB socket-read buffer with ``mmap``
and gives it back (``mremap``, ``munmap``) on every read: which happens depends on
the process's allocation history, which the hash seed alone changes. Measured on
one aiohttp server (JSON, 64 clients): 53-55 µs of CPU per request with one hash
seed, 66-72 µs with three others; pinned, 52-55 µs with all four. Unpinned, that
would land on one side of a ratio at random."""
FRAMEWORKS = ("starlette", "aiohttp")

PIN_ENV = "BENCH_PIN"
"""Set to ``0`` to leave the processes wherever the kernel puts them."""


def _cpu(role: str) -> int | None:
    """The one CPU a server (the last one this process may use) or a client (the
    first) runs on, where there are two or more and :data:`PIN_ENV` is not ``0``.

    Left to the kernel, a server and its client at one connection share a core in
    some repetitions and not in others, and every wake-up of the other side then
    crosses cores or does not: on 2 quiet cores (load 0.2), tether against its
    previous tree at one client, 10 paired repetitions spread 0.2-5x in events/s.
    Pinned, each side keeps its core in every repetition and every cell.
    """
    if os.environ.get(PIN_ENV) == "0" or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return cpus[-1] if role == "server" else cpus[0]


def pin_to(role: str) -> Callable[[], None] | None:
    """A ``preexec_fn`` that pins the child to its role's CPU (:func:`_cpu`), if any."""
    cpu = _cpu(role)
    if cpu is None:
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


@contextlib.contextmanager
def server(
    framework: str,
    variant: str,
    *extra: str,
    seed: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[int, str]]:
    """Start a benchmark server; yield its pid and base URL; stop it by pid.

    Every server runs with glibc's malloc thresholds pinned (:data:`MALLOC_ENV`);
    ``seed`` is its ``PYTHONHASHSEED``, the same for the servers compared within a
    repetition. ``env``: more of the server's environment (``PYTHONPATH`` to run
    another tree's tether under this harness: :mod:`bench.ab`).
    """
    LOG.parent.mkdir(parents=True, exist_ok=True)
    module = f"bench.servers.{framework}_server"
    with LOG.open("a") as log:
        log.write(f"--- {module} --variant {variant} {' '.join(extra)}\n")
        log.flush()
        proc = subprocess.Popen(
            [PYTHON, "-m", module, "--variant", variant, *extra],
            cwd=ROOT,
            env={
                **os.environ,
                **MALLOC_ENV,
                **({} if seed is None else {"PYTHONHASHSEED": str(seed)}),
                **(env or {}),
            },
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            preexec_fn=pin_to("server"),
        )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)  # (a loaded machine imports slowly)
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


def client(mode: str, url: str, *options: object, timeout: float = 180) -> Any:
    """Run the load client once in its own process; its one JSON line of results."""
    argv = [PYTHON, "-m", "bench.client", mode, url, *map(str, options)]
    done = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, preexec_fn=pin_to("client")
    )
    if done.returncode != 0:
        raise RuntimeError(f"client failed: {' '.join(argv)}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def client_plan(runs: list[list[object]]) -> list[dict[str, Any]]:
    """Run the load client's ``runs`` (each its command line after ``bench.client``)
    one after the other in one process; their results, in order."""
    seconds = sum(
        float(argv[argv.index(flag) + 1])
        for argv in runs
        for flag in ("--warmup", "--duration")
        if flag in argv
    )
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(runs, file)
        file.flush()
        results: list[dict[str, Any]] = client("plan", file.name, timeout=60 + 2 * seconds)
    return results
