"""An idle stream (its first event written, nothing since) keeps only what its next
write needs: the server holds thousands of them."""

from __future__ import annotations

import gc
import types

import tether
from tether.http import Exchange, Head

from .conftest import StartServer, read_until
from .test_producer_writes import one_stream


async def test_an_idle_stream_keeps_no_head_once_it_went_out(start_server: StartServer) -> None:
    registry = tether.Registry()
    async with one_stream(start_server, registry, []) as (rid, reader):
        assert registry.deliver(rid, {"n": 0})
        await read_until(reader, b'{"n":0}')
        gc.collect()
        heads = [o for o in gc.get_objects() if type(o) is Head]
        assert not [h for h in heads if h.headers.get("content-type", "").startswith("text/event")]
        assert registry.deliver(rid, {"n": 1}, finished=True)
        await read_until(reader, b"\r\n0\r\n\r\n")


async def test_an_idle_streams_write_loop_holds_no_bound_method_but_its_sink(
    start_server: StartServer,
) -> None:
    registry = tether.Registry()
    async with one_stream(start_server, registry, []) as (rid, reader):
        assert registry.deliver(rid, {"n": 0})
        await read_until(reader, b'{"n":0}')
        gc.collect()
        held = {
            o.__func__.__name__
            for o in gc.get_objects()
            if type(o) is types.MethodType and type(o.__self__) is Exchange
        }
        assert held == {"_sink"}  # (the producer's step writes through it)
        assert registry.deliver(rid, {"n": 1}, finished=True)
        await read_until(reader, b"\r\n0\r\n\r\n")
