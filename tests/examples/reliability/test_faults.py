"""Faults on every server: the engine crashes, ``on_abort`` raises or hangs, a reader
falls behind, the server shuts down with streams open. Nothing hangs, nothing leaks.

(The stalled client, ended by the send timeout, is proven at the adapters, with a
small timeout: ``tests/starlette/test_send_timeout.py``, ``tests/aiohttp/test_send_timeout.py``.)
"""

from __future__ import annotations

import asyncio
import logging
import tracemalloc
from typing import Any, Final

import aiohttp
import pytest
from engine import expected_text

from tests._support.stalled import stalled_client

from .client import events, http_post, long_stream, outcome, sse_payloads
from .harness import BOUND, SERVERS, eventually, report, running, service

pytestmark = pytest.mark.parametrize("name", SERVERS)

PROMPTLY: Final = 5.0
"""A bound on "at once" generous enough for a loaded two-core CI machine."""


def error_code(status: int, got: list[Any]) -> int:
    """The error a request ended with: its status with a JSON error body, or the
    error event (then ``[DONE]``) of a stream that had started."""
    if status == 200:
        assert got[-1] == "[DONE]"
        return int(got[-2]["error"]["code"])
    assert got[0]["error"]["code"] == status
    return status


async def first_event(response: aiohttp.ClientResponse) -> None:
    assert response.status == 200
    await anext(events(response))


async def test_an_engine_crash_fails_every_request_in_flight_and_503s_until_it_recovers(
    name: str,
) -> None:
    async with running(name, service(step_interval=0.001)) as server:
        engine, ledger = server.engine, server.ledger
        async with aiohttp.ClientSession(server.url) as http:
            streams = [asyncio.create_task(outcome(http, long_stream(f"s{i}"))) for i in range(4)]
            batch = {"text": ["b0", "b1"], "max_tokens": 4000}
            answers = [asyncio.create_task(outcome(http, batch)) for _ in range(2)]
            await eventually(lambda: engine.stats().running == 8)
            engine.crash()
            async with asyncio.timeout(PROMPTLY):
                results = await asyncio.gather(*streams, *answers)
            for status, got in results:
                assert error_code(status, got) == 503  # the engine's EngineUnavailable
            assert ledger.in_flight == 0
            for _ in range(3):  # refused at once while the engine is down
                status, got = await outcome(http, {"text": "x", "max_tokens": 2})
                assert (status, got[0]["error"]["code"]) == (503, 503)
            async with http.get("/health") as health:
                assert health.status == 503
            engine.recover()
            status, got = await outcome(http, {"text": "back", "max_tokens": 3})
            assert (status, got[0]["text"]) == (200, expected_text("back", 3))
        await server.idle()
        assert not ledger.problems()
        assert len(ledger.failed) == 8 + 3
        assert sum(ledger.aborts.values()) == 0


async def test_an_on_abort_that_raises_is_logged_and_breaks_nothing(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(rid: str) -> None:
        raise RuntimeError("the abort hook broke")

    caplog.set_level(logging.ERROR, logger="tether")
    svc = service(step_interval=0.001, on_abort=broken)
    async with running(name, svc) as server:
        ledger = server.ledger
        async with aiohttp.ClientSession(server.url) as http:
            for i in range(3):
                body = {"text": f"left {i}", "max_tokens": 300, "stream": True}
                async with http.post("/generate", json=body) as response:
                    await first_event(response)
            status, got = await outcome(http, {"text": "after", "max_tokens": 5})
            assert (status, got[0]["text"]) == (200, expected_text("after", 5))
        # The engine was never told: it runs the abandoned work out, and the
        # registry counts what it delivers as late outputs.
        await server.idle()
        assert not ledger.problems()
        assert sum(ledger.aborts.values()) == 3
        assert ledger.stats().late_outputs > 0
    raised = [
        r for r in caplog.records if "on_abort" in r.getMessage() and "raised" in r.getMessage()
    ]
    assert len(raised) == 3


async def test_an_on_abort_that_hangs_is_bounded_and_blocks_no_request(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    never = asyncio.Event()

    async def hanging(rid: str) -> None:
        await never.wait()

    caplog.set_level(logging.ERROR, logger="tether")
    abort_timeout = 1.5
    svc = service(step_interval=0.001, on_abort=hanging, abort_timeout=abort_timeout)
    async with running(name, svc) as server:
        ledger = server.ledger
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(server.url) as http:
            body = {"text": "left", "max_tokens": 300, "stream": True}
            async with http.post("/generate", json=body) as response:
                await first_event(response)
            left = loop.time()
            # The request is freed, and others are served, while on_abort still hangs.
            await eventually(lambda: ledger.in_flight == 0, timeout=PROMPTLY)
            status, got = await outcome(http, {"text": "after", "max_tokens": 5})
            assert (status, got[0]["text"]) == (200, expected_text("after", 5))
            served = loop.time() - left
        await server.idle()

        def abandoned() -> bool:
            return any("longer than" in r.getMessage() for r in caplog.records)

        await eventually(abandoned, timeout=abort_timeout + BOUND)
    assert served < abort_timeout  # nothing waited for the hanging on_abort
    assert list(ledger.aborts.values()) == [1]
    assert not ledger.problems()


async def test_a_slow_reader_costs_one_merged_output_and_gets_every_token(
    name: str, request: pytest.FixtureRequest
) -> None:
    tokens = 3000
    body = {"text": "slow", "max_tokens": tokens, "stream": True, "rid": "slow"}
    loop = asyncio.get_running_loop()
    svc = service(step_interval=0.0005)
    # Small kernel buffers on both ends: the server's writes block after ~100 KB,
    # long before the ~330 KB of events this request makes.
    async with running(name, svc, send_buffer=4096) as server:
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            async with stalled_client(server.port, http_post("/generate", body)) as sock:
                await eventually(lambda: "slow" in server.ledger.finished, timeout=BOUND * 2)
                _, peak = tracemalloc.get_traced_memory()
                received = b""
                async with asyncio.timeout(BOUND):
                    while not received.endswith(b"0\r\n\r\n"):
                        chunk = await loop.sock_recv(sock, 1 << 16)
                        assert chunk, "the server closed the stream early"
                        received += chunk
        finally:
            tracemalloc.stop()
        await server.idle()
        assert not server.ledger.problems()
    payloads = sse_payloads(received)
    assert payloads[-1] == "[DONE]"
    outputs = payloads[:-1]
    assert "".join(output["text"] for output in outputs) == expected_text("slow", tokens)
    # Merged while the reader was behind: far fewer events than tokens...
    assert len(outputs) < tokens * 3 // 4
    # ...and the server held one growing output, not thousands of queued ones (each
    # about 0.5 KB as a dict; 3000 of them would be 1.5 MB).
    held = peak - base
    report(
        request.config,
        f"slow reader[{name}]: {tokens} tokens reached it in {len(outputs)} events; "
        f"heap peak while it lagged {held / 1024:.0f} KiB",
    )
    assert held < 512 * 1024, f"{held // 1024} KiB while the reader lagged"


async def test_shutdown_with_open_streams_ends_them_and_the_server_exits_promptly(
    name: str,
) -> None:
    drain_timeout = 0.5
    loop = asyncio.get_running_loop()
    svc = service(step_interval=0.001)
    async with aiohttp.ClientSession() as http:  # outlives the server
        async with running(name, svc, drain_timeout=drain_timeout) as server:
            requests = [long_stream(f"open {i}") for i in range(3)]
            requests.append({"text": ["j0", "j1"], "max_tokens": 4000})
            clients = [
                asyncio.create_task(outcome(http, body, base=server.url)) for body in requests
            ]
            await eventually(lambda: server.engine.stats().running == 5)
            stopping = loop.time()
        stopped = loop.time() - stopping
        async with asyncio.timeout(PROMPTLY):
            results = await asyncio.gather(*clients)
    assert stopped < drain_timeout + PROMPTLY
    for status, got in results:
        assert error_code(status, got) == 503  # Aborted by the server
    ledger = server.ledger
    assert not ledger.problems()
    assert sum(ledger.aborts.values()) == 5
    assert ledger.stats().aborted == {"server": 5}
