"""The engine's end of the link: one ROUTER that any number of front workers connect to.

The engine loop reads :class:`Submission` and :class:`Cancellation` events with
:meth:`EngineServer.receive` and sends each step with :meth:`EngineServer.send`,
which packs every output and failure for one front into one message (split only
past ``max_message``).

Requests are keyed by :class:`RequestKey` ``(front, rid)``: the front is the
peer's ZeroMQ identity, a fresh random id per front *incarnation*, so two fronts,
or a front and its restarted self, never collide, and the route of a request is
state the engine holds, never parsed out of a rid. The server keeps the set of
live rids of every front; that set is the one path by which a request leaves the
engine unfinished: a front's abort, a front's new session, and the loss of a front
(killed, hung, a sequence gap, a full queue) all remove rids from it, and only a
removal emits a :class:`Cancellation`, so the engine hears of each at most once.

Liveness comes from the event loops: a front pings every ``ping_interval`` and this
loop answers; a front silent for ``peer_timeout`` is lost (a hung front, whose
libzmq thread would still answer ZMTP heartbeats). The socket monitor speeds up
the common case: on a disconnect, every front is probed at once, and a ROUTER in
``ROUTER_MANDATORY`` mode refuses to route to a peer whose pipe is gone.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tether.http import stop_tasks

from ._events import Cancellation, EngineServerStats, Event, RequestKey, Submission
from ._protocol import (
    PROTOCOL_VERSION,
    Abort,
    Codec,
    Hello,
    Message,
    MsgpackCodec,
    Ping,
    Pong,
    Refuse,
    Step,
    Submit,
    Welcome,
    decode,
    encode,
)
from ._security import CurveServer, check_bind
from ._socket import (
    DEFAULT_HWM,
    DEFAULT_MAX_MESSAGE,
    configure,
    read_forever,
    send_nowait,
    watch_monitor,
)

__all__ = ["EngineServer"]

logger = logging.getLogger("tether.zmq.engine")

_ENTRY_OVERHEAD = 32
"""Bytes of framing counted per output when packing a step under ``max_message``."""
_PROBE_DELAYS = (0.0, 0.002, 0.01, 0.03)
"""When to probe the fronts after a disconnect event: libzmq may drop the route a
moment after it reports the disconnect."""


class _Front:
    """One front incarnation's session: its sequence counters and its live rids."""

    __slots__ = ("identity", "last_seen", "live", "name", "seq_in", "seq_out")

    def __init__(self, identity: bytes, name: str, now: float) -> None:
        self.identity = identity
        self.name = name
        self.seq_in = 1  # the hello was 0
        self.seq_out = 0
        self.live: set[str] = set()
        self.last_seen = now


class EngineServer:
    """The engine's ROUTER: sessions, liveness, and one message per step per front.

    :param address: where to bind (``tcp://127.0.0.1:0`` picks a port: see
        :attr:`address`). Non-local TCP needs ``curve`` or ``insecure=True``.
    :param codec: how payloads are encoded; the fronts must use the same.
    :param peer_timeout: seconds of silence after which a front is lost (fronts ping
        every ``ping_interval``, 20 ms by default: keep this several times larger). A
        killed front is noticed in milliseconds whatever this is (the socket monitor).
    :param max_message: bytes per frame, both ways; larger steps are split, a larger
        single output fails its request alone.
    :param hwm: messages queued per front; a front that lets more pile up is lost.
    :raises InsecureAddress: a non-local address without ``curve`` or ``insecure``.
    """

    def __init__(
        self,
        address: str,
        *,
        codec: Codec | None = None,
        peer_timeout: float = 0.2,
        max_message: int = DEFAULT_MAX_MESSAGE,
        hwm: int = DEFAULT_HWM,
        curve: CurveServer | None = None,
        insecure: bool = False,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        check_bind(address, curve=curve, insecure=insecure)
        self._requested = address
        self._codec = codec or MsgpackCodec()
        self._peer_timeout = peer_timeout
        self._max_message = max_message
        self._hwm = hwm
        self._curve = curve
        self._context = context
        self.incarnation = uuid.uuid4().hex
        self._fronts: dict[bytes, _Front] = {}
        self._events: list[Event] = []
        self._waiter: asyncio.Future[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._socket: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self.address = address
        self._counts = dict.fromkeys(
            (
                "submitted",
                "cancelled",
                "late_outputs",
                "late_aborts",
                "malformed",
                "no_session",
                "refused",
                "fronts_lost",
                "too_large",
            ),
            0,
        )

    # -- lifetime --------------------------------------------------------------------

    async def __aenter__(self) -> EngineServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Bind and start serving; :attr:`address` becomes the bound endpoint."""
        if self._socket is not None:
            raise RuntimeError("EngineServer.start() was already called")
        context = self._context or zmq.asyncio.Context.instance()
        socket = context.socket(zmq.ROUTER)
        configure(socket, max_message=self._max_message, hwm=self._hwm)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable send raises, never drops
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting front takes its id back
        if self._curve is not None:
            self._curve.apply(socket)
        try:
            socket.bind(self._requested)
        except zmq.ZMQError:
            socket.close(linger=0)
            raise
        self.address = str(socket.getsockopt_string(zmq.LAST_ENDPOINT))
        self._socket = socket
        self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tasks = [
            asyncio.create_task(read_forever(socket, self._on_frames, self._wake), name="zmq-in"),
            asyncio.create_task(watch_monitor(self._monitor, self._on_event), name="zmq-mon"),
            asyncio.create_task(self._watch_fronts(), name="zmq-liveness"),
        ]

    async def aclose(self) -> None:
        """Stop serving: cancel and await the loops, close the sockets. Idempotent."""
        tasks, self._tasks = self._tasks, []
        await stop_tasks(tasks)
        if self._socket is not None:
            self._socket.disable_monitor()
            if self._monitor is not None:
                self._monitor.close(linger=0)
            self._socket.close(linger=0)
            self._socket = self._monitor = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()

    # -- the engine loop's API ------------------------------------------------------------

    async def receive(self) -> list[Event]:
        """Wait for submissions and cancellations; returns every one ready, in order."""
        if not self._events:
            if self._waiter is not None:
                raise RuntimeError("EngineServer.receive() is already awaited by another task")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events, self._events = self._events, []
        return events

    def receive_nowait(self) -> list[Event]:
        """The events ready now, maybe none (for an engine loop that polls between steps)."""
        events, self._events = self._events, []
        return events

    def send(
        self,
        outputs: Iterable[tuple[RequestKey, Any, bool]] = (),
        failures: Iterable[tuple[RequestKey, BaseException]] = (),
    ) -> None:
        """Send one step: ``(key, output, finished)`` triples and ``(key, error)`` pairs.

        Everything for one front goes out as one message. Never raises for a request
        that is no longer live (counted as late) nor for a front that is gone (it is
        lost: its other requests are cancelled). An output that cannot be encoded or
        does not fit one message fails its own request, not the step.
        """
        per_front: dict[bytes, tuple[list[tuple[str, bytes, bool]], list[tuple[str, str, int]]]]
        per_front = {}
        fronts = self._fronts
        encode_payload = self._codec.encode
        limit = self._max_message - 64
        for key, output, finished in outputs:
            front = fronts.get(key.front)
            if front is None or key.rid not in front.live:
                self._counts["late_outputs"] += 1
                continue
            entry = per_front.get(key.front)
            if entry is None:
                entry = per_front[key.front] = ([], [])
            try:
                payload = encode_payload(output)
            except Exception as exc:
                front.live.discard(key.rid)
                entry[1].append((key.rid, f"the output could not be encoded: {exc}", 500))
                continue
            if len(payload) + len(key.rid) + _ENTRY_OVERHEAD > limit:
                self._counts["too_large"] += 1
                front.live.discard(key.rid)
                entry[1].append((key.rid, "an output exceeded the link's max_message", 500))
                continue
            if finished:
                front.live.discard(key.rid)
            entry[0].append((key.rid, payload, finished))
        for key, error in failures:
            front = fronts.get(key.front)
            if front is None or key.rid not in front.live:
                self._counts["late_outputs"] += 1
                continue
            front.live.discard(key.rid)
            status = getattr(error, "status_code", 500)
            if not isinstance(status, int) or isinstance(status, bool):
                status = 500
            entry = per_front.setdefault(key.front, ([], []))
            entry[1].append((key.rid, str(error)[:1024], status))
        for identity, (outs, fails) in per_front.items():
            self._send_step(identity, outs, fails)

    @property
    def in_flight(self) -> int:
        """Requests live on every front together."""
        return sum(len(front.live) for front in self._fronts.values())

    def live(self) -> set[RequestKey]:
        """Every live request's key (a copy)."""
        return {
            RequestKey(front.identity, rid) for front in self._fronts.values() for rid in front.live
        }

    def stats(self) -> EngineServerStats:
        """A frozen snapshot of the counters."""
        return EngineServerStats(fronts=len(self._fronts), in_flight=self.in_flight, **self._counts)

    # -- sending ------------------------------------------------------------------------

    def _send_step(
        self,
        identity: bytes,
        outs: list[tuple[str, bytes, bool]],
        fails: list[tuple[str, str, int]],
    ) -> None:
        """One message for the step, or as few as fit ``max_message`` each, in order."""
        limit = self._max_message - 64
        parts: list[tuple[list[tuple[str, bytes, bool]], list[tuple[str, str, int]]]] = [([], [])]
        size = 0

        def make_room(cost: int) -> None:
            nonlocal size
            if size + cost > limit and (parts[-1][0] or parts[-1][1]):
                parts.append(([], []))
                size = 0
            size += cost

        for out in outs:
            make_room(len(out[0]) + len(out[1]) + _ENTRY_OVERHEAD)
            parts[-1][0].append(out)
        for fail in fails:
            make_room(len(fail[0]) + len(fail[1]) + _ENTRY_OVERHEAD)
            parts[-1][1].append(fail)
        for part_outs, part_fails in parts:
            if not self._send_step_part(identity, part_outs, part_fails):
                return

    def _send_step_part(
        self,
        identity: bytes,
        outs: list[tuple[str, bytes, bool]],
        fails: list[tuple[str, str, int]],
    ) -> bool:
        front = self._fronts.get(identity)  # (a failed send of a first part loses it)
        if front is None:
            return False
        return self._send(front, Step(front.seq_out, outs, fails))

    def _send(self, front: _Front, message: Message) -> bool:
        """Send to a front with a session; a front we cannot reach is lost."""
        assert self._socket is not None
        try:
            send_nowait(self._socket, [front.identity, encode(message)])
        except zmq.Again:
            self._lose(front, "its queue is full (the front stopped reading)")
            return False
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self._lose(front, "it disconnected")
            return False
        front.seq_out += 1
        return True

    def _reply(self, identity: bytes, message: Message) -> None:
        """Answer a peer without a session (a refusal); a peer already gone is ignored."""
        assert self._socket is not None
        try:
            send_nowait(self._socket, [identity, encode(message)])
        except zmq.ZMQError:
            pass  # (Again or EHOSTUNREACH) nobody to tell

    # -- receiving ----------------------------------------------------------------------

    def _wake(self) -> None:
        if self._events and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._counts["malformed"] += 1
            return
        identity, frame = frames
        try:
            message = decode(frame)
        except msgspec.DecodeError:
            self._counts["malformed"] += 1
            return
        if isinstance(message, Hello):
            self._on_hello(identity, message)
            return
        front = self._fronts.get(identity)
        if front is None:
            self._counts["no_session"] += 1
            self._reply(identity, Refuse(0, PROTOCOL_VERSION, "no session: say hello"))
            return
        if message.seq != front.seq_in:
            self._lose(front, f"sequence gap: expected {front.seq_in}, got {message.seq}")
            self._reply(identity, Refuse(0, PROTOCOL_VERSION, "sequence gap: say hello"))
            return
        front.seq_in += 1
        front.last_seen = time.monotonic()
        if isinstance(message, Submit):
            self._on_submit(front, message)
        elif isinstance(message, Abort):
            self._on_abort(front, message)
        elif isinstance(message, Ping):
            self._send(front, Pong(front.seq_out, message.sent))
        elif not isinstance(message, Pong):
            self._counts["malformed"] += 1  # an engine-bound message from a front

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        if hello.version != PROTOCOL_VERSION:
            self._counts["refused"] += 1
            logger.warning(
                "front %s speaks protocol v%d, this engine v%d: refused",
                hello.front,
                hello.version,
                PROTOCOL_VERSION,
            )
            reason = f"protocol version {hello.version} is not {PROTOCOL_VERSION}"
            self._reply(identity, Refuse(0, PROTOCOL_VERSION, reason))
            return
        former = self._fronts.get(identity)
        if former is not None:  # the same incarnation starts over: its old requests end
            self._lose(former, "it opened a new session")
        front = self._fronts[identity] = _Front(identity, hello.front, time.monotonic())
        self._send(
            front, Welcome(0, PROTOCOL_VERSION, self.incarnation, hello.attempt, self._max_message)
        )

    def _on_submit(self, front: _Front, submit: Submit) -> None:
        decode_payload = self._codec.decode
        refused: list[tuple[str, str, int]] = []
        for rid, payload in submit.requests:
            if rid in front.live:  # the front's registry never reuses a live rid
                self._counts["malformed"] += 1
                continue
            try:
                request = decode_payload(payload)
            except Exception:
                refused.append((rid, "the request could not be decoded", 400))
                continue
            front.live.add(rid)
            self._counts["submitted"] += 1
            self._events.append(Submission(RequestKey(front.identity, rid), request))
        if refused:
            self._send(front, Step(front.seq_out, [], refused))

    def _on_abort(self, front: _Front, abort: Abort) -> None:
        live = front.live
        for rid in abort.rids:
            if rid in live:
                live.remove(rid)
                self._cancel(RequestKey(front.identity, rid), "aborted")
            else:
                self._counts["late_aborts"] += 1

    def _cancel(self, key: RequestKey, reason: str) -> None:
        self._counts["cancelled"] += 1
        self._events.append(Cancellation(key, reason))

    def _lose(self, front: _Front, why: str) -> None:
        """End a front's session: each of its live requests is cancelled, once."""
        if self._fronts.get(front.identity) is not front:
            return
        del self._fronts[front.identity]
        self._counts["fronts_lost"] += 1
        log = logger.warning if front.live else logger.info
        log("front %s lost (%s): cancelling its %d requests", front.name, why, len(front.live))
        live, front.live = front.live, set()
        for rid in live:
            self._cancel(RequestKey(front.identity, rid), "front_lost")
        self._wake()

    # -- liveness -----------------------------------------------------------------------

    def _on_event(self, event: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            loop = asyncio.get_running_loop()
            for delay in _PROBE_DELAYS:
                loop.call_later(delay, self._probe)

    def _probe(self) -> None:
        """Ping every front: a front whose pipe is gone cannot be routed to, and is lost."""
        if self._socket is None:
            return
        now = time.monotonic()
        for front in list(self._fronts.values()):
            self._send(front, Ping(front.seq_out, now))

    async def _watch_fronts(self) -> None:
        interval = self._peer_timeout / 6
        while True:
            await asyncio.sleep(interval)
            deadline = time.monotonic() - self._peer_timeout
            for front in list(self._fronts.values()):
                if front.last_seen < deadline:
                    self._lose(front, f"silent for more than {self._peer_timeout:g}s")
