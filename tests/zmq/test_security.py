"""Security defaults: an engine listens beyond this host only with CURVE keys or an
explicit ``insecure=True``; CURVE keys work on the link."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from tether_zmq import CurveClient, CurveServer, EngineServer, InsecureAddress

from .linked import echo_engine, front

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "address",
    ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://eth0:5555",
     "tcp://example.com:5555", "tcp://[::]:5555", "pgm://eth0;239.192.1.1:5555"],
)  # fmt: skip
def test_an_insecure_non_loopback_bind_is_refused_before_binding(address: str) -> None:
    with pytest.raises(InsecureAddress, match="CurveServer"):
        EngineServer(address)


@pytest.mark.parametrize(
    "address",
    ["tcp://127.0.0.1:0", "tcp://127.0.0.2:5555", "tcp://localhost:5555", "tcp://[::1]:5555",
     "ipc:///tmp/engine", "inproc://engine"],
)  # fmt: skip
def test_local_addresses_need_no_keys(address: str) -> None:
    EngineServer(address)  # (constructing binds nothing)


def test_insecure_must_be_said_in_so_many_words() -> None:
    EngineServer("tcp://0.0.0.0:5555", insecure=True)  # (constructing binds nothing)
    public, secret = zmq.curve_keypair()
    EngineServer("tcp://0.0.0.0:5555", curve=CurveServer(public, secret))


needs_curve = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")


@needs_curve
async def test_a_curve_link_serves_a_front_that_holds_the_engine_key() -> None:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    curve = CurveServer(server_public, server_secret)
    async with echo_engine("tcp://127.0.0.1:0", curve=curve) as engine:
        keys = CurveClient(server_public, client_public, client_secret)
        async with front(engine.server.address, curve=keys) as client, asyncio.timeout(10):
            assert [o["i"] async for o in client.open({"n": 2})] == [1, 2]


@needs_curve
async def test_a_front_without_the_engine_key_never_gets_a_session() -> None:
    server_public, server_secret = zmq.curve_keypair()
    curve = CurveServer(server_public, server_secret)
    async with (
        echo_engine("tcp://127.0.0.1:0", curve=curve) as engine,
        front(engine.server.address, ready=False) as client,
    ):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.wait_ready(), 0.5)  # (absence: a bounded look)
        assert engine.server.stats().fronts == 0
