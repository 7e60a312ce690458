"""The command line both example servers share: where to listen, how to size the engine.

``--port 0`` picks a free port; the server prints the URL it is bound to as its first
line (``make demo`` and the tests read it), after the HTTP implementation and event
loop it actually runs on: ``tether example (starlette: http=h11, loop=uvloop)
listening on http://127.0.0.1:PORT/``. The servers bind 127.0.0.1 only.

``--http`` and ``--loop`` choose the server's stack: uvicorn's HTTP parser (h11 or
httptools) and event loop (asyncio's or uvloop), which behave differently where
tether cares most (when a connection's next request starts, when a disconnect is
seen); the aiohttp server has its own HTTP parser and takes ``--loop`` only.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import importlib.util
import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

from api import Service
from engine import Engine, merge_outputs

import tether

if TYPE_CHECKING:
    import uvicorn

__all__ = [
    "HOST",
    "HTTP_CHOICES",
    "LOOP_CHOICES",
    "SHUTDOWN_MARGIN",
    "Options",
    "announce",
    "build_service",
    "configure_logging",
    "loop_factory",
    "parse",
    "uvicorn_config",
    "uvicorn_log_config",
]

HOST = "127.0.0.1"

SHUTDOWN_MARGIN: Final = 3.0
"""Seconds a server waits, once the drain is over, for the last responses to go out
(the drained streams' error events, the 503s of JSON waits) before it cancels the
handlers still running. Each server's own grace period is derived from the drain
timeout and this margin, so that it never cuts the drain short."""

HTTP_CHOICES: Final = ("auto", "h11", "httptools")
"""uvicorn's HTTP/1.1 implementations; ``auto`` is uvicorn's choice (httptools when
installed)."""

LOOP_CHOICES: Final = ("auto", "asyncio", "uvloop")
"""The event loops; ``auto`` is the server's own default: uvloop when installed on
uvicorn, asyncio's loop on aiohttp (which never picks uvloop by itself)."""

_HTTP_NAMES: Final = {"H11Protocol": "h11", "HttpToolsProtocol": "httptools"}


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
    http: str = "auto"
    loop: str = "auto"


def parse(argv: Sequence[str] | None, description: str, *, uvicorn: bool = True) -> Options:
    """Parse the example server's arguments (``--help`` lists them).

    :param uvicorn: the server runs on uvicorn, which takes ``--http`` as well as
        ``--loop``; the aiohttp server takes ``--loop`` only.
    """
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
    add_stack(parser, uvicorn=uvicorn)
    add_scale_out(parser)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.drain_timeout < 0:
        parser.error(f"--drain-timeout must be at least 0, got {args.drain_timeout}")
    for option, package in (("--http", getattr(args, "http", "auto")), ("--loop", args.loop)):
        # A missing package would otherwise be an ImportError traceback at start-up.
        if package not in ("auto", "asyncio", "h11") and importlib.util.find_spec(package) is None:
            parser.error(f"{option} {package} needs the {package} package: pip install {package}")
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
        http=getattr(args, "http", "auto"),
        loop=args.loop,
    )


def add_stack(parser: argparse.ArgumentParser, *, uvicorn: bool) -> None:
    """``--http`` (uvicorn only) and ``--loop``: the server's HTTP parser and event loop."""
    if uvicorn:
        parser.add_argument(
            "--http",
            choices=HTTP_CHOICES,
            default="auto",
            help="uvicorn's HTTP implementation (auto: httptools when installed, else h11)",
        )
    parser.add_argument(
        "--loop",
        choices=LOOP_CHOICES,
        default="auto",
        help="the event loop (auto: uvloop when installed, else asyncio's)"
        if uvicorn
        else "the event loop (auto: asyncio's, aiohttp's own default)",
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


def uvicorn_config(app: Callable[..., Any], options: Options) -> uvicorn.Config:
    """The uvicorn configuration both uvicorn-based examples run with: the stack the
    command line chose, and a grace period that outlasts the drain.

    uvicorn cancels the handlers still running once its grace period
    (``timeout_graceful_shutdown``) is over; it must not cut the drain short, so it is
    the drain timeout plus :data:`SHUTDOWN_MARGIN`.
    """
    import uvicorn  # (imported here: the aiohttp example shares this module)

    return uvicorn.Config(
        app,
        http=options.http,
        loop=options.loop,
        log_level="warning",
        log_config=uvicorn_log_config("warning"),
        # (uvicorn takes whole seconds)
        timeout_graceful_shutdown=math.ceil(options.drain_timeout + SHUTDOWN_MARGIN),
    )


LOG_FORMAT: Final = "%(asctime)s %(name)s: %(message)s"
"""What a log line of an example server says after its level: when, which logger, what."""


def uvicorn_log_config(level: str) -> dict[str, Any]:
    """uvicorn's own logging configuration, plus the ``tether`` loggers on stderr
    through uvicorn's formatter, with their level and name.

    tether configures no logging (a library's records go where the application
    sends them); without this, they would not be shown under uvicorn at all.
    """
    import uvicorn.config

    config: dict[str, Any] = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["formatters"]["tether"] = {
        "()": "uvicorn.logging.DefaultFormatter",
        "fmt": "%(levelprefix)s " + LOG_FORMAT,
    }
    config["handlers"]["tether"] = {
        "class": "logging.StreamHandler",
        "formatter": "tether",
        "stream": "ext://sys.stderr",
    }
    config["loggers"]["tether"] = {
        "handlers": ["tether"],
        "level": level.upper(),
        "propagate": False,
    }
    return config


def configure_logging(level: int) -> None:
    """The aiohttp server's logging: aiohttp configures none either, so every logger
    (``aiohttp.*``, ``tether.*``) goes to one stderr handler, with level and name."""
    logging.basicConfig(level=level, format="%(levelname)s " + LOG_FORMAT)


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop factory for ``--loop`` on a server that starts its own loop
    (``asyncio.Runner(loop_factory=...)``); ``None`` is asyncio's default loop."""
    if choice != "uvloop":
        return None
    import uvloop  # (installed: parse() checked)

    return uvloop.new_event_loop


def announce(framework: str, port: int, *, http: type[object] | None = None) -> None:
    """Print the URL the server listens on (the first line of its output), after the
    stack it really runs on: the running loop's kind and, on uvicorn, the HTTP
    protocol class uvicorn loaded (``config.http_protocol_class``). Tests read it to
    prove that a ``--http`` / ``--loop`` choice took effect, ``auto`` resolved."""
    loop = type(asyncio.get_running_loop()).__module__.partition(".")[0]  # asyncio, uvloop
    stack = f"loop={loop}"
    if http is not None:
        stack = f"http={_HTTP_NAMES.get(http.__name__, http.__name__)}, {stack}"
    print(f"tether example ({framework}: {stack}) listening on http://{HOST}:{port}/", flush=True)
