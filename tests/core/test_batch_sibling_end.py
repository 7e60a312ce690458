"""When one sub-request of a batch fails, its siblings end as aborted because of it,
and everything that reports the end says the same: the exception each consumer
raises, the counters and what observers hear."""

from __future__ import annotations

import pytest

import tether
from tether import AbortReason


class Ends(tether.Observer):
    def __init__(self) -> None:
        self.ends: dict[str, tether.RequestEnd] = {}

    def on_end(self, end: tether.RequestEnd) -> None:
        self.ends[end.rid] = end


@pytest.mark.parametrize("ending", ["fail", "abort"])
async def test_a_sibling_of_a_failed_sub_request_ends_aborted_because_of_it(ending: str) -> None:
    registry = tether.Registry()
    ends = Ends()
    registry.add_observer(ends)
    batch = registry.open_batch(3)
    failing, sibling, other = batch.rids
    cause = RuntimeError("bad prompt")
    if ending == "fail":
        registry.fail(failing, cause)
    else:
        registry.abort(failing)
    first, second, third = batch.streams
    with pytest.raises(tether.TetherError) as own:
        await anext(first)
    if ending == "fail":
        assert isinstance(own.value, tether.ProducerError)
        assert own.value.__cause__ is cause
    else:
        assert isinstance(own.value, tether.Aborted)
        assert own.value.reason is AbortReason.SERVER
    for stream, rid in ((second, sibling), (third, other)):
        with pytest.raises(tether.Aborted) as caught:
            await anext(stream)
        error = caught.value
        assert error.reason is AbortReason.FAILED_SIBLING
        assert error.rid == rid
        assert failing in str(error)  # the message names the sub-request that failed
        assert error.__cause__ is own.value
        end = ends.ends[rid]
        assert (end.outcome, end.reason, end.error) == ("aborted", "failed_sibling", error)
    stats = registry.stats()
    assert stats.aborted.get("failed_sibling") == 2
    assert stats.failed == (1 if ending == "fail" else 0)
    assert ends.ends[failing].error is own.value


async def test_a_batch_read_whole_raises_the_failed_sub_requests_own_error() -> None:
    registry = tether.Registry()
    batch = registry.open_batch(3)
    cause = RuntimeError("bad prompt")
    registry.fail(batch.rids[1], cause)
    with pytest.raises(tether.ProducerError) as caught:
        await batch.result()
    assert caught.value.rid == batch.rids[1]
    assert caught.value.__cause__ is cause
    with pytest.raises(tether.ProducerError):
        await anext(batch)
    assert registry.stats().aborted == {"failed_sibling": 2}
