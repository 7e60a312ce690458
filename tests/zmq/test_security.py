"""Security defaults: an engine listens beyond this host only with CURVE keys or an
explicit ``insecure=True``; CURVE keys work on the link; a front's session cannot be
taken over by a peer that claims its routing id, and that id is never its logged name."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

import tether
import tether_zmq
import tether_zmq._protocol as wire  # the hostile peers below speak the wire format itself
from tether_zmq import CurveClient, CurveServer, EngineServer, InsecureAddress

from .conftest import eventually
from .linked import echo_engine, front
from .test_protocol import answer, raw_peer, say_hello

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


async def test_a_second_peer_claiming_a_connected_front_s_routing_id_never_reads_its_outputs(
    address: str,
) -> None:
    routing_id = b"front-routing-id"  # (the worst case: the attacker learned it)
    async with (
        echo_engine(address) as engine,
        raw_peer(zmq.DEALER, engine.server.address, identity=routing_id) as owner,
    ):
        await say_hello(owner)
        await owner.send(
            wire.encode(wire.Submit(1, [(1, "mine", msgspec.msgpack.encode({"n": 0}))]))
        )
        await eventually(lambda: len(engine.submitted) == 1)
        thief = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        thief.setsockopt(zmq.ROUTING_ID, routing_id)
        # Taken in, or turned away: either way the engine has seen the thief.
        settled = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        monitor = thief.get_monitor_socket(settled | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        try:
            thief.connect(engine.server.address)  # (after the monitor: no event missed)
            async with asyncio.timeout(10):
                await monitor.recv_multipart()
            engine.server.send([(engine.submitted[0], {"secret": 1}, True)])
            step = await answer(owner)
            assert isinstance(step, wire.Step)
            assert [sid for sid, _, _ in step.outputs] == [1]
            assert not await thief.poll(200)  # (absence: a bounded look, 0.2 s)
        finally:
            thief.disable_monitor()
            monitor.close(linger=0)
            thief.close(linger=0)


async def test_a_front_s_routing_id_is_a_secret_apart_from_the_name_it_is_logged_by(
    address: str,
) -> None:
    async with raw_peer(zmq.ROUTER, address) as fake:
        bound = fake.getsockopt_string(zmq.LAST_ENDPOINT)
        async with front(bound, ready=False):
            async with asyncio.timeout(10):
                identity, frame = await fake.recv_multipart()
            hello = wire.decode(frame)
            assert isinstance(hello, wire.Hello)
            assert len(identity) >= 16
            assert hello.front.encode() not in identity
            assert identity.hex() not in hello.front


class Blackhole:
    """A loopback TCP relay between a front and the engine whose :meth:`cut` stops every
    byte of the connections open now without closing them: a network cut without a
    word (a cable, a firewall's state table). Later connections are relayed again."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self._cut: list[asyncio.Event] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.connections = 0

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.close()
        for writer in self._writers:
            writer.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def cut(self) -> None:
        for stop in self._cut:
            stop.set()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        self._writers += [writer, upstream_writer]
        stop = asyncio.Event()
        self._cut.append(stop)
        for source, sink in ((reader, upstream_writer), (upstream_reader, writer)):
            task = asyncio.create_task(self._pump(source, sink, stop))
            self._tasks.add(task)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, stop: asyncio.Event
    ) -> None:
        while data := await source.read(65536):
            if stop.is_set():
                continue  # (swallowed: neither end hears a thing, nor a close)
            sink.write(data)


async def test_a_front_cut_off_without_a_word_gets_a_session_again_once_the_cut_is_seen() -> None:
    # No ROUTER_HANDOVER: the engine refuses the front's reconnection while its old
    # connection lingers; the heartbeats (2 s) must close that one on both ends.
    async with echo_engine("tcp://127.0.0.1:0") as engine:
        relay = Blackhole(engine.server.address)
        async with relay as via, front(via, engine_timeout=0.3) as client:
            waiting = client.open({"n": 0})
            await eventually(lambda: len(engine.submitted) == 1)
            relay.cut()
            async with asyncio.timeout(10):
                with pytest.raises(tether.ProducerError) as caught:
                    await waiting.result()
            assert isinstance(caught.value.__cause__, tether_zmq.EngineLost)
            await eventually(lambda: client.ready and client.stats().sessions == 2, timeout=15)
            assert relay.connections >= 2
            async with asyncio.timeout(10):
                assert await client.open({"n": 1}).result() == {
                    "i": 1,
                    "front": client.incarnation,
                }
            await eventually(lambda: engine.server.in_flight == 0)
            assert [c.reason for c in engine.cancelled] == ["front_lost"]
