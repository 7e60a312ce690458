"""The soak: thousands of requests of every kind on each server, with clients that
leave, deadlines that pass and an engine that fails, then the books are checked.

Sized for CI (about 20 s per server on two cores); run it longer by hand with
``TETHER_SOAK_REQUESTS`` (requests per round, default 1000) and ``TETHER_SOAK_ROUNDS``
(default 2; the memory check compares the last round with the ones before)::

    TETHER_SOAK_REQUESTS=20000 .venv/bin/python -m pytest tests/examples/reliability/test_soak.py -s

Memory: the last round runs under :mod:`tracemalloc`; what it allocated and is
still alive once the round is over, gc run, the ledger cleared, is the growth of
the server (and of the clients, which keep nothing either) over an identical
round. The bound, :data:`GROWTH_BOUND`, leaves room for the statistics rings that
are still filling (the registry's and the engine's timing samples, 4096 floats
each), and no more.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import tracemalloc
from typing import Final

import pytest

import tether
import tether.http
from tether._state import RequestState

from .harness import SERVERS, eventually, report, running, service
from .soak import Figures, reconcile, round_of

REQUESTS: Final = int(os.environ.get("TETHER_SOAK_REQUESTS", "1000"))
ROUNDS: Final = int(os.environ.get("TETHER_SOAK_ROUNDS", "2"))
CONCURRENCY: Final = int(os.environ.get("TETHER_SOAK_CONCURRENCY", "64"))
FAIL_FRACTION: Final = 0.02
"""The share of sub-requests the engine fails on purpose."""
GROWTH_BOUND: Final = 1 << 20
"""Bytes the heap may keep after an identical round (1 MiB)."""

TRACKED: Final = (tether.Stream, tether.Batch, tether.http.Exchange, RequestState)
"""What a leaked request would keep alive. (Not the empty ``RequestScope`` itself:
uvicorn's keep-alive timer, started inside the request's context, holds that
context, and with it the scope, for ``timeout_keep_alive`` seconds.)"""


def live_objects() -> int:
    """How many request states, streams, batches and exchanges are alive now."""
    gc.collect()
    return sum(isinstance(obj, TRACKED) for obj in gc.get_objects())


async def no_more_live_objects_than(before: int) -> int:
    """Wait until at most ``before`` tether objects are alive, and return the count.

    Not always at once: a handler may still be returning when the books balance.
    """
    count = live_objects()
    with contextlib.suppress(TimeoutError):
        await eventually(lambda: live_objects() <= before, timeout=2.0)
        count = live_objects()
    return count


def uvicorn_request_cycles() -> int:
    """uvicorn's per-request objects still alive."""
    return sum(
        1
        for obj in gc.get_objects()
        if type(obj).__name__ == "RequestResponseCycle"
        and type(obj).__module__.startswith("uvicorn.")
    )


async def uvicorn_let_go() -> None:
    """Wait (bounded) until uvicorn dropped its finished requests.

    uvicorn keeps a closed connection's last request (its scope, headers and
    message Event) until that connection's keep-alive timer fires (5 s), which a
    client that reset the connection leaves running. That is uvicorn's, bounded,
    and not what the heap measurement is about.
    """
    with contextlib.suppress(TimeoutError):
        await eventually(lambda: uvicorn_request_cycles() == 0, timeout=10.0)


def heap_growth(snapshot: tracemalloc.Snapshot) -> int:
    """Bytes still allocated from outside the suite's own code (its books and figures)."""
    kept = snapshot.filter_traces(
        [
            tracemalloc.Filter(False, f"*{os.sep}tests{os.sep}e2e{os.sep}*"),
            tracemalloc.Filter(False, tracemalloc.__file__),
        ]
    )
    return sum(stat.size for stat in kept.statistics("filename"))


@pytest.mark.parametrize("name", SERVERS)
async def test_soak_loses_no_output_and_leaks_no_request(
    name: str, request: pytest.FixtureRequest
) -> None:
    svc = service(fail_fraction=FAIL_FRACTION, seed=7)
    totals = Figures()
    growth = objects = 0
    aborts = 0
    started = time.monotonic()
    leaks = lost = 0
    async with running(name, svc) as server:
        try:
            for number in range(1, ROUNDS + 1):
                measured = number == ROUNDS and ROUNDS > 1
                if measured:
                    objects = live_objects()
                    tracemalloc.start()
                figures = await round_of(server.url, REQUESTS, concurrency=CONCURRENCY, seed=1)
                await server.idle(connections_closed=True)
                ledger = server.ledger
                problems = figures.errors + ledger.problems() + reconcile(figures, ledger)
                leaks += ledger.in_flight
                lost += len(figures.errors)
                assert not problems, f"{len(problems)} problems, first ones:\n" + "\n".join(
                    problems[:20]
                )
                aborts += sum(ledger.aborts.values())
                totals.add(figures)
                ledger.forget()
                del figures, ledger
                if measured:
                    await uvicorn_let_go()
                    objects = await no_more_live_objects_than(objects) - objects
                    growth = heap_growth(tracemalloc.take_snapshot())
        finally:
            tracemalloc.stop()
    stats = svc.registry.stats()
    seconds = time.monotonic() - started
    report(
        request.config,
        (
            f"soak[{name}]: {ROUNDS}x{REQUESTS} requests ({totals.sub_requests} sub-requests) "
            f"in {seconds:.1f}s at concurrency {CONCURRENCY}: completed {totals.completed}, "
            f"disconnected {totals.disconnected}, deadline 504 {totals.deadlines}, "
            f"engine failures {totals.engine_failures}; on_abort calls {aborts} "
            f"(registry aborted {dict(stats.aborted)}); tokens verified {totals.tokens}; "
            f"statuses {dict(sorted(totals.statuses.items()))}; "
            f"leaks {leaks}, lost outputs {lost}; "
            f"heap growth over the last round {growth / 1024:.0f} KiB, "
            f"live tether objects {objects:+d}"
        ),
    )
    assert stats.in_flight == 0
    assert totals.disconnected >= REQUESTS * ROUNDS // 8
    assert totals.deadlines > 0
    assert totals.engine_failures > 0
    assert objects <= 0
    assert growth <= GROWTH_BOUND, f"the heap kept {growth} bytes after an identical round"
