"""Writes from the producer's step on a real uvicorn, many clients at once: fast and
slow readers (the sink and the write loop take turns), every producer shape, outputs
of a few bytes to hundreds of KB, non-ASCII text; a client that leaves while a write
begun inside ``deliver()`` waits; an output that cannot be encoded, delivered in the
same step as healthy ones. Every event arrives once, in order; nothing reaches the
loop's exception handler; every request ends once."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import socket
import struct
import warnings
from typing import Any, Final

import pytest
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
from tests._support.aborts import Aborted

from .conftest import BOUND, FakeServer, one_stream_app, serve, stalled_request
from .test_send_chain_under_every_producer import hypercorn_serving

CLIENTS: Final = 24
OUTPUTS: Final = 48
BIG: Final = "y" * 200_000
TEXT: Final = "é✓𝄞 ünïcödé " * 20
PAD: Final = "x" * 2048


def output(client: int, n: int) -> dict[str, Any]:
    text = BIG if n % 17 == 5 else TEXT if n % 5 == 0 else "lorem"
    return {"c": client, "n": n, "t": text}


def app_for(registry: tether.Registry, opened: asyncio.Queue[str], **options: Any) -> Starlette:
    """The one-stream app, its outputs written from the producer's step."""
    return one_stream_app(registry, opened, producer_writes=True, **options)


def get(target: str) -> bytes:
    return f"GET {target} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode()


def dechunk(raw: bytes) -> bytes:
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    body = b""
    while True:
        line, _, rest = rest.partition(b"\r\n")
        size = int(line.split(b";")[0], 16)
        if size == 0:
            return body
        body, rest = body + rest[:size], rest[size + 2 :]


def events(body: bytes) -> list[Any]:
    frames = body.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""], frames[-3:]
    return [json.loads(frame.removeprefix(b"data: ")) for frame in frames[:-2]]


async def client(port: int, index: int, *, slow: bool) -> bytes:
    """One client reading its whole response; a slow one has a tiny receive window
    and reads a little at a time (the server's flow control pauses and resumes)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if slow:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(get(f"/one?rid=c{index}"))
        raw = b""
        while data := await reader.read(1024 if slow else 65536):
            raw += data
            if slow:
                await asyncio.sleep(0.001)  # (a slow reader's pace, not a synchronisation)
        return raw
    finally:
        writer.close()


async def produce(registry: tether.Registry, shape: str, rids: list[str]) -> None:
    clients = [int(rid[1:]) for rid in rids]
    last = OUTPUTS - 1
    if shape == "task":

        async def one(rid: str, index: int) -> None:
            for n in range(OUTPUTS):
                registry.deliver(rid, output(index, n), finished=n == last)
                await asyncio.sleep(0)

        async with asyncio.TaskGroup() as tasks:
            for rid, index in zip(rids, clients, strict=True):
                tasks.create_task(one(rid, index))
        return
    steps = [
        [(rid, output(index, n), n == last) for rid, index in zip(rids, clients, strict=True)]
        for n in range(OUTPUTS)
    ]
    if shape == "step":
        for step in steps:
            registry.deliver_many(step)
            await asyncio.sleep(0)
        return
    loop = asyncio.get_running_loop()

    def engine() -> None:
        for step in steps:
            registry.deliver_many_threadsafe(step)
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(BOUND)

    await asyncio.to_thread(engine)


async def many_fast_and_slow_clients(
    url: str, registry: tether.Registry, opened: asyncio.Queue[str], shape: str
) -> list[bytes]:
    """:data:`CLIENTS` clients at ``url``, every other one slow, fed by ``produce``;
    each one's raw response."""
    port = int(url.rsplit(":", 1)[1])
    async with asyncio.timeout(60):
        readers = [
            asyncio.create_task(client(port, index, slow=index % 2 == 1))
            for index in range(CLIENTS)
        ]
        rids = [await opened.get() for _ in range(CLIENTS)]
        await produce(registry, shape, rids)
        return await asyncio.gather(*readers)


@contextlib.contextmanager
def watched_loop() -> Any:
    """Collects what reaches the loop's exception handler, and the runtime warnings."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: seen.append(context))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield seen
            gc.collect()
        finally:
            loop.set_exception_handler(previous)
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []


@pytest.mark.both_loops
@pytest.mark.parametrize("shape", ["task", "step", "thread"])
async def test_many_fast_and_slow_clients_get_every_event_once_in_order(shape: str) -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append, max_pending=100_000, max_pending_bytes=None)
    opened: asyncio.Queue[str] = asyncio.Queue()
    with watched_loop() as seen:
        async with serve(app_for(registry, opened), http="httptools") as (url, _):
            raws = await many_fast_and_slow_clients(url, registry, opened, shape)
    for index, raw in enumerate(raws):
        assert events(dechunk(raw)) == [output(index, n) for n in range(OUTPUTS)], index
    assert seen == []
    assert aborted == []
    assert registry.in_flight == 0
    stats = registry.stats()
    assert stats.opened == stats.finished == CLIENTS


class Pending:
    """Pure ASGI, outside the app: how many body sends are under way right now."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.now = 0
        self.changed = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watched(message: Message) -> None:
            self.now += 1
            self.changed.set()
            try:
                await send(message)
            finally:
                self.now -= 1
                self.changed.set()

        await self.app(scope, receive, watched)

    async def until_idle(self) -> None:
        """Wait until no body send is under way."""
        while self.now:
            self.changed.clear()
            await self.changed.wait()


@pytest.mark.both_loops
@pytest.mark.parametrize("shape", ["task", "thread"])
async def test_a_client_that_leaves_while_a_write_begun_in_deliver_waits_is_aborted_at_once(
    shape: str,
) -> None:
    aborted = Aborted()
    gone = aborted.seen
    registry = tether.Registry(aborted, max_pending=100_000, max_pending_bytes=None)
    opened: asyncio.Queue[str] = asyncio.Queue()
    pending = Pending(app_for(registry, opened))
    loop = asyncio.get_running_loop()
    with watched_loop() as seen:
        async with (
            serve(pending, http="httptools") as (url, _),
            stalled_request(url, opened, get("/one")) as (sock, rid),
        ):
            async with asyncio.timeout(BOUND):
                await deliver_until_a_send_stays_under_way(registry, rid, shape, pending)
            # The client resets its connection (SO_LINGER 0): gone, mid-write.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            left = loop.time()
            sock.close()
            try:
                async with asyncio.timeout(2):
                    await gone.wait()
            except TimeoutError:
                pytest.fail("the client left 2 s ago and its request is still in flight")
            took = loop.time() - left
            assert registry.deliver(rid, {"late": True}) is False
            async with asyncio.timeout(BOUND):
                await pending.until_idle()
    assert took < 2
    assert aborted == [rid]
    assert registry.in_flight == 0
    assert registry.stats().aborted == {"client_disconnected": 1}
    assert seen == []


@pytest.mark.parametrize("shape", ["step", "thread"])
async def test_an_unencodable_output_fails_its_request_alone_in_a_shared_step(shape: str) -> None:
    registry = tether.Registry(max_pending=100_000)
    opened: asyncio.Queue[str] = asyncio.Queue()
    with watched_loop() as seen:
        async with serve(app_for(registry, opened), http="httptools") as (url, _):
            port = int(url.rsplit(":", 1)[1])
            async with asyncio.timeout(BOUND):
                readers = [asyncio.create_task(client(port, i, slow=False)) for i in range(3)]
                rids = sorted([await opened.get() for _ in range(3)])
                loop = asyncio.get_running_loop()
                for n in range(20):
                    step = [
                        (
                            rid,
                            {"n": n, "t": "\ud800" if (rid == "c1" and n == 7) else "ok"},
                            n == 19,
                        )
                        for rid in rids
                    ]
                    if shape == "step":
                        registry.deliver_many(step)
                        await asyncio.sleep(0)
                    else:

                        def handover(step: list[tuple[str, Any, bool]] = step) -> None:
                            registry.deliver_many_threadsafe(step)
                            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(BOUND)

                        await asyncio.to_thread(handover)
                raws = await asyncio.gather(*readers)
    for index, raw in enumerate(raws):
        got = events(dechunk(raw))
        if index == 1:
            assert got[:7] == [{"n": n, "t": "ok"} for n in range(7)]
            assert list(got[7]) == ["error"]  # one error event, then the end
            assert len(got) == 8
        else:
            assert got == [{"n": n, "t": "ok"} for n in range(20)]
    assert seen == []
    assert registry.in_flight == 0


async def test_on_asgi_2_4_a_gone_client_in_a_step_whose_on_abort_reenters_ends_each_once() -> None:
    """deliver_many for three requests; the first one's send finds its client gone
    (OSError), and its ``on_abort`` (soon after the step, never inside it) delivers to
    the second and aborts the third. The step goes on; every request ends once."""
    ended: list[str] = []
    registry: tether.Registry
    told = asyncio.Event()

    def on_abort(rid: str) -> None:
        ended.append(rid)
        if rid == "a":
            registry.deliver("b", {"from": "on_abort"})
            registry.abort("c")
            told.set()

    registry = tether.Registry(on_abort)
    opened: asyncio.Queue[str] = asyncio.Queue()
    app = app_for(registry, opened)
    servers = {
        rid: FakeServer(spec_version="2.4", path="/one", query=f"rid={rid}") for rid in "abc"
    }
    with watched_loop() as seen:
        async with asyncio.TaskGroup() as tasks:
            for server in servers.values():
                tasks.create_task(server.run(app))
            assert sorted([await opened.get() for _ in range(3)]) == ["a", "b", "c"]
            registry.deliver_many([(rid, {"n": 0}, False) for rid in "abc"])
            for server in servers.values():
                await server.until(lambda server=server: len(server.bodies) >= 1)  # type: ignore[misc]
            servers["a"].disconnect(tell_receive=False)  # only its send finds out
            live = registry.deliver_many([(rid, {"n": 1}, False) for rid in "abc"])
            assert live == 3  # (a's on_abort did not run inside the step)
            await told.wait()
            registry.deliver_many([(rid, {"n": 2}, True) for rid in "abc"])
    assert sorted(ended) == ["a", "c"]
    assert ended.count("a") == 1
    got_b = b"".join(body for body, _ in servers["b"].bodies)
    assert events(got_b) == [{"n": 0}, {"n": 1}, {"from": "on_abort"}, {"n": 2}] or events(
        got_b
    ) == [{"n": 0}, {"from": "on_abort"}, {"n": 1}, {"n": 2}]
    stats = registry.stats()
    assert stats.opened == stats.finished + sum(stats.aborted.values()) + stats.failed
    assert registry.in_flight == 0
    assert seen == []


class Handlers(Pending):
    """:class:`Pending`, that also keeps the server's task for each request (the one
    a server cancels at a forced shutdown)."""

    def __init__(self, app: ASGIApp) -> None:
        super().__init__(app)
        self.tasks: list[asyncio.Task[Any]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            task = asyncio.current_task()
            assert task is not None
            self.tasks.append(task)
        await super().__call__(scope, receive, send)


@pytest.mark.both_loops
@pytest.mark.parametrize("shape", ["task", "thread"])
async def test_a_server_that_cuts_a_write_begun_in_deliver_ends_the_stream_with_it_once(
    shape: str,
) -> None:
    """The server cancels the handler (its shutdown's grace ran out) while a write begun
    inside ``deliver()`` waits for flow control: the client, reading again, gets every
    event once, in order, then one error event and the terminal frame."""
    aborted: list[str] = []
    registry = tether.Registry(aborted.append, max_pending=100_000, max_pending_bytes=None)
    opened: asyncio.Queue[str] = asyncio.Queue()
    handlers = Handlers(app_for(registry, opened))
    with watched_loop() as seen:
        async with (
            serve(handlers, http="httptools") as (url, _),
            stalled_request(url, opened, get("/one")) as (sock, rid),
        ):
            async with asyncio.timeout(BOUND):
                delivered = await deliver_until_a_send_stays_under_way(
                    registry, rid, shape, handlers
                )
                await asyncio.sleep(0)  # (the handler takes the begun write over)
                (task,) = handlers.tasks
                task.cancel()  # the server's forced shutdown
                reader, writer = await asyncio.open_connection(sock=sock)  # reads now
                raw = await reader.read()  # (uvicorn closes an unfinished response)
                writer.close()
                await asyncio.wait((task,))
    frames = dechunk(raw + b"0\r\n\r\n" if not raw.endswith(b"0\r\n\r\n") else raw).split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""], frames[-3:]
    assert frames[-3].startswith(b'data: {"error":'), frames[-3][:200]
    indices = [json.loads(frame.removeprefix(b"data: "))["i"] for frame in frames[:-3]]
    assert indices == list(range(delivered))
    assert aborted == [rid]
    assert registry.in_flight == 0
    assert seen == []


async def deliver_from(
    shape: str, registry: tether.Registry, rid: str, output: Any, finished: bool = False
) -> None:
    """Deliver one output from a task (then the engine's step ends), or from an engine
    thread (``shape``)."""
    if shape == "task":
        registry.deliver(rid, output, finished=finished)
        await asyncio.sleep(0)  # (the engine's step)
    else:
        await asyncio.to_thread(registry.deliver_many_threadsafe, [(rid, output, finished)])


async def deliver_until_a_send_stays_under_way(
    registry: tether.Registry, rid: str, shape: str, pending: Pending
) -> int:
    """Deliver 2 KiB outputs (``shape``: from a task, or from an engine thread) to a
    client that reads nothing, until one's send waits for flow control; how many."""
    for n in itertools.count():
        await deliver_from(shape, registry, rid, {"i": n, "pad": PAD})
        if pending.now:
            return n + 1
    raise AssertionError("unreachable")


@pytest.mark.both_loops
@pytest.mark.parametrize("shape", ["task", "thread"])
async def test_the_send_timeout_ends_a_write_begun_in_deliver_under_every_shape(shape: str) -> None:
    aborted = Aborted()
    gone = aborted.seen
    registry = tether.Registry(aborted, max_pending=100_000, max_pending_bytes=None)
    opened: asyncio.Queue[str] = asyncio.Queue()
    pending = Pending(app_for(registry, opened, send_timeout=0.3))
    with watched_loop() as seen:
        async with (
            serve(pending, http="httptools") as (url, _),
            stalled_request(url, opened, get("/one")) as (_, rid),
        ):
            async with asyncio.timeout(BOUND):
                await deliver_until_a_send_stays_under_way(registry, rid, shape, pending)
                await gone.wait()  # the client counts as gone
                await pending.until_idle()
    assert aborted == [rid]
    assert registry.stats().aborted == {"client_disconnected": 1}
    assert registry.in_flight == 0
    assert seen == []


@pytest.mark.both_loops
@pytest.mark.parametrize("shape", ["task", "thread"])
async def test_a_client_that_leaves_while_the_handler_is_parked_is_aborted_at_once(
    shape: str,
) -> None:
    aborted = Aborted()
    gone = aborted.seen
    registry = tether.Registry(aborted)
    opened: asyncio.Queue[str] = asyncio.Queue()
    with watched_loop() as seen:
        async with serve(app_for(registry, opened), http="httptools") as (url, _):
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            async with asyncio.timeout(BOUND):
                writer.write(get("/one"))
                rid = await opened.get()
                for n in range(10):  # written inside deliver(), the handler parked
                    await deliver_from(shape, registry, rid, {"n": n})
                    await reader.readuntil(b"\n\n")
            writer.close()
            try:
                async with asyncio.timeout(2):
                    await gone.wait()
            except TimeoutError:
                pytest.fail("the client left 2 s ago and its request is still in flight")
    assert aborted == [rid]
    assert registry.in_flight == 0
    assert seen == []


@pytest.mark.both_loops
@pytest.mark.parametrize("shape", ["task", "thread"])
async def test_outputs_of_megabytes_of_non_ascii_text_arrive_whole_in_order(shape: str) -> None:
    registry = tether.Registry(max_pending=100_000, max_pending_bytes=None)
    opened: asyncio.Queue[str] = asyncio.Queue()
    huge = [{"n": n, "t": ("é✓𝄞" * 400_000)[n:]} for n in range(6)]  # ~4 MB of UTF-8 each
    with watched_loop() as seen:
        async with serve(app_for(registry, opened), http="httptools") as (url, _):
            port = int(url.rsplit(":", 1)[1])
            async with asyncio.timeout(60):
                reading = asyncio.create_task(client(port, 0, slow=False))
                rid = await opened.get()
                for n, item in enumerate(huge):
                    await deliver_from(shape, registry, rid, item, finished=n == len(huge) - 1)
                raw = await reading
    assert events(dechunk(raw)) == huge
    assert registry.in_flight == 0
    assert seen == []


@pytest.mark.parametrize("shape", ["task", "step", "thread"])
async def test_on_hypercorn_many_fast_and_slow_clients_get_every_event_once_in_order(
    shape: str,
) -> None:
    registry = tether.Registry(max_pending=100_000, max_pending_bytes=None)
    opened: asyncio.Queue[str] = asyncio.Queue()
    with watched_loop() as seen:
        async with hypercorn_serving(app_for(registry, opened)) as url:
            raws = await many_fast_and_slow_clients(url, registry, opened, shape)
    for index, raw in enumerate(raws):
        assert events(dechunk(raw)) == [output(index, n) for n in range(OUTPUTS)], index
    assert seen == []
    assert registry.in_flight == 0


async def test_a_write_begun_in_deliver_and_cut_gives_back_what_its_send_chain_held() -> None:
    """A middleware bounds concurrent writes with a shared ``asyncio.Semaphore`` (a
    write limiter; hypercorn's HTTP/2 send lock works the same way). A write begun
    inside ``deliver()`` waits for a permit; the permit is handed to it just as the
    server cuts the handler. The cut write must give the permit back (as a cancelled
    ``acquire()`` does): else every later write through the middleware waits forever."""
    permits = asyncio.Semaphore(1)

    def limited(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            async def send_limited(message: Message) -> None:
                async with permits:
                    await send(message)

            await app(scope, receive, send_limited)

        return wrapped

    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    server = FakeServer(path="/one")
    with watched_loop() as seen:
        task = asyncio.create_task(server.run(limited(app_for(registry, opened))))
        async with asyncio.timeout(BOUND):
            rid = await opened.get()
            registry.deliver(rid, {"n": 1})
            await server.until(lambda: len(server.bodies) == 1)
            registry.deliver(rid, {"n": 2})  # (written inside deliver(): the handler parks)
            await server.until(lambda: len(server.bodies) == 2)
            await permits.acquire()  # another request's write holds the permit
            registry.deliver(rid, {"n": 3})  # its send waits for the permit (inside deliver())
            permits.release()  # the permit goes to that send...
            task.cancel()  # ...as the server cuts the handler (its shutdown)
            await asyncio.wait((task,))
    assert task.cancelled()
    assert not permits.locked(), "the cut write kept the permit: every later write hangs"
    assert registry.in_flight == 0
    assert seen == []
