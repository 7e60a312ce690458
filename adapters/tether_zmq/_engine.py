"""The engine's end of the link: one ROUTER that any number of front workers connect to.

The engine loop reads :class:`Submission` and :class:`Cancellation` events with
:meth:`EngineServer.receive` and sends each step with :meth:`EngineServer.send`,
which packs every output and failure for one front into one message (split only
past the front's frame cap).

Each submission gets a :class:`RequestKey` whose ``submission`` number this engine
never gives again, so a key names one submission for ever: a rid reused by its
front, a restarted front, a peer that names itself after another, never meet an
older request's outputs. A session is bound to the routing id of its hello: a
secret the front draws and nothing logs (the logs name a front by its incarnation);
a second peer claiming a connected front's id is refused, not handed over. Each front's
live submissions are the one path by which a request leaves the engine unfinished:
its abort, its new session, its loss (killed, hung, a gap, a full queue) remove
them, and only a removal emits a :class:`Cancellation`, so the engine hears of each
at most once.

Liveness comes from the event loops, and covers the engine loop itself: a front
pings every ``ping_interval`` and this loop answers; a front silent for
``peer_timeout`` is lost; an engine loop that leaves its events untaken for
``consumer_timeout`` ends every session (the fronts fail their requests with
``EngineLost``) and hellos are refused until it takes them again; a task of the
link that dies closes the socket and makes :meth:`~EngineServer.receive` raise
:class:`LinkDown`. Silence is judged only after reading what is waiting. The socket
monitor speeds up the common case: on a disconnect every front is probed, and a
ROUTER in ``ROUTER_MANDATORY`` mode refuses to route to a peer whose pipe is gone.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tether.http import stop_tasks

from ._errors import LinkDown
from ._events import Cancellation, EngineServerStats, Event, RequestKey, Submission
from ._protocol import (
    HELLO_TOO_LARGE,
    MAX_ENTRIES,
    MAX_FAILURE_TEXT,
    MAX_NAME,
    MIN_MESSAGE,
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
    clip,
    decode_at_engine,
    encode,
    entries_of,
    tag_of,
)
from ._security import CurveServer, check_bind
from ._socket import (
    DEFAULT_HWM,
    DEFAULT_MAX_MESSAGE,
    Reader,
    configure,
    require_loop,
    send_nowait,
    supervise,
    watch_monitor,
)
from ._throttle import Throttle

__all__ = ["EngineServer"]

logger = logging.getLogger("tether.zmq.engine")

_ENTRY_OVERHEAD = 32
"""Bytes of framing counted per output or failure when packing a step under a cap."""
_STEP_OVERHEAD = 64
"""Bytes of a step message beyond its entries (tag, sequence number, array headers)."""
_NO_SESSION_FRAME = 1024
"""Bytes of a frame other than a hello from a peer without a session beyond which it is
not read: such a peer may only say hello. (Decoding a string costs up to 3-4 ms per MiB
and four times its bytes in memory: a 32 MiB frame of one string would hold the loop as
long as a padded frame did.)"""
_MISMATCH_LOG_PERIOD = 60.0
"""Seconds between two log lines for hellos of another protocol version."""
_REMEMBERED_LOSSES = 16
"""Peers (by routing id) lost with requests live that are remembered, the oldest
forgotten first: a peer's next losses with requests spend a throttle of its own, so one
that cycles its sessions cannot spend the line of another front's loss."""
_REPEAT_LOSS_PERIOD = 60.0
"""Seconds per line of a remembered peer's repeated losses with requests."""
_MAX_HELLO = 16 * 1024
"""Bytes of a hello, from any peer, beyond which it is refused unread, saying why: ours
take under 200 bytes, and the rest leaves a newer front room for its own scalar fields
(a token, a description) at a cost of microseconds to read."""
_HELLO_TAG = Hello.__struct_config__.tag
_PROBE_DELAYS = (0.0, 0.002, 0.01, 0.03)
"""When to probe the fronts after a disconnect event: libzmq may drop the route a
moment after it reports the disconnect."""


class _Front:
    """One front's session: its counters, its caps, and its live submissions."""

    __slots__ = (
        "identity",
        "label",
        "last_seen",
        "last_submission",
        "limit",
        "live",
        "name",
        "seq_in",
        "seq_out",
    )

    def __init__(self, identity: bytes, hello: Hello, limit: int, now: float) -> None:
        self.identity = identity  # the routing id: it grants the session, never logged
        self.name = hello.front.encode()
        self.label = repr(hello.front)  # (a peer's text: quoted in logs, never raw)
        self.limit = limit  # bytes of step entries per message this front accepts
        self.seq_in = 1  # the hello was 0
        self.seq_out = 0
        self.live: dict[int, _Request] = {}  # by the front's submission id
        self.last_submission = -1
        self.last_seen = now


class _Request:
    """A live submission: its front's session, the front's id for it, and its key."""

    __slots__ = ("front", "key", "sid")

    def __init__(self, front: _Front, sid: int, key: RequestKey) -> None:
        self.front = front
        self.sid = sid
        self.key = key


def _text_of(error: BaseException) -> str:
    """An error's text for the wire; its type's name if its ``__str__`` fails (a
    failure's text never fails the rest of the step)."""
    try:
        return str(error)
    except Exception:
        return f"{type(error).__name__} (its text could not be built)"


def _status_of(error: BaseException) -> int:
    """The status a failure declares (``status_code``, 100-599), else 500: one that
    raises when read, or is no plain int, declares nothing (a huge int would not even
    encode, and the step would raise)."""
    try:
        status = getattr(error, "status_code", 500)
    except Exception:
        return 500
    if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status < 600:
        return 500
    return status


class EngineServer:
    """The engine's ROUTER: sessions, liveness, and one message per step per front.

    :param address: where to bind (``tcp://127.0.0.1:0`` picks a port: see
        :attr:`address`). Non-local TCP needs ``curve`` or ``insecure=True``.
    :param codec: how payloads are encoded; the fronts must use the same.
    :param peer_timeout: seconds of silence after which a front is lost (fronts ping
        every ``ping_interval``, 20 ms by default: keep this several times larger, and
        above a loaded machine's scheduling delays, measured up to 0.26 s). A killed
        front is noticed in milliseconds whatever this is (the socket monitor).
    :param consumer_timeout: seconds the engine loop may leave events untaken (not
        calling :meth:`receive` or :meth:`receive_nowait`) before the engine counts
        as stalled: every session ends and hellos are refused until it takes them.
        Keep it above the loop's longest step between two calls.
    :param max_message: bytes per frame, both ways. A step is split to fit the
        smaller of this and the front's own cap; a larger single output fails its
        request alone. A front's frame past it (up to twice it) has its submissions
        refused alone (413); libzmq drops a peer that sends more than twice it.
    :param hwm: messages queued per front; a front that lets more pile up is lost.
    :param max_events: submissions waiting for the engine loop, at most: one more is
        refused at once (503 to its client) rather than queued without bound while the
        loop is behind (a flood, or a loop about to be found stalled).
    :param max_front_requests: requests live at once from one front, at most: one
        more is refused at once (503), so that one front (a flood, a hostile peer with
        a session) can never take the engine's whole capacity from the others.
    :raises InsecureAddress: a non-local address without ``curve`` or ``insecure``.
    """

    def __init__(
        self,
        address: str,
        *,
        codec: Codec | None = None,
        peer_timeout: float = 1.0,
        consumer_timeout: float = 1.0,
        max_message: int = DEFAULT_MAX_MESSAGE,
        hwm: int = DEFAULT_HWM,
        max_events: int = 65_536,
        max_front_requests: int = 16_384,
        curve: CurveServer | None = None,
        insecure: bool = False,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        check_bind(address, curve=curve, insecure=insecure)
        self._max_events = max_events
        self._max_front_requests = max_front_requests
        self._requested = address
        self._codec = codec or MsgpackCodec()
        self._peer_timeout = peer_timeout
        self._consumer_timeout = consumer_timeout
        self._max_message = max_message
        self._hwm = hwm
        self._curve = curve
        self._context = context
        self.incarnation = uuid.uuid4().hex
        self._fronts: dict[bytes, _Front] = {}
        self._requests: dict[int, _Request] = {}  # by this engine's submission number
        self._numbers = itertools.count(1)
        self._events: list[Event] = []
        self._pending_since: float | None = None  # events waiting for the engine loop
        self._stalled = False
        self._behind_since: float | None = None  # since when frames kept waiting
        self._down: str | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped: list[asyncio.Task[None]] = []
        self._socket: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._reader: Reader | None = None
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
                "refused_submissions",
                "stalls",
            ),
            0,
        )
        # What a peer can make this engine log (see _throttle): a line of each kind
        # goes through its own throttle, whatever the peers send.
        self._mismatch_lines = Throttle(burst=1, period=_MISMATCH_LOG_PERIOD)
        self._loss_lines = Throttle()  # (a front lost with requests: a WARNING)
        self._repeat_losses: dict[bytes, Throttle] = {}  # (its next ones: per peer)
        self._leave_lines = Throttle()  # (a front lost with none: an INFO)
        self._fault_lines = Throttle()

    # -- lifetime --------------------------------------------------------------------

    async def __aenter__(self) -> EngineServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Bind and start serving; :attr:`address` becomes the bound endpoint."""
        if self._socket is not None or self._down is not None:
            raise RuntimeError("EngineServer.start() was already called")
        self._loop = asyncio.get_running_loop()
        context = self._context or zmq.asyncio.Context.instance()
        socket = context.socket(zmq.ROUTER)
        # libzmq drops a peer past twice the cap; between the two, the frame is read
        # and its submissions refused alone, so a front that ignores the cap loses one
        # message, not its connection.
        configure(socket, max_frame=2 * self._max_message, hwm=self._hwm)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable send raises, never drops
        # No ROUTER_HANDOVER: a second peer claiming a connected front's routing id is
        # refused by libzmq instead of taking over its outputs (a front whose old pipe
        # lingers after a silent network cut waits for the heartbeats to close it).
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
        self._reader = Reader(socket, self._on_frames, self._on_fault)
        self._tasks.extend(
            (
                asyncio.create_task(self._reader.run(self._wake), name="zmq-engine-in"),
                asyncio.create_task(
                    watch_monitor(self._monitor, self._on_event), name="zmq-engine-monitor"
                ),
                asyncio.create_task(self._watch(), name="zmq-engine-liveness"),
            )
        )
        supervise(self._tasks, self._die)

    async def aclose(self) -> None:
        """Stop serving: cancel and await the loops, end every session, close the
        sockets. Idempotent. Afterwards :meth:`send` counts every output as late and
        :meth:`receive` returns the cancellations still waiting, then raises
        :class:`LinkDown` (a loop blocked in it is woken, not cancelled)."""
        if self._down is None:
            self._down = "the server was closed"
        for front in list(self._fronts.values()):  # (before any await: no call sees half)
            self._lose(front, "the engine is closing")
        tasks = [*self._tasks, *self._stopped]
        self._tasks.clear()
        self._stopped.clear()
        await stop_tasks(tasks)
        self._close_sockets()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _close_sockets(self) -> None:
        if self._socket is not None:
            self._socket.disable_monitor()
            if self._monitor is not None:
                self._monitor.close(linger=0)
            self._socket.close(linger=0)
            self._socket = self._monitor = None
            self._reader = None

    def _die(self, why: str) -> None:
        """A task of the link ended by itself: stop loudly rather than serve half-deaf.

        The socket closes, so every front sees the engine gone at once and fails its
        requests with ``EngineLost``; :meth:`receive` raises :class:`LinkDown`.
        """
        logger.error("engine link down: %s; every front is let go", why)
        self._down = why
        self._stopped.extend(self._tasks)  # (awaited by aclose)
        self._tasks.clear()
        for task in self._stopped:
            task.cancel()
        for front in list(self._fronts.values()):
            self._lose(front, "the engine's link went down")
        self._close_sockets()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- the engine loop's API ------------------------------------------------------------

    async def receive(self) -> list[Event]:
        """Wait for submissions and cancellations; returns every one ready, in order.

        :raises LinkDown: the link stopped (one of its tasks died, or :meth:`aclose`);
            events still waiting are returned first.
        :raises RuntimeError: called before :meth:`start`, or outside its loop.
        """
        require_loop(self._loop, "EngineServer.receive()")
        if not self._events:
            if self._down is not None:
                raise LinkDown(f"the engine's link is down: {self._down}")
            if self._waiter is not None:
                raise RuntimeError("EngineServer.receive() is already awaited by another task")
            self._waiter = asyncio.get_running_loop().create_future()
            self._taken()  # (waiting for events is taking them)
            try:
                await self._waiter
            finally:
                self._waiter = None
            if not self._events and self._down is not None:
                raise LinkDown(f"the engine's link is down: {self._down}")
        return self.receive_nowait()

    def receive_nowait(self) -> list[Event]:
        """The events ready now, maybe none (for an engine loop that polls between steps).

        :raises RuntimeError: called before :meth:`start`, or outside its loop.
        """
        require_loop(self._loop, "EngineServer.receive_nowait()")
        events, self._events = self._events, []
        self._taken()
        return events

    def _taken(self) -> None:
        self._pending_since = None
        if self._stalled:
            self._stalled = False
            logger.warning("the engine loop takes its events again: hellos are accepted")

    def send(
        self,
        outputs: Iterable[tuple[RequestKey, Any, bool]] = (),
        failures: Iterable[tuple[RequestKey, BaseException]] = (),
    ) -> None:
        """Send one step: ``(key, output, finished)`` triples and ``(key, error)`` pairs.

        Everything for one front goes out as one message (or as few as fit its cap).
        Never raises for a request that is no longer live (counted as late) nor for a
        front that is gone (it is lost: its other requests are cancelled). An output
        that cannot be encoded or does not fit one message fails its own request, not
        the step; so does a failure whose text or ``status_code`` cannot be read (500).

        :raises RuntimeError: called before :meth:`start`, or outside its loop (from
            another thread: hand the step over with ``loop.call_soon_threadsafe``).
        :raises TypeError: an entry is malformed: its key no :class:`RequestKey`, its
            ``finished`` no bool (nothing of the step is sent).
        """
        require_loop(self._loop, "EngineServer.send()")
        outputs, failures = list(outputs), list(failures)
        # (refused whole, before it ends any request)
        for item in outputs:
            if len(item) != 3 or type(item[0]) is not RequestKey or type(item[2]) is not bool:
                raise TypeError(f"an output is (RequestKey, output, finished: bool): {item!r}")
        for fault in failures:
            if len(fault) != 2 or type(fault[0]) is not RequestKey:
                raise TypeError(f"a failure is (RequestKey, exception): {fault!r}")
        per_front: dict[_Front, tuple[list[tuple[int, bytes, bool]], list[tuple[int, str, int]]]]
        per_front = {}
        requests = self._requests
        encode_payload = self._codec.encode
        for key, output, finished in outputs:
            request = requests.get(key.submission)
            if request is None:
                self._counts["late_outputs"] += 1
                continue
            front = request.front
            entry = per_front.get(front)
            if entry is None:
                entry = per_front[front] = ([], [])
            try:
                payload = encode_payload(output)
            except Exception as exc:
                self._end(request)
                text = f"the output could not be encoded: {_text_of(exc)}"
                entry[1].append((request.sid, clip(text, 512), 500))
                continue
            if len(payload) + _ENTRY_OVERHEAD > front.limit:
                self._counts["too_large"] += 1
                self._end(request)
                entry[1].append((request.sid, "an output exceeded the link's max_message", 500))
                continue
            if finished:
                self._end(request)
            entry[0].append((request.sid, payload, finished))
        for key, error in failures:
            request = requests.get(key.submission)
            if request is None:
                self._counts["late_outputs"] += 1
                continue
            self._end(request)
            entry = per_front.setdefault(request.front, ([], []))
            entry[1].append(
                (request.sid, clip(_text_of(error), MAX_FAILURE_TEXT), _status_of(error))
            )
        for front, (outs, fails) in per_front.items():
            self._send_step(front, outs, fails)

    @property
    def in_flight(self) -> int:
        """Requests live on every front together."""
        return len(self._requests)

    def live(self) -> set[RequestKey]:
        """Every live request's key (a copy)."""
        return {request.key for request in self._requests.values()}

    def stats(self) -> EngineServerStats:
        """A frozen snapshot of the counters."""
        return EngineServerStats(
            fronts=len(self._fronts),
            stalled=self._stalled,
            in_flight=self.in_flight,
            **self._counts,
        )

    # -- sending ------------------------------------------------------------------------

    def _send_step(
        self,
        front: _Front,
        outs: list[tuple[int, bytes, bool]],
        fails: list[tuple[int, str, int]],
    ) -> None:
        """One message for the step, or as few as fit the front's cap each (in bytes,
        and in entries: the front refuses a step of more than ``MAX_ENTRIES``), in order."""
        limit = front.limit
        parts: list[tuple[list[tuple[int, bytes, bool]], list[tuple[int, str, int]]]] = [([], [])]
        size = 0
        count = 0

        def make_room(cost: int) -> None:
            nonlocal size, count
            if (size + cost > limit or count == MAX_ENTRIES) and (parts[-1][0] or parts[-1][1]):
                parts.append(([], []))
                size = count = 0
            size += cost
            count += 1

        for out in outs:
            make_room(len(out[1]) + _ENTRY_OVERHEAD)
            parts[-1][0].append(out)
        for fail in fails:
            make_room(len(fail[1].encode()) + _ENTRY_OVERHEAD)  # (bytes, not characters)
            parts[-1][1].append(fail)
        for part_outs, part_fails in parts:
            # (a failed send of one part loses the front: the rest has nowhere to go)
            if self._fronts.get(front.identity) is not front:
                return
            if not self._send(front, Step(front.seq_out, part_outs, part_fails)):
                return

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
        if self._socket is None:
            return
        try:
            send_nowait(self._socket, [identity, encode(message)])
        except zmq.ZMQError:
            pass  # (Again or EHOSTUNREACH) nobody to tell

    # -- receiving ----------------------------------------------------------------------

    def _wake(self) -> None:
        if self._events and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _on_fault(self, exc: Exception) -> None:
        self._fault_lines.log(
            logger,
            logging.ERROR,
            "tether_zmq: a message could not be handled; dropped",
            exc_info=exc,
        )
        self._counts["malformed"] += 1

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._counts["malformed"] += 1
            return
        identity, frame = frames
        if entries_of(frame) > MAX_ENTRIES:
            self._on_too_many(identity, entries_of(frame))
            return
        if len(frame) > _NO_SESSION_FRAME:
            if tag_of(frame) == _HELLO_TAG:
                if len(frame) > _MAX_HELLO:
                    self._on_hello_too_large(identity, len(frame))
                    return
            elif identity not in self._fronts:
                self._counts["no_session"] += 1  # (unread: it is no hello)
                self._reply(identity, Refuse(0, PROTOCOL_VERSION, "no session: say hello"))
                return
        try:
            message = decode_at_engine(frame)
        except msgspec.DecodeError:  # (a frame for the other direction fails on its tag)
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
        if len(frame) > self._max_message:
            self._on_too_large(front, message)
        elif isinstance(message, Submit):
            self._on_submit(front, message)
        elif isinstance(message, Abort):
            self._on_abort(front, message)
        elif isinstance(message, Ping):
            self._send(front, Pong(front.seq_out, message.sent))

    def _log_mismatch(self, hello: Hello) -> None:
        """One line per :data:`_MISMATCH_LOG_PERIOD` for hellos of another protocol
        version, saying how many went unsaid: a front of another version says hello
        every ``hello_interval`` for as long as both run, and any peer can say one."""
        if not logger.isEnabledFor(logging.WARNING):
            return
        unlogged = self._mismatch_lines.allow()
        if unlogged is None:
            return
        logger.warning(
            "front %.64r speaks protocol v%d, this engine v%d: refused "
            "(and %d more such hellos since the last line)",
            hello.front,
            hello.version,
            PROTOCOL_VERSION,
            unlogged,
        )

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        if hello.version != PROTOCOL_VERSION:
            self._counts["refused"] += 1
            self._log_mismatch(hello)
            reason = f"protocol version {hello.version} is not {PROTOCOL_VERSION}"
            self._reply(identity, Refuse(0, PROTOCOL_VERSION, reason))
            return
        if self._stalled:
            self._reply(identity, Refuse(0, PROTOCOL_VERSION, "the engine is stalled"))
            return
        if len(hello.front.encode()) > MAX_NAME:
            self._counts["malformed"] += 1
            self._reply(identity, Refuse(0, PROTOCOL_VERSION, "front name too long"))
            return
        if hello.max_message < MIN_MESSAGE:
            self._counts["malformed"] += 1
            reason = f"max_message={hello.max_message} is below {MIN_MESSAGE} bytes"
            self._reply(identity, Refuse(0, PROTOCOL_VERSION, reason))
            return
        former = self._fronts.get(identity)
        if former is not None:  # the same front starts over: its old requests end
            self._lose(former, "it opened a new session")
        limit = min(self._max_message, hello.max_message) - _STEP_OVERHEAD
        front = _Front(identity, hello, limit, time.monotonic())
        self._fronts[identity] = front
        welcome = Welcome(0, PROTOCOL_VERSION, self.incarnation, hello.attempt, self._max_message)
        self._send(front, welcome)

    def _on_submit(self, front: _Front, submit: Submit) -> None:
        decode_payload = self._codec.decode
        refused: list[tuple[int, str, int]] = []
        for sid, rid, payload in submit.requests:
            if sid <= front.last_submission:
                # (an honest front's ids only grow; the front hears of this one)
                refused.append((sid, "a submission id was reused", 400))
                continue
            front.last_submission = sid
            if len(self._events) >= self._max_events:
                refused.append((sid, "the engine is not keeping up; retry later", 503))
                continue
            if len(front.live) >= self._max_front_requests:
                text = f"this front has {self._max_front_requests} requests live; retry later"
                refused.append((sid, text, 503))
                continue
            try:
                request = decode_payload(payload)
            except Exception:
                refused.append((sid, "the request could not be decoded", 400))
                continue
            key = RequestKey(front.name, rid, next(self._numbers))
            entry = front.live[sid] = _Request(front, sid, key)
            self._requests[key.submission] = entry
            self._counts["submitted"] += 1
            self._add(Submission(key, request))
        if refused:
            self._counts["refused_submissions"] += len(refused)
            self._send_step(front, [], refused)

    def _on_too_large(self, front: _Front, message: Message) -> None:
        """A frame past ``max_message`` (a front that ignored the welcome's cap): its
        submissions are refused, each told 413; nothing else of it is used."""
        self._counts["too_large"] += 1
        if isinstance(message, Submit):
            text = f"the submission exceeds the engine's max_message={self._max_message}"
            refused = [(sid, text, 413) for sid, _, _ in message.requests]
            for sid, _, _ in message.requests:
                front.last_submission = max(front.last_submission, sid)
            self._counts["refused_submissions"] += len(refused)
            self._send_step(front, [], refused)

    def _on_hello_too_large(self, identity: bytes, size: int) -> None:
        """A hello past :data:`_MAX_HELLO`, refused unread and told so: a front that was
        only told to say hello would say this one again for ever. Unread, it is no hello:
        a session this peer has goes on, as after any malformed frame."""
        self._counts["malformed"] += 1
        reason = f"{HELLO_TOO_LARGE}: {size} bytes (at most {_MAX_HELLO})"
        self._reply(identity, Refuse(0, PROTOCOL_VERSION, reason))

    def _on_too_many(self, identity: bytes, count: int) -> None:
        """A message of more entries than any honest front sends, refused unread (its
        decoding alone would hold the loop): that front's session ends, and it is told."""
        self._counts["too_large"] += 1
        front = self._fronts.get(identity)
        if front is not None:
            self._lose(front, f"a message of {count} entries (at most {MAX_ENTRIES})")
        reason = f"a message of {count} entries exceeds {MAX_ENTRIES}: say hello"
        self._reply(identity, Refuse(0, PROTOCOL_VERSION, reason))

    def _on_abort(self, front: _Front, abort: Abort) -> None:
        live = front.live
        for sid in abort.submissions:
            request = live.get(sid)
            if request is None:
                self._counts["late_aborts"] += 1
                continue
            self._end(request)
            self._cancel(request.key, "aborted")

    def _end(self, request: _Request) -> None:
        """The one way a submission stops being live."""
        del request.front.live[request.sid]
        del self._requests[request.key.submission]

    def _add(self, event: Event) -> None:
        if not self._events:
            self._pending_since = time.monotonic()
        self._events.append(event)

    def _cancel(self, key: RequestKey, reason: str) -> None:
        self._counts["cancelled"] += 1
        self._add(Cancellation(key, reason))

    def _lose(self, front: _Front, why: str) -> None:
        """End a front's session: each of its live requests is cancelled, once."""
        if self._fronts.get(front.identity) is not front:
            return
        del self._fronts[front.identity]
        self._counts["fronts_lost"] += 1
        # (any peer can open and end sessions at will: the lines are throttled)
        lines, level = (
            (self._loss_throttle(front.identity), logging.WARNING)
            if front.live
            else (self._leave_lines, logging.INFO)
        )
        lines.log(
            logger,
            level,
            "front %s lost (%s): cancelling its %d requests",
            front.label,
            why,
            len(front.live),
        )
        for request in list(front.live.values()):
            self._end(request)
            self._cancel(request.key, "front_lost")
        self._wake()

    def _loss_throttle(self, identity: bytes) -> Throttle:
        """The throttle of a loss with requests of the peer at ``identity``: the shared
        one for its first (a front's routing id is its secret: no other peer can spend
        its own), then one of its own, while it is among the last remembered. However
        many peers cycle, the lines cost at most the shared throttle's plus
        :data:`_REMEMBERED_LOSSES` times one per :data:`_REPEAT_LOSS_PERIOD`."""
        remembered = self._repeat_losses
        lines = remembered.pop(identity, None)
        if lines is None:
            if len(remembered) >= _REMEMBERED_LOSSES:
                del remembered[next(iter(remembered))]
            remembered[identity] = Throttle(burst=1, period=_REPEAT_LOSS_PERIOD)
            return self._loss_lines
        remembered[identity] = lines  # (the most recent last)
        return lines

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

    async def _watch(self) -> None:
        interval = self._peer_timeout / 6
        while True:
            await asyncio.sleep(interval)
            self._judge()

    def _judge(self) -> None:
        """Judge the fronts' silence and the engine loop's, after reading what waits."""
        assert self._reader is not None
        more = self._reader.drain()
        now = time.monotonic()
        if more:
            # More is waiting, perhaps a front's word: judge next time. But not for
            # ever: the waiting may be another peer's flood (each peer's frames are
            # queued apart, fairly), so after ``peer_timeout`` of waiting frames the
            # fronts are judged all the same (a silent one: within two timeouts).
            behind = self._behind_since
            if behind is None:
                self._behind_since = now
                return
            if now - behind < self._peer_timeout:
                return
        self._behind_since = None
        self._wake()
        pending = self._pending_since
        if pending is not None and now - pending > self._consumer_timeout and not self._stalled:
            self._stall(now - pending)
        deadline = now - self._peer_timeout
        for front in list(self._fronts.values()):
            if front.last_seen < deadline:
                self._lose(front, f"silent for more than {self._peer_timeout:g}s")

    def _stall(self, waited: float) -> None:
        """The engine loop leaves its events untaken: no front may wait on it."""
        self._stalled = True
        self._counts["stalls"] += 1
        logger.error(
            "the engine loop has not taken its events for %.3fs: ending every session "
            "and refusing hellos until it does",
            waited,
        )
        for front in list(self._fronts.values()):
            self._reply(front.identity, Refuse(0, PROTOCOL_VERSION, "the engine is stalled"))
            self._lose(front, "the engine loop stalled")
