"""Instructions per request of the in-process paths, counted by valgrind: a change of
1 % that the shared machine's noise hides in any timing.

``python -m bench.instructions [--path json|stream] [--variants raw,tether]
[--producer-writes] [TREE ...]`` runs :mod:`bench.json_path`'s (or
:mod:`bench.stream_path`'s) variants under ``valgrind --tool=callgrind`` twice, with a
few requests and with many more, and reports the difference of the two instruction
counts over the difference of requests: what one request costs, the interpreter's
start and imports cancelled out. ``--framework aiohttp [--clients C] [--shape S]``
counts :mod:`bench.aiohttp_path` instead (variants ``handoff,tether``: the benchmark
server itself, with loopback clients whose count is the same for every variant).
Each TREE (a directory holding ``src/`` and ``adapters/``; by default this
checkout) is measured with this checkout's harness, as :mod:`bench.ab` does. Same
tree, same count: runs agree to a few thousandths of a percent (the hash seed is
fixed), so one run per cell is enough, and the ratio of a variant to the first is
exact for what it measures.

What it does not see: time in the kernel (a system call counts as the few
instructions that make it), cache misses, and the collector's cost in a process with
a server's heap (the harness's heap is small). It ranks code changes; the HTTP
benchmarks say what they are worth.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .processes import ROOT

__all__ = ["count", "main", "per_request", "valgrind"]

FEW, MANY = 500, 3_000
"""Requests of the two runs (each after a warm-up of a tenth as many)."""

_DRIVER = """
import asyncio, functools, sys
from bench import json_path
build = functools.partial(
    json_path.build, streaming=sys.argv[1] == "stream", producer_writes=sys.argv[4] == "1"
)
asyncio.run(json_path.cpu_per_request(build, sys.argv[2], int(sys.argv[3])))
"""

_AIOHTTP_DRIVER = """
import sys
from bench import aiohttp_path
aiohttp_path.main(sys.argv[1:])
"""

_COLLECTED = re.compile(r"Collected : (\d+)")


def valgrind() -> str | None:
    """valgrind's path, if installed (``.ci/run`` installs it)."""
    return shutil.which("valgrind")


def count(
    tree: Path,
    path: str,
    variant: str,
    requests: int,
    *,
    producer_writes: bool = False,
    aiohttp: tuple[int, str] | None = None,
) -> int:
    """Instructions of one process that runs ``requests`` requests (and the warm-up);
    ``producer_writes``: the tether variant's middleware option of that name;
    ``aiohttp``: on :mod:`bench.aiohttp_path` instead, with these clients and shape."""
    tool = valgrind()
    if tool is None:
        raise RuntimeError("valgrind is not installed (Debian: apt-get install valgrind)")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(tree / "src"), str(tree / "adapters")]),
        "PYTHONHASHSEED": "0",
    }
    argv = [tool, "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    if aiohttp is None:
        argv += [sys.executable, "-c", _DRIVER, path, variant, str(requests)]
        argv.append(str(int(producer_writes)))
    else:
        clients, shape = aiohttp
        argv += [sys.executable, "-c", _AIOHTTP_DRIVER, variant, path, str(requests)]
        argv += ["--clients", str(clients), "--shape", shape]
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"valgrind failed on {variant} ({tree}): {done.stderr[-2000:]}")
    return int(found.group(1))


def per_request(
    tree: Path,
    path: str,
    variant: str,
    *,
    producer_writes: bool = False,
    aiohttp: tuple[int, str] | None = None,
) -> float:
    """Instructions per request (per event for ``stream``) of ``variant`` on ``tree``."""
    # (both drivers run a warm-up of a tenth as many requests first)
    few, many = (
        count(tree, path, variant, requests, producer_writes=producer_writes, aiohttp=aiohttp)
        for requests in (FEW, MANY)
    )
    extra = many - few
    per = extra / ((MANY - FEW) * 1.1)
    return per / 64 if path == "stream" else per


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("trees", nargs="*", type=Path, default=[ROOT])
    parser.add_argument("--path", choices=["json", "stream"], default="json")
    parser.add_argument("--variants", help="default: raw,tether (aiohttp: handoff,tether)")
    parser.add_argument(
        "--producer-writes", action="store_true", help="tether's middleware with producer_writes"
    )
    parser.add_argument("--framework", choices=["starlette", "aiohttp"], default="starlette")
    parser.add_argument("--clients", type=int, default=1, help="aiohttp: connections at once")
    parser.add_argument("--shape", choices=["step", "task", "thread"], default="step")
    args = parser.parse_args(argv)
    on_aiohttp = args.framework == "aiohttp"
    aiohttp = (args.clients, args.shape) if on_aiohttp else None
    default = "handoff,tether" if on_aiohttp else "raw,tether"
    unit = "event" if args.path == "stream" else "request"
    variants = (args.variants or default).split(",")
    for tree in args.trees:
        figures = {
            variant: per_request(
                tree, args.path, variant, producer_writes=args.producer_writes, aiohttp=aiohttp
            )
            for variant in variants
        }
        first = figures[variants[0]]
        cells = ", ".join(
            f"{variant} {value:,.0f} ({value / first:.3f}x)" for variant, value in figures.items()
        )
        print(f"{tree}: instructions per {unit}: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
