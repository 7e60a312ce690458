"""Many JSON waits on one uvicorn, some clients leaving, some answered: each leaver
aborted exactly once and soon, each other answered with its own result, nothing
left alive once the requests are over (no request's link, no reader, no task), and
nothing in the loop's exception handler, even when ``on_abort`` raises.

Real uvicorn on 127.0.0.1, on asyncio's loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
from typing import Any, Final

import pytest

import tether
from tests._support.raw_http import connection, leave, read_response, request

from .conftest import Engine, make_app, serve

pytestmark = pytest.mark.both_loops

CLIENTS: Final = 60
ABORT_BOUND: Final = 1.0


def _alive(qualname: str) -> int:
    """How many objects of the middleware's class ``qualname`` are alive."""
    gc.collect()
    return sum(
        1
        for thing in gc.get_objects()
        if type(thing).__qualname__ == qualname and type(thing).__module__.startswith("tether")
    )


def _readers_alive() -> int:
    gc.collect()
    return sum(
        1
        for thing in gc.get_objects()
        if asyncio.iscoroutine(thing) and getattr(thing, "__qualname__", "") == "_ServerLink._read"
    )


@pytest.mark.parametrize("raising", [False, True], ids=["on_abort", "on_abort-raises"])
async def test_many_json_waits_some_left_some_answered_each_once_and_nothing_left(
    raising: bool,
) -> None:
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    aborts: collections.Counter[str] = collections.Counter()
    engine: Engine

    def on_abort(rid: str) -> None:
        aborts[rid] += 1
        engine.abort(rid)
        if raising:
            raise RuntimeError("the engine's abort hook failed")

    engine = Engine(tether.Registry(on_abort))
    engine.script = None
    tasks_before = len(asyncio.all_tasks())
    try:
        async with serve(make_app(engine)) as (url, _):
            conns = [connection(url) for _ in range(CLIENTS)]
            pairs = [await conn.__aenter__() for conn in conns]
            for index, (_, writer) in enumerate(pairs):
                body = b"" if index % 3 else b"b" * (index * 100)
                writer.write(request("POST", "/json", body))
            await engine.until(lambda: len(engine.submitted) == CLIENTS)
            by_order = list(engine.submitted)  # (not the connections' order)
            # Every other connection leaves; which rids they carry the test does not know:
            # CLIENTS // 2 requests aborted, each exactly once, the others answered.
            left = [await leave(writer) for _, writer in pairs[::2]]
            await engine.until(lambda: len(engine.aborted_at) >= CLIENTS // 2)
            alive = [rid for rid in by_order if rid not in engine.aborted_at]
            for rid in alive:
                assert engine.registry.deliver(rid, {"rid": rid}, finished=True)
            answers = [await read_response(reader) for reader, _ in pairs[1::2]]
            for conn in conns:
                await conn.__aexit__(None, None, None)
            await engine.until(lambda: engine.registry.in_flight == 0)
    finally:
        await engine.stop()
        loop.set_exception_handler(None)

    assert len(engine.aborted_at) == CLIENTS // 2
    assert set(aborts.values()) == {1}
    assert max(engine.aborted_at.values()) - min(left) < ABORT_BOUND + len(left) * 0.05
    assert sorted(json.loads(body)["rid"] for status, body in answers if status == 200) == sorted(
        alive
    )
    assert engine.registry.stats().aborted == {"client_disconnected": CLIENTS // 2}
    assert unhandled == []
    assert len(asyncio.all_tasks()) <= tasks_before
    assert _alive("_ServerLink") == 0
    assert _readers_alive() == 0


@pytest.mark.parametrize("body", [b"", b"s" * 5000], ids=["no-body", "body"])
async def test_a_json_wait_cut_by_the_servers_graceful_timeout_is_told_503_and_aborted_once(
    body: bytes,
) -> None:
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    engine = Engine()
    engine.script = None
    try:
        async with (
            serve(make_app(engine), timeout_graceful_shutdown=0.2) as (url, server),
            connection(url) as (reader, writer),
        ):
            writer.write(request("POST", "/json", body))
            await engine.until(lambda: len(engine.submitted) == 1)
            server.should_exit = True  # uvicorn waits, then cancels the handler
            status, answer = await read_response(reader)
            await engine.until(lambda: engine.registry.in_flight == 0)
    finally:
        await engine.stop()
        loop.set_exception_handler(None)
    assert status == 503, answer
    assert engine.aborted == engine.submitted
    assert unhandled == []
