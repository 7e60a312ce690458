"""The link under fire: the example engine in its own process, two fronts with honest
clients (some of which leave half-way, some of which send a request over the cap),
and a hostile peer on the same socket sending oversize, non-ASCII, huge and duplicate
submissions and junk frames. Every honest client ends with its whole answer or a
clear error, nothing of one request reaches another, ``on_abort`` runs once per
abandoned request, and nothing stays in flight anywhere. The figures it prints are
the ones ``docs/zmq.md`` quotes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from typing import Any

import msgspec
import pytest
import zmq

import tether
import tether.http
import tether_zmq._protocol as wire  # the hostile peer speaks the wire format itself
from tether_zmq import PROTOCOL_VERSION, EngineClient, PayloadTooLarge

from .conftest import eventually, example_engine
from .test_protocol import answer, raw_peer

pytestmark = pytest.mark.timeout(120)

CAP = 64 * 1024
"""The engine's ``max_message`` in this scene: small, so that oversize is cheap."""
CLIENTS = 40
"""Honest clients per front: every third leaves after two outputs, every tenth sends
a prompt over the cap."""


@dataclasses.dataclass
class Tally:
    complete: int = 0
    refused: list[float] = dataclasses.field(default_factory=list)  # ms to the 413
    abandoned: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    foreign: int = 0  # outputs that named another request
    out_of_order: int = 0


async def honest(client: EngineClient, name: str, index: int, tally: Tally) -> None:
    """One client: its whole answer, checked token by token, or a clear error."""
    prompt = f"{name} client {index}: ünïcødé ✓ 𝄞"
    if index % 10 == 9:
        started = time.monotonic()
        with pytest.raises(PayloadTooLarge) as caught:
            client.open({"prompt": prompt + "x" * CAP, "max_tokens": 3})
        assert tether.http.error_response(caught.value).status == 413
        tally.refused.append((time.monotonic() - started) * 1000)
        return
    leaves = index % 3 == 2
    tokens = 4096 if leaves else 3 + index % 20  # (one that leaves is still running)
    stream = client.open({"prompt": prompt, "max_tokens": tokens})
    seen = 0
    meta: dict[str, Any] = {}
    try:
        async for output in stream:
            meta = output["meta_info"]
            seen += 1
            tally.foreign += meta["id"] != stream.rid
            tally.out_of_order += meta["completion_tokens"] != seen
            if leaves and seen == 2:
                await stream.aclose()
                tally.abandoned.append(f"{name}/{stream.rid}")
                return
    except tether.TetherError as exc:
        tally.errors.append(f"{stream.rid}: {exc!r}")
        return
    if seen == tokens and meta["finish_reason"] == "length":
        tally.complete += 1
    else:
        tally.errors.append(f"{stream.rid}: {seen}/{tokens} outputs")


@dataclasses.dataclass
class Hostile:
    sent: int = 0
    statuses: Counter[int] = dataclasses.field(default_factory=Counter)
    finished: int = 0


def submission(prompt: object, max_tokens: object) -> bytes:
    return msgspec.msgpack.encode({"prompt": prompt, "max_tokens": max_tokens})


async def hostile(address: str, record: Hostile) -> None:
    """A peer that ignores every rule it can on a session of its own."""
    async with raw_peer(zmq.DEALER, address) as peer:
        await peer.send(wire.encode(wire.Hello(0, PROTOCOL_VERSION, "hostile ☠", 1, 1 << 30)))
        assert isinstance(await answer(peer), wire.Welcome)
        batches: list[list[tuple[int, str, bytes]]] = [
            # oversize: past the cap, under twice it (refused whole, 413 each)
            [(1, "big-1", submission("x" * CAP, 3)), (2, "big-2", submission("y", 3))],
            # non-ASCII rids and prompts: served like any other
            [(3, "ünï-☃", submission("héllo ☃ 𝄞", 3)), (4, "𝄞" * 50, submission("ø", 2))],
            # huge or impossible values: refused at the engine's door (422)
            [
                (5, "inf", submission("hi", float("inf"))),
                (6, "nan", submission("hi", float("nan"))),
                (7, "2**63", submission("hi", 2**63)),
                (8, "nested", submission({"a": [[[[1]]]]}, 3)),
                (9, "negative", submission("hi", -1)),
                (10, "bool", submission("hi", True)),
                (11, "long", submission("z" * (CAP // 2), 2)),  # (within the cap: served)
            ],
            # duplicates: ids reused (400 each), rids reused (served: new submissions)
            [(3, "dup-3", submission("again", 2)), (12, "ünï-☃", submission("again", 2))],
            [(12, "dup-12", submission("again", 2))],
        ]
        seq = 1
        for batch in batches:
            await peer.send(b"\xc1")  # junk between the messages: counted and dropped
            await peer.send(wire.encode(wire.Submit(seq, batch)))
            seq += 1
            record.sent += len(batch)
        # Every submission is answered: outputs to its end, or a failure with a status.
        async with asyncio.timeout(20):
            while record.finished + record.statuses.total() < record.sent:
                step = await answer(peer)
                if isinstance(step, wire.Step):
                    record.finished += sum(finished for _, _, finished in step.outputs)
                    record.statuses.update(status for _, _, status in step.failures)
        await peer.send(b"\x00" * (2 * CAP + 1))  # past twice the cap: libzmq drops it


async def test_two_fronts_and_a_hostile_peer_each_get_their_own_answers_only(
    ipc_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    async with example_engine(
        f"ipc://{ipc_dir}/engine", "--max-message", str(CAP), "--peer-timeout", "2"
    ) as engine:
        clients = [EngineClient(engine.address, engine_timeout=2.0) for _ in range(2)]
        aborts: list[Counter[str]] = [Counter(), Counter()]

        def on_abort(index: int) -> Any:
            def record(rid: str) -> None:
                aborts[index][f"front{index}/{rid}"] += 1
                clients[index].on_abort(rid)

            return record

        registries = [
            tether.Registry(on_abort=on_abort(i), max_pending=1_000_000) for i in range(2)
        ]
        tally = Tally()
        record = Hostile()
        async with (
            clients[0].running(registries[0]),
            clients[1].running(registries[1]),
            asyncio.timeout(60),
        ):
            for client in clients:
                await client.wait_ready()
            async with asyncio.TaskGroup() as group:
                group.create_task(hostile(engine.address, record))
                for index, client in enumerate(clients):
                    for n in range(CLIENTS):
                        group.create_task(honest(client, f"front{index}", n, tally))
            for client, registry in zip(clients, registries, strict=True):
                assert registry.in_flight == 0
                assert client.stats().in_flight == 0
                assert client.stats().links_lost == 0

            async def drained() -> bool:  # (the engine hears of the abandoned ones last)
                return bool((await engine.report())["link"]["in_flight"] == 0)

            await eventually(drained)
            report = engine.reports[-1]
        elapsed = time.monotonic() - started

    assert tally.errors == []
    assert tally.foreign == tally.out_of_order == 0
    # Once per abandoned request: those that left, and those refused after they were
    # registered (open() cancels them); never for one that finished.
    told = sum(aborts, Counter())
    assert set(told.values()) == {1}
    assert set(tally.abandoned) <= set(told)
    assert len(told) == len(tally.abandoned) + len(tally.refused)
    total = 2 * CLIENTS
    assert tally.complete + len(tally.abandoned) + len(tally.refused) == total
    assert record.statuses == {413: 2, 422: 6, 400: 2}
    assert record.finished == record.sent - record.statuses.total() == 4
    assert report["link"]["in_flight"] == 0
    assert report["link"]["malformed"] >= 5
    with capsys.disabled():
        print(
            f"\nzmq scene: 2 fronts, {total} clients: {tally.complete} whole answers, "
            f"{len(tally.abandoned)} left half-way (on_abort once each), "
            f"{len(tally.refused)} refused 413 at the door in at most "
            f"{max(tally.refused):.2f} ms; hostile peer: {record.sent} submissions, "
            f"{record.finished} served, refused {dict(record.statuses)}; "
            f"links lost 0; in flight after 0; {elapsed:.2f} s"
        )
