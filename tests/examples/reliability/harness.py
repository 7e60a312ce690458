"""The example servers in the test's own event loop, with a registry that keeps books.

:class:`Ledger` is the example's registry with an account of every request id:
opened, finished (its last output delivered), failed by the engine, and how many
times ``on_abort`` ran for it. :meth:`Ledger.problems` lists every way that
account breaks DESIGN's invariants 2 and 3 (an entry left behind; an abort
missing, repeated, or for a request that finished or failed).

:func:`running` serves one of the three configurations the suite covers (Starlette
on uvicorn; aiohttp with ``handler_cancellation`` off, its default, and on) on
127.0.0.1 with an ephemeral port, and stops it on exit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final

import aiohttp_app
import api
import pytest
import starlette_app
import uvicorn
from aiohttp import web
from engine import Engine, merge_outputs

import tether
from tests._support.ready_server import ReadyServer
from tests._support.waiting import eventually as eventually

BOUND: Final = 10.0
"""A generous bound on any single wait in the suite."""

SERVERS: Final = ("starlette", "aiohttp", "aiohttp-cancel")
"""Starlette on uvicorn; aiohttp as ``web.run_app`` serves (no handler cancellation);
aiohttp with ``handler_cancellation=True``."""

logger = logging.getLogger("tests.examples.reliability")


class Ledger(tether.Registry):
    """The example's registry (``merge_outputs``, ``on_abort`` = the engine's abort),
    keeping an account of every request id it saw.

    :param engine: the producer; its ``abort`` runs after the account is updated.
    :param on_abort: replaces the engine's abort (fault tests make it raise or hang).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        on_abort: Callable[[str], object] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(self._aborted, merge=merge_outputs, **options)
        self.engine = engine
        self.then: Callable[[str], object] = on_abort or engine.abort
        self.opened: set[str] = set()
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.aborts: collections.Counter[str] = collections.Counter()

    def _aborted(self, rid: str) -> object:
        self.aborts[rid] += 1
        return self.then(rid)

    def open(self, rid: str | None = None, *, timeout: float | None = None) -> tether.Stream:
        stream = super().open(rid, timeout=timeout)
        self.opened.add(stream.rid)
        return stream

    def open_batch(
        self,
        n_or_rids: int | Sequence[str],
        *,
        timeout: float | None = None,
        keep_going: bool = False,
    ) -> tether.Batch:
        batch = super().open_batch(n_or_rids, timeout=timeout, keep_going=keep_going)
        self.opened.update(batch.rids)
        return batch

    def deliver(self, rid: str, output: Any, *, finished: bool = False) -> bool:
        live = super().deliver(rid, output, finished=finished)
        if live and finished:
            self.finished.add(rid)
        return live

    def fail(self, rid: str, exc: BaseException) -> bool:
        live = super().fail(rid, exc)
        if live:
            self.failed.add(rid)
        return live

    def fail_all(self, exc: BaseException) -> int:
        self.failed.update(rid for rid in self.opened if rid in self)
        return super().fail_all(exc)

    def problems(self) -> list[str]:
        """Every broken invariant, one line each (empty when the books balance)."""
        found = []
        if self.in_flight:
            found.append(f"{self.in_flight} requests still in flight")
        for rid in sorted(self.opened):
            ends = (rid in self.finished) + (rid in self.failed) + (self.aborts[rid] > 0)
            if ends != 1 or self.aborts[rid] > 1:
                found.append(
                    f"{rid}: finished={rid in self.finished} failed={rid in self.failed} "
                    f"on_abort x{self.aborts[rid]}"
                )
        strays = self.aborts.keys() - self.opened
        found.extend(f"{rid}: on_abort for a request never opened" for rid in strays)
        return found

    def forget(self) -> None:
        """Clear the account (between soak rounds; nothing may be in flight)."""
        self.opened.clear()
        self.finished.clear()
        self.failed.clear()
        self.aborts.clear()


@dataclasses.dataclass
class Server:
    """One running example server: its base URL, and its service (engine + ledger)."""

    name: str
    url: str
    service: api.Service
    port: int
    tasks: int
    """How many tasks the loop ran once the server was up (the baseline of :meth:`idle`)."""

    @property
    def ledger(self) -> Ledger:
        registry = self.service.registry
        assert isinstance(registry, Ledger)
        return registry

    @property
    def engine(self) -> Engine:
        return self.service.engine

    async def idle(self, *, connections_closed: bool = False) -> None:
        """Wait (bounded) until nothing is in flight in tether or in the engine.

        :param connections_closed: the clients closed every connection: wait too until
            every handler and connection task has ended.
        """
        engine, ledger = self.engine, self.ledger

        def quiet() -> bool:
            stats = engine.stats()
            return (
                ledger.in_flight == 0
                and stats.running == 0
                and stats.waiting == 0
                and (not connections_closed or len(asyncio.all_tasks()) <= self.tasks)
            )

        await eventually(quiet)


def report(config: pytest.Config, line: str) -> None:
    """Print one line of figures on the terminal, past pytest's output capture."""
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        sys.stdout.write(f"\n{line}\n")
        sys.stdout.flush()


def service(
    *,
    fail_fraction: float = 0.0,
    max_batch: int = 256,
    step_interval: float = 0.002,
    seed: int = 0,
    **registry_options: Any,
) -> api.Service:
    """An example service whose registry is a :class:`Ledger`."""
    engine = Engine(
        max_batch=max_batch, step_interval=step_interval, fail_fraction=fail_fraction, seed=seed
    )
    return api.Service(engine, Ledger(engine, **registry_options))


@contextlib.asynccontextmanager
async def running(
    name: str, svc: api.Service, *, drain_timeout: float = 2.0, send_buffer: int | None = None
) -> AsyncIterator[Server]:
    """Serve ``svc`` with the example server ``name`` (one of :data:`SERVERS`).

    On exit the registry is closed (requests still open end after ``drain_timeout``)
    and the server stops, as the example servers do on SIGINT.

    :param send_buffer: the kernel send buffer of every accepted connection, in
        bytes (small, so that a client that reads slowly blocks the server's writes
        soon); the system's default when ``None``.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:
        # Accepted connections inherit the listening socket's buffer sizes (Linux).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if name == "starlette":
        manager = _starlette(svc, sock, drain_timeout)
    else:
        manager = _aiohttp(svc, sock, drain_timeout, cancel=name == "aiohttp-cancel")
    with sock:
        async with manager:
            yield Server(name, f"http://127.0.0.1:{port}", svc, port, len(asyncio.all_tasks()))


@contextlib.asynccontextmanager
async def _starlette(
    svc: api.Service, sock: socket.socket, drain_timeout: float
) -> AsyncIterator[None]:
    app = starlette_app.create_app(svc, drain_timeout=drain_timeout)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on")
    server = ReadyServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="uvicorn")
    try:
        async with asyncio.timeout(BOUND):
            await server.ready.wait()
        assert server.started, "uvicorn did not start"
        yield
    finally:
        # uvicorn waits for open connections before its lifespan shutdown: the drain
        # starts first, as in the example's signal hook (docs/starlette.md).
        drain = asyncio.create_task(svc.registry.close(drain_timeout=drain_timeout))
        server.should_exit = True
        async with asyncio.timeout(BOUND + drain_timeout):
            await asyncio.wait([task, drain])
        await drain
        await task


@contextlib.asynccontextmanager
async def _aiohttp(
    svc: api.Service, sock: socket.socket, drain_timeout: float, *, cancel: bool
) -> AsyncIterator[None]:
    app = aiohttp_app.create_app(svc, drain_timeout=drain_timeout)
    runner = web.AppRunner(app, handler_cancellation=cancel, access_log=None)
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        yield
    finally:
        async with asyncio.timeout(BOUND + drain_timeout):
            await runner.cleanup()
