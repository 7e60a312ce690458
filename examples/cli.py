"""The command line both example servers share: where to listen, how to size the engine.

``--port 0`` picks a free port; the server prints the URL it is bound to as its first
line (``make demo`` and the tests read it). The servers bind 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Final, cast

from api import Service
from engine import Engine, merge_outputs

import tether

__all__ = ["HOST", "SHUTDOWN_MARGIN", "Options", "announce", "build_service", "parse"]

HOST = "127.0.0.1"

SHUTDOWN_MARGIN: Final = 3.0
"""Seconds a server waits, once the drain is over, for the last responses to go out
(the drained streams' error events, the 503s of JSON waits) before it cancels the
handlers still running. Each server's own grace period is derived from the drain
timeout and this margin, so that it never cuts the drain short."""


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    """What the command line chose; see :func:`parse` for the meaning of each."""

    port: int
    max_batch: int
    step_ms: float
    fail_fraction: float
    max_in_flight: int | None
    drain_timeout: float
    engine: str | None = None
    workers: int = 1
    redis: str | None = None


def parse(argv: Sequence[str] | None, description: str) -> Options:
    """Parse the example server's arguments (``--help`` lists them)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--port", type=int, default=8000, help="TCP port on 127.0.0.1; 0 = any")
    parser.add_argument("--max-batch", type=int, default=64, help="engine batch slots")
    parser.add_argument("--step-ms", type=float, default=5.0, help="engine step interval, ms")
    parser.add_argument(
        "--fail-fraction", type=float, default=0.0, help="share of requests the engine fails"
    )
    parser.add_argument(
        "--max-in-flight", type=int, default=None, help="admission limit (503 beyond it)"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=2.0,
        help="seconds that requests in flight get to finish on SIGINT or SIGTERM",
    )
    add_scale_out(parser)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.drain_timeout < 0:
        parser.error(f"--drain-timeout must be at least 0, got {args.drain_timeout}")
    return Options(
        port=args.port,
        max_batch=args.max_batch,
        step_ms=args.step_ms,
        fail_fraction=args.fail_fraction,
        max_in_flight=args.max_in_flight,
        drain_timeout=args.drain_timeout,
        engine=args.engine,
        workers=args.workers,
        redis=args.redis,
    )


def add_scale_out(parser: argparse.ArgumentParser) -> None:
    """``--engine`` and ``--workers``: the engine in its own process, several fronts."""
    parser.add_argument(
        "--engine",
        metavar="ADDRESS",
        default=None,
        help="the ZeroMQ address of engine_server.py (ipc:// or tcp://127.0.0.1:...); "
        "without it the engine runs in each server process",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="server processes sharing the port (pre-fork)"
    )
    parser.add_argument(
        "--redis",
        metavar="URL",
        default=None,
        help="keep resumable streams in this Redis (redis://127.0.0.1:6379), so that a "
        "reconnect continues on any server sharing it; without it, in each process",
    )


def build_service(options: Options) -> Service:
    """The engine and the registry wired together: ``on_abort`` is the engine's abort."""
    if options.engine is not None:
        return build_remote_service(options, options.engine)
    engine = Engine(
        max_batch=options.max_batch,
        step_interval=options.step_ms / 1000,
        fail_fraction=options.fail_fraction,
    )
    registry = tether.Registry(
        on_abort=engine.abort, merge=merge_outputs, max_in_flight=options.max_in_flight
    )
    return Service(engine, registry, redis=options.redis)


def build_remote_service(options: Options, address: str) -> Service:
    """The registry wired to the engine process at ``address`` (``engine_server.py``)."""
    from remote_engine import RemoteEngine  # (needs tether[zmq]: imported only when asked)

    remote = RemoteEngine(address)
    registry = tether.Registry(
        on_abort=remote.abort, merge=merge_outputs, max_in_flight=options.max_in_flight
    )
    # RemoteEngine has every call Service and the servers make of an Engine.
    return Service(cast(Engine, remote), registry, redis=options.redis)


def announce(framework: str, port: int) -> None:
    """Print the URL the server listens on (the first line of its output)."""
    print(f"tether example ({framework}) listening on http://{HOST}:{port}/", flush=True)
