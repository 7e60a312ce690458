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

A submission is checked at the door, as the HTTP servers check a body: anything but
a text prompt and an integer ``max_tokens`` within the HTTP API's bounds fails that
one request with a clear 422, and whatever else one submission raises fails it
alone. The loop that takes submissions is watched: if it dies, the process exits
loudly (status 1), so every front sees the engine gone (``EngineLost``) instead of
submitting into a loop that nobody runs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import signal
import sys
from collections.abc import Iterable, Sequence
from typing import Any, cast

from api import MAX_BODY_BYTES, MAX_TOKENS
from engine import Engine

import tether
from tether.http import stop_tasks
from tether_zmq import Cancellation, EngineServer, RequestKey, Submission

DEFAULT_ADDRESS = "ipc:///tmp/tether-engine.sock"
DEFAULT_MAX_MESSAGE = 16 * 1024 * 1024

logger = logging.getLogger("tether.examples.engine_server")


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
        "--peer-timeout", type=float, default=1.0, help="seconds of silence that lose a front"
    )
    parser.add_argument(
        "--max-message", type=int, default=DEFAULT_MAX_MESSAGE, help="bytes per frame, both ways"
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
    server = EngineServer(
        args.address, peer_timeout=args.peer_timeout, max_message=args.max_message
    )
    async with server:
        relay = Relay(server)

        def report() -> None:
            stats = {"engine": engine.stats().as_dict(), "link": vars_of(server)}
            print(json.dumps(stats), flush=True)

        loop.add_signal_handler(signal.SIGUSR1, report)
        # The engine takes a registry; the relay has the producer-side calls it makes.
        async with engine.running(cast(tether.Registry, relay)):
            print(f"tether engine listening on {server.address}", flush=True)
            receiving = asyncio.create_task(receive(server, relay, engine), name="receive")
            stopping = asyncio.create_task(stop.wait(), name="stop")
            try:
                # The receiving loop is watched, not just started: its end, whatever
                # the cause, is this process's end.
                await asyncio.wait((receiving, stopping), return_when=asyncio.FIRST_COMPLETED)
            finally:
                await stop_tasks((receiving, stopping))
        report()


def vars_of(server: EngineServer) -> dict[str, Any]:
    stats = server.stats()
    return {name: getattr(stats, name) for name in stats.__slots__}


async def receive(server: EngineServer, relay: Relay, engine: Engine) -> None:
    """Hand each submission to the engine and each cancellation to its ``abort``."""
    while True:
        for event in await server.receive():
            if isinstance(event, Submission):
                local = relay.admit(event.key)
                try:
                    prompt, max_tokens = checked(event.request)
                    engine.submit(local, prompt, max_tokens)
                except BadSubmission as exc:
                    relay.fail(local, exc)
                except Exception as exc:
                    # Whatever one submission triggers is that submission's failure:
                    # never the end of the loop every other request depends on.
                    logger.exception("a submission failed in the engine")
                    relay.fail(local, exc)
            elif isinstance(event, Cancellation):
                running = relay.forget(event.key)
                if running is not None:
                    engine.abort(running)


class BadSubmission(ValueError):
    """A submission the engine cannot run (422 to the client, with this message)."""

    status_code = 422


def checked(request: object) -> tuple[str, int]:
    """The prompt and ``max_tokens`` of a submission, within the HTTP API's bounds.

    Any peer that reaches the socket can send any MessagePack (``inf``, ``true``, a
    huge integer, a map where a string goes): it is refused here, by name.

    :raises BadSubmission: anything else.
    """
    if not isinstance(request, dict):
        raise BadSubmission("a submission is a map with 'prompt' and 'max_tokens'")
    prompt = request.get("prompt")
    max_tokens = request.get("max_tokens")
    if not isinstance(prompt, str):
        raise BadSubmission("'prompt' must be a string")
    if len(prompt.encode("utf-8", "surrogatepass")) > MAX_BODY_BYTES:
        raise BadSubmission(f"'prompt' exceeds {MAX_BODY_BYTES} bytes")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise BadSubmission("'max_tokens' must be an integer")
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise BadSubmission(f"'max_tokens' must be between 1 and {MAX_TOKENS}")
    return prompt, max_tokens


def main(argv: Sequence[str] | None = None) -> None:
    """Serve until SIGINT or SIGTERM (exit code 0); a loop that died exits with 1."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(parse(argv)))
    except Exception:
        logger.exception("the engine stopped: a loop it depends on died")
        raise SystemExit(1) from None


if __name__ == "__main__":
    main(sys.argv[1:])
