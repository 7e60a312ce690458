"""A step's failures on the engine's side: whatever one failure's exception does, it
fails that request alone, never the rest of the step nor the engine loop."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

import tether
import tether.http

from .conftest import eventually
from .linked import echo_engine, front

pytestmark = pytest.mark.timeout(60)


class Unprintable(RuntimeError):
    """An exception whose text cannot be built (a ``__str__`` that raises, as after a
    careless unpickling or a template with a missing attribute)."""

    def __str__(self) -> str:
        raise AttributeError("no message")


async def test_a_failure_whose_text_cannot_be_built_fails_its_request_alone(
    address: str,
) -> None:
    """One request's bad data fails that request alone, never the rest of its step:
    the other request of the step gets its output, the failed one its error."""
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        failing = client.open({"n": 0})
        served = client.open({"n": 0})
        await eventually(lambda: len(engine.submitted) == 2)
        first, second = engine.submitted
        raised: BaseException | None = None
        try:
            engine.server.send(
                outputs=[(second, {"i": 1}, True)], failures=[(first, Unprintable())]
            )
        except Exception as exc:
            raised = exc
        outcome: list[object] = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3):
                outcome.append(await served.result())
                with pytest.raises(tether.ProducerError):
                    await failing.result()
                outcome.append("failed")
        in_flight = client.registry.in_flight
        await failing.aclose()
        await served.aclose()
        assert raised is None, f"send() raised {raised!r} for one failure's text"
        assert outcome == [{"i": 1}, "failed"], (
            f"after the step, the front got {outcome}; {in_flight} requests still in "
            f"flight, {engine.server.in_flight} live in the engine"
        )


class StatusUnreadable(RuntimeError):
    """An exception whose ``status_code`` raises when read (a lazy property)."""

    @property
    def status_code(self) -> int:
        raise LookupError("no status yet")


async def test_a_failure_whose_status_cannot_be_read_fails_its_request_alone_as_500(
    address: str,
) -> None:
    """A ``status_code`` that raises when read declares nothing: the request fails as
    a 500, alone; the rest of its step goes out."""
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        failing = client.open({"n": 0})
        served = client.open({"n": 0})
        await eventually(lambda: len(engine.submitted) == 2)
        first, second = engine.submitted
        raised: BaseException | None = None
        try:
            engine.server.send(
                outputs=[(second, {"i": 1}, True)], failures=[(first, StatusUnreadable("x"))]
            )
        except Exception as exc:
            raised = exc
        outcome: list[object] = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3):
                outcome.append(await served.result())
                with pytest.raises(tether.ProducerError) as caught:
                    await failing.result()
                outcome.append(tether.http.error_response(caught.value).status)
        await failing.aclose()
        await served.aclose()
        assert raised is None, f"send() raised {raised!r} reading a failure's status"
        assert outcome == [{"i": 1}, 500], f"after the step, the front got {outcome}"


class Ambiguous:
    """A ``finished`` whose truth cannot be told (as a numpy array's)."""

    def __bool__(self) -> bool:
        raise ValueError("the truth value of an array with more than one element is ambiguous")


@pytest.mark.parametrize(
    "bad",
    [
        ("not a key", {"i": 9}, True),
        ("two items",),
        {"i": 9},
        (None, {"i": 9}, 1),  # (the key filled in below: a finished that is an int)
        (None, {"i": 9}, Ambiguous()),
    ],
    ids=[
        "key-not-a-request-key",
        "wrong-length",
        "not-an-entry",
        "finished-int",
        "finished-ambiguous",
    ],
)
async def test_a_malformed_step_is_refused_whole_before_any_of_its_requests_ends(
    address: str, bad: object
) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        stream = client.open({"n": 0})
        odd = client.open({"n": 0})
        await eventually(lambda: len(engine.submitted) == 2)
        key, odd_key = engine.submitted
        if isinstance(bad, tuple) and len(bad) == 3 and bad[0] is None:
            bad = (odd_key, *bad[1:])
        with pytest.raises(TypeError):
            engine.server.send(outputs=[(key, {"i": 1}, True), bad])  # type: ignore[list-item]
        assert engine.server.in_flight == 2  # nothing of the step ended, nothing was sent
        engine.server.send(outputs=[(odd_key, {"i": 3}, True)])
        async with asyncio.timeout(10):
            assert await odd.result() == {"i": 3}
        await odd.aclose()
        engine.server.send(outputs=[(key, {"i": 2}, True)])
        async with asyncio.timeout(10):
            assert await stream.result() == {"i": 2}
        await stream.aclose()
