"""The fault-injection scene of resumption through Redis: three front worker processes
share one ``redis-server``; clients open resumable streams in bursts, drop and resume
on another worker, race two reconnects, stop, or abandon their stream, while Redis is
paused for 2 s and then restarted empty. Every client ends with its whole answer or a
clear error; afterwards no request is in flight on any worker, ``on_abort`` ran once
per abandoned request, and no output reached another request's client.

The figures it prints (``scene:``) are the ones in ``docs/resume.md``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import random
import time
from typing import Any, Final

import aiohttp
import pytest

from tests._support.redis_server import RedisProcess, redis_process
from tether.resume import TOKEN_HEADER

from .conftest import Reader
from .fronts import front, until

pytestmark = pytest.mark.timeout(120)

COUNT: Final = 300
"""Outputs per stream, one every 20 ms: each stream runs about 6 s."""
BURST: Final = 15
"""Streams opened at once on one worker, in each of three bursts."""
KINDS: Final = ("drop", "drop", "race", "reader", "drop", "abandon", "stop", "drop")
"""What each client does, in turn."""
RETRY: Final = 0.1
"""Seconds a client waits after a 503 (it scales down the server's Retry-After)."""
PATIENCE: Final = 15.0
"""Seconds a client keeps retrying 503s before it reports the error."""


@dataclasses.dataclass
class Tally:
    """What the clients saw."""

    whole: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)
    wrong: list[str] = dataclasses.field(default_factory=list)
    unavailable: int = 0
    not_found: int = 0
    slowest_503: float = 0.0
    slowest_head: float = 0.0
    slowest_open: float = 0.0
    answered: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    """(when, status) of every reconnect."""
    intended: set[str] = dataclasses.field(default_factory=set)
    """Tags of the streams the clients abandoned or stopped (each must be aborted)."""
    completed: set[str] = dataclasses.field(default_factory=set)


class Client:
    """One scene client: reads its stream from several workers, checking every output
    (its own tag, in order, exactly once)."""

    def __init__(self, session: aiohttp.ClientSession, fronts: list[str], tag: str, tally: Tally):
        self.session = session
        self.fronts = fronts
        self.tag = tag
        self.tally = tally
        self.got = 0  # outputs received in order
        self.last_id: str | None = None
        self.token: str | None = None
        self.random = random.Random(tag)

    def check(self, data: Any, event_id: str | None, position: int, where: str) -> bool:
        """Whether ``data`` is this stream's output number ``position`` (and its event
        id says so: a reconnect from that id resumes right after it)."""
        if not isinstance(data, dict) or data.get("tag") != self.tag:
            self.tally.wrong.append(f"{self.tag}: {data!r} is not its own ({where})")
            return False
        if data.get("n") != position or event_id != f"{self.token}.{position + 1}":
            self.tally.wrong.append(
                f"{self.tag}: output {data.get('n')} (id {event_id}) at {position} ({where})"
            )
            return False
        return True

    async def read(
        self, reader: Reader, start: int, stop: int | None
    ) -> tuple[int, str, str | None]:
        """Read events from output ``start`` on (the one after ``self.last_id``), up to
        ``stop`` outputs; the position reached, how it ended (``done``, ``stop``,
        ``cut``: no terminal frame, ``retry``: a 503 error event, or ``error: ...``)
        and the id of the event at that position (where to resume from: two racing
        reads each have their own)."""
        position, last_id = start, self.last_id
        where = str(reader.response.url.origin())
        while True:
            try:
                event = await reader.next()
            except (aiohttp.ClientError, TimeoutError):
                return position, "cut", last_id
            if event is None:
                return position, "cut", last_id
            if event.data == "[DONE]":
                return position, "done", last_id
            if event.event == "error" or (isinstance(event.data, dict) and "error" in event.data):
                error = event.data["error"]
                rest = await reader.rest()
                assert rest in ([], ["[DONE]"]), rest
                if error.get("code") == 499:  # replaced: a newer reconnect took it over
                    return position, "cut", last_id
                how = "retry" if error.get("code") == 503 else f"error: {error}"
                return position, how, last_id
            if not self.check(event.data, event.id, position, where):
                return position, "error: wrong data", last_id
            position += 1
            last_id = event.id
            if stop is not None and position >= stop:
                return position, "stop", last_id

    async def get(
        self, url: str, headers: dict[str, str], *, opening: bool = False
    ) -> aiohttp.ClientResponse | str:
        """GET, retrying 503s; the response (200) or why not."""
        deadline = time.monotonic() + PATIENCE
        while True:
            started = time.monotonic()
            try:
                response = await self.session.get(url, headers=headers)
            except (aiohttp.ClientError, TimeoutError) as exc:
                return f"error: {exc!r}"
            took = time.monotonic() - started
            self.tally.answered.append((time.monotonic(), response.status))
            if response.status == 200:
                if opening:
                    self.tally.slowest_open = max(self.tally.slowest_open, took)
                else:
                    self.tally.slowest_head = max(self.tally.slowest_head, took)
                return response
            body = await response.text()
            response.close()
            if response.status != 503:
                self.tally.not_found += response.status == 404
                return f"error: {response.status} {body}"
            self.tally.unavailable += 1
            self.tally.slowest_503 = max(self.tally.slowest_503, took)
            assert response.headers.get("retry-after") == "1"
            assert json.loads(body)["error"]["code"] == 503
            if time.monotonic() > deadline:
                return f"error: 503 for {PATIENCE} s"
            await asyncio.sleep(RETRY)  # (what Retry-After asks, scaled to the scene)

    def resume_headers(self) -> dict[str, str]:
        if self.last_id is not None:
            return {"Last-Event-ID": self.last_id}
        assert self.token is not None
        return {TOKEN_HEADER: self.token}

    def elsewhere(self, url: str) -> str:
        return self.random.choice([other for other in self.fronts if other != url])

    async def run(self, owner: str, kind: str) -> None:
        url = owner
        # An abandoned stream must outlive its grace period plus the most a Redis that
        # fails or settles adds to it (one more grace period): else it may just finish.
        count = 3 * COUNT if kind == "abandon" else COUNT
        query = f"/gen?n={count}&every=0.02&tag={self.tag}"
        first = await self.get(url + query, {}, opening=True)
        if isinstance(first, str):
            self.tally.errors.append(f"{self.tag} open: {first}")
            return
        reader = Reader(first)
        self.token = reader.token
        # (abandoned or stopped early: the stream outlives its grace period)
        early = kind in ("abandon", "stop")
        drop = self.random.randrange(3, 15 if early else COUNT - 20)
        self.got, end, self.last_id = await self.read(reader, 0, None if kind == "reader" else drop)
        reader.close()
        if kind == "abandon" and end == "stop":
            self.tally.intended.add(self.tag)
            return
        if kind == "stop" and end == "stop":
            await self.stop(self.elsewhere(url))
            return
        racing = kind == "race"
        while end != "done":
            if end.startswith("error"):
                self.tally.errors.append(f"{self.tag}: {end}")
                return
            url = self.elsewhere(url)
            if racing:  # two reconnects at once, on two workers: the newer one wins
                racing = False
                end = await self.race(url, self.elsewhere(url))
                continue
            answer = await self.get(url + query, self.resume_headers())
            if isinstance(answer, str):
                self.tally.errors.append(f"{self.tag} resume: {answer}")
                return
            reader = Reader(answer)
            self.got, end, self.last_id = await self.read(reader, self.got, None)
            reader.close()
        self.tally.whole += 1
        self.tally.completed.add(self.tag)
        assert self.got == COUNT

    async def race(self, a: str, b: str) -> str:
        query = f"/gen?n={COUNT}&every=0.02&tag={self.tag}"
        headers = self.resume_headers()
        answers = await asyncio.gather(self.get(a + query, headers), self.get(b + query, headers))
        readers = [Reader(answer) for answer in answers if not isinstance(answer, str)]
        if not readers:
            return str(answers[0])
        start = self.got
        ends = await asyncio.gather(*(self.read(reader, start, None) for reader in readers))
        for reader in readers:
            reader.close()
        # Each read checked its outputs from ``start``: the longer one is the stream's,
        # and the client resumes from its last id (not from whichever read had an event
        # last: the shorter one's would replay what the longer one already checked).
        self.got, end, self.last_id = max(ends, key=lambda ended: ended[0])
        return "done" if any(how == "done" for _, how, _ in ends) else end

    async def stop(self, url: str) -> None:
        assert self.token is not None
        deadline = time.monotonic() + PATIENCE
        while True:
            response = await self.session.post(url + "/stop", headers={TOKEN_HEADER: self.token})
            response.close()
            if response.status == 204:
                self.tally.intended.add(self.tag)
                return
            if response.status != 503 or time.monotonic() > deadline:
                self.tally.errors.append(f"{self.tag} stop: {response.status}")
                return
            self.tally.unavailable += 1
            await asyncio.sleep(RETRY)


async def _faults(redis: RedisProcess, marks: dict[str, float]) -> None:
    """The scene's schedule (time is the point here, not a synchronisation)."""
    await asyncio.sleep(0.8)
    redis.pause()
    marks["paused"] = time.monotonic()
    await asyncio.sleep(2.0)
    redis.resume()
    marks["resumed"] = time.monotonic()
    await asyncio.sleep(0.8)
    marks["restarting"] = time.monotonic()
    await redis.restart()
    marks["restarted"] = time.monotonic()


def _recovered(tally: Tally, since: float) -> float:
    """Seconds from ``since`` to the first reconnect answered 200 after it."""
    return min(
        (when - since for when, status in tally.answered if when > since and status == 200),
        default=float("inf"),
    )


async def test_resumable_streams_on_three_workers_survive_a_paused_then_emptied_redis() -> None:
    options = ("--grace", "4", "--timeout", "0.5")
    tally = Tally()
    marks: dict[str, float] = {}
    logs: list[str] = []
    async with (
        redis_process() as redis,
        front("starlette", redis.url, *options, output=logs) as a,
        front("aiohttp", redis.url, *options, output=logs) as b,
        front("starlette", redis.url, *options, output=logs) as c,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session,
    ):
        fronts = [a, b, c]
        clients: list[asyncio.Task[None]] = []
        faults = asyncio.create_task(_faults(redis, marks))
        started = time.monotonic()
        for burst, owner in enumerate(fronts):
            for i in range(BURST):
                number = burst * BURST + i
                client = Client(session, fronts, f"c{number}", tally)
                clients.append(asyncio.create_task(client.run(owner, KINDS[number % len(KINDS)])))
            await asyncio.sleep(0.5)  # (the next burst, on the next worker, a little later)
        async with asyncio.timeout(60):
            await asyncio.gather(*clients)
            await faults
        ran = time.monotonic() - started
        finals = [
            await until(session, url, lambda found: found["in_flight"] == 0) for url in fronts
        ]
    aborted: collections.Counter[str] = collections.Counter()
    for final in finals:
        for rid, times in final["aborts"].items():
            aborted[final["tags"][rid]] += times
    figures = {
        "clients": len(clients),
        "whole": tally.whole,
        "clear errors": len(tally.errors),
        "503 answers": tally.unavailable,
        "404 answers": tally.not_found,
        "slowest 503 (s)": round(tally.slowest_503, 3),
        "slowest new stream's head (s)": round(tally.slowest_open, 3),
        "slowest reconnect's head (s)": round(tally.slowest_head, 3),
        "recovered after the pause (s)": round(_recovered(tally, marks["resumed"]), 3),
        "recovered after the restart (s)": round(_recovered(tally, marks["restarted"]), 3),
        "aborted": len(aborted),
        "seconds": round(ran, 1),
    }
    print("scene:", figures, tally.errors)
    print("\n".join(logs))
    assert tally.wrong == []  # nothing of one request reached another's client
    assert set(aborted.values()) <= {1}  # on_abort once per aborted request
    assert tally.intended <= set(aborted)  # every abandoned or stopped one was aborted
    assert not tally.completed & set(aborted)  # and none that a client read whole
    assert all(final["in_flight"] == 0 for final in finals)
    assert tally.not_found == 0  # no stream that lives was called unknown
    assert tally.whole + len(tally.errors) + len(tally.intended) == len(clients)
    assert tally.slowest_503 < 5.0  # the store's timeout (0.5 s), on a loaded machine
    assert tally.whole >= len(clients) // 2
