"""Example: the simulated batching engine in its own process, serving front workers over ZeroMQ.

The engine of ``engine.py`` runs here unchanged; where it would deliver into a
``tether.Registry`` it delivers into a :class:`Relay`, which sends each step to the
fronts through ``tether_zmq.EngineServer`` (one message per step per front). Each
request gets a local id in this process; the relay keeps the route from that id
to ``(front, rid)`` as state, so two fronts' equal rids never meet, and nothing is
ever parsed out of an id. A front that dies or hangs has its requests aborted in
the engine once each (the relay hears of it as a ``Cancellation``).

Run it, then point the example servers at it::

    python examples/engine_server.py --address ipc:///tmp/tether-engine.sock
    python examples/starlette_app.py --engine ipc:///tmp/tether-engine.sock --workers 2
    curl -N 127.0.0.1:8000/generate -d '{"text": "hi", "max_tokens": 8, "stream": true}'

It prints ``tether engine listening on ADDRESS`` once bound, a JSON line of its
counters on SIGUSR1, and stops on SIGINT or SIGTERM. Only local addresses
(``ipc://``, ``tcp://127.0.0.1:...``): see ``docs/zmq.md`` for CURVE keys.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import signal
import sys
from collections.abc import Iterable, Sequence
from typing import Any, cast

import cli
from engine import Engine

import tether
from tether_zmq import Cancellation, EngineServer, RequestKey, Submission

DEFAULT_ADDRESS = "ipc:///tmp/tether-engine.sock"


class Relay:
    """Stands where the engine expects its registry: routes each step to its fronts.

    Only the producer-side calls the engine makes (``deliver_many``, ``fail``,
    ``fail_all``) exist here.
    """

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self._ids = (str(n) for n in itertools.count(1))
        self._routes: dict[str, RequestKey] = {}
        self._local: dict[RequestKey, str] = {}

    def admit(self, key: RequestKey) -> str:
        """A fresh local id for ``key``, remembered until the request ends."""
        local = next(self._ids)
        self._routes[local] = key
        self._local[key] = local
        return local

    def forget(self, key: RequestKey) -> str | None:
        """Drop ``key``'s route; its local id, if it was still running."""
        local = self._local.pop(key, None)
        if local is not None:
            del self._routes[local]
        return local

    def deliver_many(self, items: Iterable[tuple[str, Any, bool]]) -> int:
        outputs = []
        for local, output, finished in items:
            key = self._routes.get(local)
            if key is None:
                continue
            if finished:
                self.forget(key)
            output["meta_info"]["id"] = key.rid  # the client knows its rid, not our local id
            outputs.append((key, output, finished))
        self.server.send(outputs)
        return len(outputs)

    def fail(self, local: str, exc: BaseException) -> bool:
        key = self._routes.get(local)
        if key is None:
            return False
        self.forget(key)
        self.server.send(failures=[(key, exc)])
        return True

    def fail_all(self, exc: BaseException) -> int:
        keys = list(self._local)
        self._routes.clear()
        self._local.clear()
        self.server.send(failures=[(key, exc) for key in keys])
        return len(keys)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="the simulated engine, served over ZeroMQ")
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="ipc:// or tcp://127.0.0.1")
    parser.add_argument("--max-batch", type=int, default=64, help="engine batch slots")
    parser.add_argument("--step-ms", type=float, default=5.0, help="engine step interval, ms")
    parser.add_argument(
        "--fail-fraction", type=float, default=0.0, help="share of requests the engine fails"
    )
    parser.add_argument(
        "--peer-timeout", type=float, default=0.2, help="seconds of silence that lose a front"
    )
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    engine = Engine(
        max_batch=args.max_batch,
        step_interval=args.step_ms / 1000,
        fail_fraction=args.fail_fraction,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with EngineServer(args.address, peer_timeout=args.peer_timeout) as server:
        relay = Relay(server)

        def report() -> None:
            stats = {"engine": engine.stats().as_dict(), "link": vars_of(server)}
            print(json.dumps(stats), flush=True)

        loop.add_signal_handler(signal.SIGUSR1, report)
        # The engine takes a registry; the relay has the producer-side calls it makes.
        async with engine.running(cast(tether.Registry, relay)):
            print(f"tether engine listening on {server.address}", flush=True)
            receiving = asyncio.create_task(receive(server, relay, engine))
            try:
                await stop.wait()
            finally:
                receiving.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await receiving
        report()


def vars_of(server: EngineServer) -> dict[str, Any]:
    stats = server.stats()
    return {name: getattr(stats, name) for name in stats.__slots__}


async def receive(server: EngineServer, relay: Relay, engine: Engine) -> None:
    """Hand each submission to the engine and each cancellation to its ``abort``."""
    while True:
        for event in await server.receive():
            if isinstance(event, Submission):
                request = event.request
                local = relay.admit(event.key)
                try:
                    engine.submit(local, str(request["prompt"]), int(request["max_tokens"]))
                except (KeyError, TypeError, ValueError) as exc:
                    relay.fail(local, BadSubmission(f"malformed submission: {exc}"))
            elif isinstance(event, Cancellation):
                running = relay.forget(event.key)
                if running is not None:
                    engine.abort(running)


class BadSubmission(ValueError):
    """A submission without a prompt and a positive ``max_tokens`` (400 to the client)."""

    status_code = 400


def main(argv: Sequence[str] | None = None) -> None:
    """Serve until SIGINT or SIGTERM (exit code 0)."""
    options = parse(argv)
    cli.configure_logging(logging.WARNING)  # tether's records, with level and logger
    asyncio.run(serve(options))


if __name__ == "__main__":
    main(sys.argv[1:])
