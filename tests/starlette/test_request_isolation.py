"""Each HTTP request gets its own RequestScope, whatever context its task inherited.

uvicorn starts a connection's next request from inside the previous request's
``send()`` (pipelined requests) or from a reader callback carrying the context of
the request that last read (bodies over 64 KiB): the new task copies a context in
which the previous request's scope is current. :class:`Connection` reproduces that
deterministically with fake requests, independently of uvicorn's internals.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
import tether.http
from tether_starlette import TetherMiddleware

from .conftest import BOUND, Engine, FakeServer, make_app


class Request(FakeServer):
    """One request of a connection: once its response is complete, its ``send()``
    starts the connection's next request before returning, as uvicorn does."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.then: Request | None = None
        self.connection: Connection | None = None

    async def send(self, message: Message) -> None:
        await super().send(message)
        following, connection = self.then, self.connection
        if following is not None and connection is not None and self.complete:
            self.then = None
            connection.start(following)


class Connection:
    """Serves ``requests`` with ``app`` one after the other, each next one started
    from inside the previous one's final ``send()`` in a copy of that moment's
    context; the context manager owns every request's task and awaits them all."""

    def __init__(self, app: ASGIApp, requests: Sequence[Request]) -> None:
        self.app = app
        self.requests = requests
        self.tasks: list[asyncio.Task[None]] = []
        for request, following in itertools.pairwise(requests):
            request.then = following
        for request in requests:
            request.connection = self

    def start(self, request: Request) -> None:
        context = contextvars.copy_context()
        task = asyncio.get_running_loop().create_task(request.run(self.app), context=context)
        self.tasks.append(task)

    async def __aenter__(self) -> Connection:
        self.start(self.requests[0])
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            for task in self.tasks:
                task.cancel()
        async with asyncio.timeout(BOUND):
            while pending := [task for task in self.tasks if not task.done()]:
                await asyncio.wait(pending)
        if exc is None:
            for task in self.tasks:
                task.result()  # a request's failure fails the test


def statuses(*requests: FakeServer) -> list[int]:
    return [
        message["status"]
        for request in requests
        for message in request.sent
        if message["type"] == "http.response.start"
    ]


async def test_a_request_started_inside_the_previous_ones_send_gets_its_own_scope() -> None:
    seen: list[tether.RequestScope | None] = []
    marked: list[tether.RequestScope | None] = []
    registry = tether.Registry()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(tether.http.current_scope())
        marked.append(scope.get("tether.scope"))
        stream = registry.open()
        registry.deliver(stream.rid, b"done", finished=True)
        body = await stream.result()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    requests = [Request(), Request(), Request()]
    async with Connection(TetherMiddleware(app, registry=registry), requests):
        pass

    assert len(seen) == 3
    assert all(scope is not None for scope in seen)
    assert len({id(scope) for scope in seen}) == 3
    assert marked == seen  # the request's own scope is in its ASGI scope too
    assert statuses(*requests) == [200, 200, 200]
    assert registry.stats().aborted == {}
    assert registry.in_flight == 0


@pytest.mark.parametrize("paths", [("/json", "/json"), ("/stream", "/json"), ("/json", "/stream")])
async def test_requests_chained_on_one_connection_are_each_answered_by_their_own_work(
    engine: Engine, paths: tuple[str, str]
) -> None:
    engine.script = None
    first, second = Request(path=paths[0]), Request(path=paths[1])
    async with Connection(make_app(engine), [first, second]):
        await engine.until(lambda: len(engine.submitted) == 1)
        engine.registry.deliver(engine.submitted[0], {"n": 1}, finished=True)
        await engine.until(lambda: len(engine.submitted) == 2)
        engine.registry.deliver(engine.submitted[1], {"n": 2}, finished=True)

    assert statuses(first, second) == [200, 200]
    assert b'{"n":1}' in first.bodies[0][0]
    assert b'{"n":2}' in second.bodies[0][0]
    assert engine.aborted_at == {}
    assert engine.registry.in_flight == 0


async def test_a_tether_error_in_a_chained_request_gets_its_status_and_json_body() -> None:
    engine = Engine(max_in_flight=1)
    held = engine.registry.open()
    first, second = Request(path="/json"), Request(path="/stream")
    try:
        async with Connection(make_app(engine), [first, second]):
            pass
    finally:
        await held.aclose()

    assert statuses(first, second) == [503, 503]
    assert b'"type":"Overloaded"' in second.bodies[0][0]


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"], ids=["asgi-2.3", "asgi-2.4"])
async def test_client_leaving_a_chained_request_aborts_its_work_alone(
    engine: Engine, spec_version: str
) -> None:
    engine.script = None
    first = Request(path="/json", spec_version=spec_version)
    second = Request(path="/json", spec_version=spec_version)
    async with Connection(make_app(engine), [first, second]):
        await engine.until(lambda: len(engine.submitted) == 1)
        engine.registry.deliver(engine.submitted[0], {"n": 1}, finished=True)
        await engine.until(lambda: len(engine.submitted) == 2)
        second.disconnect()
        await engine.until(lambda: len(engine.aborted_at) == 1)

    assert list(engine.aborted_at) == [engine.submitted[1]]
    assert engine.registry.stats().aborted == {"client_disconnected": 1}
    assert engine.registry.in_flight == 0
    assert statuses(first, second) == [200]


async def test_installed_twice_a_chained_request_has_one_scope_and_one_reader(
    engine: Engine,
) -> None:
    engine.script = None
    first, second = Request(path="/json"), Request(path="/json")
    async with Connection(make_app(engine, middleware=2), [first, second]):
        await engine.until(lambda: len(engine.submitted) == 1)
        engine.registry.deliver(engine.submitted[0], {"n": 1}, finished=True)
        await engine.until(lambda: len(engine.submitted) == 2)
        second.disconnect()
        await engine.until(lambda: len(engine.aborted_at) == 1)

    assert second.most_receiving == 1
    assert engine.registry.stats().aborted == {"client_disconnected": 1}
