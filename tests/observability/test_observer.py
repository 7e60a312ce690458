"""The core's observer hooks: every request is announced on open, on its first output
and at its end, with how it ended; never per output; a raising observer harms nothing;
and each end is one DEBUG line on ``tether.requests``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

import tether
from tests._support.observers import Recorder


@pytest.fixture
def observed() -> tuple[tether.Registry, Recorder]:
    registry = tether.Registry()
    recorder = Recorder()
    registry.add_observer(recorder)
    return registry, recorder


async def test_a_finished_request_is_announced_open_first_output_once_and_finished(
    observed: tuple[tether.Registry, Recorder],
) -> None:
    registry, seen = observed
    stream = registry.open()
    for n in range(5):
        registry.deliver(stream.rid, n, finished=n == 4)
    async with asyncio.timeout(10):
        assert [out async for out in stream] == [0, 1, 2, 3, 4]
    assert seen.opens == [((stream.rid,), False, None)]
    assert [rid for rid, _ in seen.firsts] == [stream.rid]  # once, not per output
    end = seen.ends[stream.rid]
    assert end.outcome is tether.Outcome.FINISHED
    assert end.reason is None
    assert end.error is None
    assert end.batch_index is None
    assert end.time_to_first_output is not None
    assert 0 <= end.time_to_first_output <= end.total_time
    assert end.time_to_first_output == seen.firsts[0][1]


async def test_a_failed_request_ends_failed_with_its_error(
    observed: tuple[tether.Registry, Recorder],
) -> None:
    registry, seen = observed
    stream = registry.open()
    registry.fail(stream.rid, RuntimeError("engine broke"))
    end = seen.ends[stream.rid]
    assert end.outcome is tether.Outcome.FAILED
    assert end.reason is None
    assert isinstance(end.error, tether.ProducerError)
    assert end.time_to_first_output is None  # no output arrived
    await stream.aclose()


@pytest.mark.parametrize(
    "how",
    ["server", "timeout", "cancelled", "client_disconnected"],
)
async def test_an_aborted_request_ends_aborted_under_its_reason(
    observed: tuple[tether.Registry, Recorder], how: str
) -> None:
    registry, seen = observed
    async with asyncio.timeout(10):
        if how == "server":
            stream = registry.open()
            registry.abort(stream.rid)
        elif how == "timeout":
            stream = registry.open(timeout=0.01)
            with pytest.raises(tether.RequestTimeout):
                await stream.result()
        elif how == "cancelled":
            stream = registry.open()
            await stream.aclose()
        else:
            with tether.RequestScope() as scope:
                stream = registry.open()
                scope.disconnect()
    end = seen.ends[stream.rid]
    assert end.outcome is tether.Outcome.ABORTED
    assert end.reason == how
    assert isinstance(end.error, tether.Aborted)


async def test_a_batch_is_announced_once_and_each_sub_request_ends_with_its_index(
    observed: tuple[tether.Registry, Recorder],
) -> None:
    registry, seen = observed
    batch = registry.open_batch(3)
    registry.deliver(batch.rids[0], "a", finished=True)
    registry.fail(batch.rids[1], RuntimeError("no"))  # the third is aborted as a sibling
    assert seen.opens == [(tuple(batch.rids), True, None)]
    ends = [seen.ends[rid] for rid in batch.rids]
    assert [end.batch_index for end in ends] == [0, 1, 2]
    assert [end.outcome for end in ends] == ["finished", "failed", "aborted"]
    assert ends[2].reason == "failed_sibling"
    await batch.aclose()


async def test_the_scope_request_id_labels_every_request_opened_in_it(
    observed: tuple[tether.Registry, Recorder],
) -> None:
    registry, seen = observed
    with tether.RequestScope(request_id="client-42"):
        single = registry.open()
        batch = registry.open_batch(2)
    assert [request_id for _, _, request_id in seen.opens] == ["client-42", "client-42"]
    assert {seen.ends[rid].request_id for rid in (single.rid, *batch.rids)} == {"client-42"}
    assert single.rid != "client-42"  # a label, never the rid


async def test_a_raising_observer_is_logged_and_the_request_and_producer_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(tether.Observer):
        def on_open(self, rids: Sequence[str], *, batch: bool, request_id: str | None) -> None:
            raise RuntimeError("open")

        def on_first_output(self, rid: str, elapsed: float) -> None:
            raise RuntimeError("first")

        def on_end(self, end: tether.RequestEnd) -> None:
            raise RuntimeError("end")

    registry = tether.Registry()
    registry.add_observer(Broken())
    after = Recorder()
    registry.add_observer(after)
    stream = registry.open()
    assert registry.deliver(stream.rid, "x", finished=True) is True
    async with asyncio.timeout(10):
        assert await stream.result() == "x"
    assert stream.rid in after.ends  # the observers after it still heard
    assert registry.in_flight == 0
    assert sum("raised in on_" in r.getMessage() for r in caplog.records) == 3


def test_an_observer_attaches_once_and_detaches() -> None:
    registry = tether.Registry()
    recorder = Recorder()
    registry.add_observer(recorder)
    with pytest.raises(ValueError, match="already attached"):
        registry.add_observer(recorder)
    registry.remove_observer(recorder)
    registry.remove_observer(recorder)  # nothing: not attached


async def test_each_ended_request_is_one_debug_line_and_outputs_log_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = tether.Registry()
    caplog.set_level(logging.DEBUG, logger="tether.requests")
    with tether.RequestScope(request_id="abc"):
        stream = registry.open()
        for n in range(10):
            registry.deliver(stream.rid, n, finished=n == 9)
    aborted = registry.open()
    registry.abort(aborted.rid)
    lines = [r for r in caplog.records if r.name == "tether.requests"]
    assert len(lines) == 2
    first, second = lines
    assert first.levelno == logging.DEBUG
    assert f"rid={stream.rid}" in first.getMessage()
    assert "request_id=abc" in first.getMessage()
    assert "outcome=finished" in first.getMessage()
    assert first.tether["outcome"] == "finished"  # type: ignore[attr-defined]
    assert first.tether["request_id"] == "abc"  # type: ignore[attr-defined]
    assert "outcome=aborted reason=server" in second.getMessage()
    await stream.aclose()
