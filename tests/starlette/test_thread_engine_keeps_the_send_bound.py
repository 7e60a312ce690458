"""With ``producer_writes``, a ``send`` wrapper's ``asyncio.timeout`` still bounds a
write to a client that reads nothing when the outputs come from an engine thread
(``deliver_many_threadsafe``): the thread's outputs are written by the handler's task,
so the request ends as its client's (gone), well before tether's own bounds."""

from __future__ import annotations

import asyncio
import threading

import tether
from tests._support.aborts import Aborted
from tests._support.stalled import http_get

from .conftest import BOUND, one_stream_app, serve, stalled_request
from .test_send_chain_under_every_producer import PAD, timed_send


async def test_a_middleware_s_send_timeout_cuts_a_stalled_request_fed_by_an_engine_thread() -> None:
    aborted = Aborted()
    registry = tether.Registry(aborted)
    opened: asyncio.Queue[str] = asyncio.Queue()
    # tether's own send timeout far away: the middleware's 0.3 s is what must fire.
    app = timed_send(
        one_stream_app(registry, opened, producer_writes=True, send_timeout=BOUND), 0.3
    )
    async with (
        serve(app, http="httptools") as (url, _),
        stalled_request(url, opened, http_get("/one")) as (_, rid),
    ):
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def engine() -> None:
            step = 0
            while not stop.is_set():
                registry.deliver_many_threadsafe([(rid, {"i": step, "pad": PAD * 4}, False)])
                # the loop took the step in before the next one (a handshake, no sleep)
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(BOUND)
                step += 1
                stop.wait(0.002)  # the engine's pace

        worker = threading.Thread(target=engine)
        worker.start()
        try:
            async with asyncio.timeout(2 * BOUND):
                await aborted.seen.wait()
        finally:
            stop.set()
            await asyncio.to_thread(worker.join, BOUND)
    assert aborted == [rid]
    assert dict(registry.stats().aborted) == {"client_disconnected": 1}
    assert registry.in_flight == 0
