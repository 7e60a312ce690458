"""Exchange carries the send timeout both adapters apply to each write."""

from __future__ import annotations

import pytest

import tether
import tether.http


async def test_exchange_defaults_to_the_shared_send_timeout() -> None:
    registry = tether.Registry()
    stream, other = registry.open(), registry.open()
    exchange = tether.http.Exchange(stream, streaming=True)
    assert exchange.send_timeout == tether.http.DEFAULT_SEND_TIMEOUT == 30.0
    assert tether.http.Exchange(other, streaming=True, send_timeout=None).send_timeout is None
    await stream.aclose()
    await other.aclose()


@pytest.mark.parametrize("value", [0, -1.0, float("nan")], ids=["zero", "negative", "nan"])
async def test_exchange_refuses_a_send_timeout_that_is_not_positive(value: float) -> None:
    stream = tether.Registry().open()
    with pytest.raises(ValueError, match="send_timeout must be positive"):
        tether.http.Exchange(stream, streaming=False, send_timeout=value)
    await stream.aclose()
