"""A front worker's end of the link: one DEALER per engine, feeding a ``tether.Registry``.

Create one :class:`EngineClient` per engine in each worker process *after* the
fork (in the app's lifespan or ``cleanup_ctx``), give its :meth:`~EngineClient.on_abort`
to the registry, and run it with :meth:`~EngineClient.running`::

    client = EngineClient("ipc:///run/engine.sock")
    registry = tether.Registry(on_abort=client.on_abort)
    async with client.running(registry):
        stream = client.open({"prompt": "hi"})   # 503 + Retry-After if no engine
        ...

Outputs arrive as one message per engine step and go into the registry with
``deliver_many``; aborts (client gone, deadline, early close) are gathered and
sent as one message per loop tick. Every submission has an id of its own that only
grows: aborts and outputs name it, so a rid reused at once after its abort is a new
submission the old one's outputs never reach. Submitting never waits: with no
session up, or with the link's queue full, :meth:`submit` raises
:class:`EngineUnavailable` at once (503 + ``Retry-After``); a request larger than
the engine accepts (its welcome says how much) fails alone with
:class:`PayloadTooLarge` (413).

The link is lost when the socket monitor reports a disconnect (a killed engine is
seen in milliseconds), when a ping to the engine's event loop stays unanswered for
``engine_timeout`` (a hung engine, whose libzmq thread would still answer ZMTP
heartbeats), on a sequence gap, or when a task of the link dies. Silence is judged
only after reading what is waiting, and only while a ping was out: this front's own
stall is never blamed on the engine. Every request in flight then fails at once
with :class:`EngineLost` (503), and the client says hello again until an engine
welcomes it: the new session never sees the old one's messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

import tether
from tether.http import stop_tasks

from ._errors import (
    EngineLost,
    EngineUnavailable,
    PayloadTooLarge,
    RemoteFailure,
    UnencodableRequest,
)
from ._events import EngineClientStats
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
    TooManyEntries,
    Welcome,
    clip,
    decode_at_front,
    encode,
)
from ._security import CurveClient
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
from ._throttle import Throttle, quoted

__all__ = ["EngineClient"]

logger = logging.getLogger("tether.zmq.front")

_REMEMBERED_REFUSALS = 16
"""Reasons for a refused hello remembered as said (until a session comes up): the
oldest is forgotten first, so an engine that names a new reason each time costs a
bounded memory (and its lines a bounded rate: the throttle)."""


class EngineClient:
    """One front worker's link to one engine.

    :param address: the engine's endpoint (``ipc://...``, ``tcp://127.0.0.1:...``).
    :param codec: how payloads are encoded; the engine must use the same.
    :param ping_interval: seconds between two pings to the engine's loop.
    :param engine_timeout: seconds without a word from the engine after which the link
        is lost: how long a hung engine (``SIGSTOP``, a wedged loop) goes unnoticed. Keep
        it above the engine loop's longest blocking step and above the scheduling
        delays of a loaded machine (an event loop on 2 shared cores under load was
        measured late by up to 0.26 s): a false alarm fails every request in flight. A
        killed engine is noticed in milliseconds whatever this is (the socket monitor).
        0.03 with ``ping_interval=0.005`` detects a hang within 50 ms on dedicated cores.
    :param hello_interval: seconds between two hellos while no session is up, and
        the least between two hellos: a session that ends sooner is not followed by a
        hello at once.
    :param retry_after: the ``Retry-After`` that refusals carry, in seconds.
    :param max_message: bytes per frame, both ways.
    :param hwm: messages queued to the engine before submissions are refused.
    """

    def __init__(
        self,
        address: str,
        *,
        codec: Codec | None = None,
        ping_interval: float = 0.02,
        engine_timeout: float = 1.0,
        hello_interval: float = 0.1,
        retry_after: float = 1.0,
        max_message: int = DEFAULT_MAX_MESSAGE,
        hwm: int = DEFAULT_HWM,
        curve: CurveClient | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.address = address
        self._codec = codec or MsgpackCodec()
        self._ping_interval = ping_interval
        self._engine_timeout = engine_timeout
        self._hello_interval = hello_interval
        self._retry_after = retry_after
        self._max_message = max_message
        self._hwm = hwm
        self._curve = curve
        self._context = context
        self.incarnation = ""
        """This front's identity on the link, drawn by :meth:`start`: fresh per start, so
        a restarted front is a new incarnation whose requests never mix with the dead
        one's, and workers forked from one parent after building their client (a
        pre-fork server) never share one."""
        self._registry: tether.Registry | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._reader: Reader | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped: list[asyncio.Task[None]] = []
        self._broken: str | None = None
        self._up = False
        self._ready = asyncio.Event()
        self._why_down = "not connected yet"
        self._attempt = 0
        self._awaited: int | None = None  # the attempt said and not yet answered
        self._paced = False  # the last session ended within hello_interval of its hello
        self._last_hello = 0.0
        self._unanswered_since: float | None = None  # the first ping sent since a word
        self._seq_in = 0
        self._seq_out = 0
        self._engine = ""
        self._limit = max_message  # the session's frame cap: the smaller of both ends'
        self._submissions = itertools.count(1)  # never reset: ids only grow
        self._live: dict[int, str] = {}  # submission -> rid
        self._submission_of: dict[str, int] = {}  # rid -> its live submission
        self._aborts: list[int] = []
        self._flush_scheduled = False
        # What an engine can make this front log (see _throttle): a line of each kind
        # goes through its own throttle, whatever the engine sends.
        self._refusal_lines = Throttle()
        self._said: dict[str, None] = {}  # refusals logged since the last welcome
        self._held: dict[str, None] = {}  # refusals the throttle held back, not yet said
        self._loss_lines = Throttle()  # (a loss that fails requests: a WARNING)
        self._leave_lines = Throttle()  # (a loss that fails none: an INFO)
        self._fault_lines = Throttle()
        self._counts = dict.fromkeys(
            (
                "submitted",
                "aborts_sent",
                "outputs",
                "steps",
                "sessions",
                "links_lost",
                "failed_on_loss",
                "malformed",
                "refused",
                "late_outputs",
                "too_large",
            ),
            0,
        )

    # -- lifetime --------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self, registry: tether.Registry) -> AsyncIterator[EngineClient]:
        """Connect, feed ``registry`` while the block runs, then disconnect."""
        await self.start(registry)
        try:
            yield self
        finally:
            await self.aclose()

    async def start(self, registry: tether.Registry) -> None:
        """Connect to the engine (in the background: the link comes up by itself)."""
        if self._socket is not None or self._broken is not None:
            raise RuntimeError("EngineClient.start() was already called")
        self._registry = registry
        self._loop = asyncio.get_running_loop()
        self.incarnation = uuid.uuid4().hex
        context = self._context or zmq.asyncio.Context.instance()
        socket = context.socket(zmq.DEALER)
        configure(socket, max_frame=self._max_message, hwm=self._hwm)
        # The routing id is what the engine routes this front's outputs to: a secret,
        # apart from the incarnation (which is logged and shown), never written down.
        socket.setsockopt(zmq.ROUTING_ID, b"f" + secrets.token_bytes(16))
        socket.setsockopt(zmq.IMMEDIATE, 1)  # no queueing onto a link that is not up
        socket.setsockopt(zmq.RECONNECT_IVL, 20)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
        if self._curve is not None:
            self._curve.apply(socket)
        self._socket = socket
        self._monitor = socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self._reader = Reader(socket, self._on_frames, self._on_fault)
        socket.connect(self.address)
        self._tasks.extend(
            (
                asyncio.create_task(self._reader.run(_nothing), name="zmq-front-in"),
                asyncio.create_task(
                    watch_monitor(self._monitor, self._on_event), name="zmq-front-monitor"
                ),
                asyncio.create_task(self._tick(), name="zmq-front-tick"),
            )
        )
        supervise(self._tasks, self._die)

    async def aclose(self) -> None:
        """Fail what is in flight, stop the loops, close the socket. Idempotent."""
        self._go_down("the front is closing", hello=False)
        tasks = [*self._tasks, *self._stopped]
        self._tasks.clear()
        self._stopped.clear()
        await stop_tasks(tasks)
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._socket is not None:
            self._socket.disable_monitor()
            if self._monitor is not None:
                self._monitor.close(linger=0)
            self._socket.close(linger=0)
            self._socket = self._monitor = None
            self._reader = None

    def _die(self, why: str) -> None:
        """A task of the link ended by itself: the link is down for good, loudly.

        Its requests fail (503) and the socket closes, so the engine cancels them at
        once; new requests are refused with the reason.
        """
        logger.error("engine link broken: %s; failing its requests", why)
        self._broken = f"the front's link to the engine broke ({why})"
        self._stopped.extend(self._tasks)  # (awaited by aclose)
        self._tasks.clear()
        for task in self._stopped:
            task.cancel()
        self._go_down(self._broken, hello=False)
        self._close_sockets()

    # -- the handlers' API ----------------------------------------------------------------

    @property
    def registry(self) -> tether.Registry:
        """The registry this client feeds (given to :meth:`start`)."""
        return self._require_registry()

    @property
    def ready(self) -> bool:
        """Whether a session is up, so that submissions are accepted."""
        return self._up

    async def wait_ready(self) -> None:
        """Wait until a session is up (bound it with ``asyncio.timeout``)."""
        await self._ready.wait()

    def open(
        self, request: Any, *, rid: str | None = None, timeout: float | None = None
    ) -> tether.Stream:
        """Register a request and submit it; on any refusal nothing stays registered.

        :raises EngineUnavailable: no session is up or the link is full (503).
        :raises PayloadTooLarge: the request is larger than the engine accepts (413).
        :raises tether.TetherError: the registry refused it (overload, duplicate rid).
        """
        self._check_up()
        stream = self._require_registry().open(rid, timeout=timeout)
        try:
            self.submit(stream.rid, request)
        except BaseException:
            stream.cancel()
            raise
        return stream

    def open_batch(
        self,
        requests: Sequence[Any],
        *,
        rids: Sequence[str] | None = None,
        timeout: float | None = None,
    ) -> tether.Batch:
        """Register a batch and submit all of it in one message (see :meth:`open`)."""
        self._check_up()
        batch = self._require_registry().open_batch(
            list(rids) if rids is not None else len(requests), timeout=timeout
        )
        try:
            self.submit_many(zip(batch.rids, requests, strict=True))
        except BaseException:
            batch.cancel()
            raise
        return batch

    def submit(self, rid: str, request: Any) -> None:
        """Submit one registered request (see :meth:`submit_many`)."""
        self.submit_many(((rid, request),))

    def submit_many(self, requests: Iterable[tuple[str, Any]]) -> None:
        """Submit registered requests in one message; never waits.

        A rid whose earlier submission is still live here (the registry ended it
        without an abort) supersedes it: the old one is aborted in the engine and its
        outputs never reach the new one.

        :raises EngineUnavailable: no session is up, or the link's queue is full.
        :raises PayloadTooLarge: the message would exceed what the engine accepts.
        :raises UnencodableRequest: the codec cannot encode a request (422).
        """
        self._check_up()
        encode_payload = self._codec.encode
        entries = []
        for rid, request in requests:
            try:
                payload = encode_payload(request)
            except Exception as exc:  # (the codec's own error, whatever its type)
                raise UnencodableRequest(rid, exc) from exc
            entries.append((next(self._submissions), rid, payload))
        if len(entries) > MAX_ENTRIES:
            self._counts["too_large"] += 1
            raise PayloadTooLarge(len(entries), MAX_ENTRIES, unit="submissions")
        frame = encode(Submit(self._seq_out, entries))
        if len(frame) > self._limit:
            self._counts["too_large"] += 1
            raise PayloadTooLarge(len(frame), self._limit)
        if not self._send_frame(frame):
            raise EngineUnavailable("the link to the engine is full", retry_after=self._retry_after)
        live = self._live
        submission_of = self._submission_of
        for sid, rid, _ in entries:
            former = submission_of.get(rid)
            if former is not None:
                self._abort_submission(former)
            live[sid] = rid
            submission_of[rid] = sid
        self._counts["submitted"] += len(entries)

    def on_abort(self, rid: str) -> None:
        """The registry's ``on_abort``: tell the engine, batched per loop tick."""
        sid = self._submission_of.get(rid)
        if sid is not None:
            self._abort_submission(sid)

    def stats(self) -> EngineClientStats:
        """A frozen snapshot of the counters."""
        return EngineClientStats(ready=self._up, in_flight=len(self._live), **self._counts)

    # -- internals ----------------------------------------------------------------------

    def _require_registry(self) -> tether.Registry:
        if self._registry is None:
            raise RuntimeError("call EngineClient.start(registry) or running(registry) first")
        return self._registry

    def _check_up(self) -> None:
        if self._loop is not None:  # (before start, the refusal below says why)
            require_loop(self._loop, "EngineClient.open()/submit()")
        if not self._up:
            raise EngineUnavailable(self._why_down, retry_after=self._retry_after)

    def _end(self, sid: int) -> str | None:
        """The one way a submission stops being live here; its rid, if it was."""
        rid = self._live.pop(sid, None)
        if rid is not None and self._submission_of.get(rid) == sid:
            del self._submission_of[rid]
        return rid

    def _abort_submission(self, sid: int) -> None:
        if self._end(sid) is None:
            return
        self._aborts.append(sid)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_aborts)

    def _send_frame(self, frame: bytes) -> bool:
        """Send one frame of the session; ``False`` if the link cannot take it now."""
        if self._socket is None:
            return False
        try:
            send_nowait(self._socket, [frame])
        except zmq.Again:
            return False
        self._seq_out += 1
        return True

    def _send(self, message: Message) -> bool:
        return self._send_frame(encode(message))

    def _flush_aborts(self) -> None:
        self._flush_scheduled = False
        sids, self._aborts = self._aborts, []
        if not sids or not self._up:
            return  # (with no session, the engine's next session start cancels them all)
        per_message = max(1, min(MAX_ENTRIES, (self._limit - 64) // 9))  # (an id: 9 bytes)
        for start in range(0, len(sids), per_message):
            if not self._send(Abort(self._seq_out, sids[start : start + per_message])):
                self._go_down("the link to the engine is full")
                return
        self._counts["aborts_sent"] += len(sids)

    def _hello(self) -> None:
        if self._broken is not None:
            return
        self._attempt += 1
        self._awaited = self._attempt  # (only a hello said may be welcomed)
        self._last_hello = time.monotonic()
        self._seq_out = 0
        self._send(Hello(0, PROTOCOL_VERSION, self.incarnation, self._attempt, self._max_message))

    def _go_down(self, why: str, *, hello: bool = True) -> None:
        """The session ended: fail every request in flight once, then say hello again."""
        was_up, self._up = self._up, False
        self._why_down = why
        self._ready.clear()
        if was_up and hello:
            self._counts["links_lost"] += 1
            # (kinds apart, as the engine's: losses failing nothing, however many, never
            # spend the throttle of a loss that fails live requests)
            lines, level = (
                (self._loss_lines, logging.WARNING)
                if self._live
                else (self._leave_lines, logging.INFO)
            )
            lines.log(
                logger,
                level,
                "engine link lost (%s): failing %d requests",
                why,
                len(self._live),
            )
        live = self._live
        self._live = {}
        self._submission_of.clear()
        self._aborts.clear()
        if live and self._registry is not None:
            self._counts["failed_on_loss"] += len(live)
            fail = self._registry.fail
            for rid in live.values():
                fail(rid, EngineLost(f"the link to the engine was lost: {why}"))
        if hello and self._socket is not None:
            # Not again before ``hello_interval``: an engine that ends each session as
            # soon as it opens (a gap, a refusal) would spin this front otherwise. The
            # tick says the next hello; a welcome to the last one, or to an attempt never
            # said, opens nothing now.
            self._awaited = None
            soon = time.monotonic() - self._last_hello < self._hello_interval
            if was_up:
                self._paced = soon  # (a reconnect's hello waits too: _on_event)
            if not soon:
                self._hello()

    def _on_fault(self, exc: Exception) -> None:
        # A message this end could not handle may have been half-applied: no request
        # may be left waiting on it, so the session ends (its requests fail, 503).
        self._fault_lines.log(
            logger,
            logging.ERROR,
            "tether_zmq: a message from the engine could not be handled",
            exc_info=exc,
        )
        self._counts["malformed"] += 1
        self._go_down(f"a message from the engine could not be handled: {exc!r}")

    def _on_event(self, event: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            self._go_down("the engine disconnected")
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self._up and not self._pacing():
            self._hello()

    def _pacing(self) -> bool:
        """Whether a reconnect's hello must wait for the tick: the last session ended
        within hello_interval of its hello (an engine that drops each connection it
        welcomes), and hello_interval has not passed since the last hello."""
        return self._paced and time.monotonic() - self._last_hello < self._hello_interval

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._ping_interval)
            self._judge()

    def _judge(self) -> None:
        """Ping, or judge the engine silent: only after reading what is waiting, and
        only counting the time since a ping went out unanswered."""
        assert self._reader is not None
        if self._reader.drain():
            return  # more is waiting: the engine is not silent
        now = time.monotonic()
        if self._up:
            pending = self._unanswered_since
            if pending is not None and now - pending > self._engine_timeout:
                self._go_down(f"no word from the engine for {self._engine_timeout:g}s")
            elif not self._send(Ping(self._seq_out, now)):
                self._go_down("the link to the engine is full")
            elif pending is None:
                self._unanswered_since = now
        elif now - self._last_hello >= self._hello_interval:
            self._hello()

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self._counts["malformed"] += 1
            return
        try:
            # (no session: nothing to end, so a Step's headers are never walked to tell
            # TooManyEntries; an over-long one fails at its header, one decode a frame)
            message = decode_at_front(frames[0], measure=self._up)
        except msgspec.DecodeError:  # (a frame for the other direction fails on its tag)
            self._counts["malformed"] += 1
            return
        except TooManyEntries as exc:  # (no honest engine sends one: it splits its steps)
            self._counts["malformed"] += 1
            if self._up:
                self._go_down(f"the engine sent {exc}")
            return
        if not self._up:
            self._on_handshake(message)
            return
        if message.seq != self._seq_in:
            if isinstance(message, Refuse):
                self._go_down(f"the engine ended the session: {quoted(message.reason)}")
            else:
                self._go_down(f"sequence gap: expected {self._seq_in}, got {message.seq}")
            return
        self._seq_in += 1
        self._unanswered_since = None
        if isinstance(message, Step):
            self._on_step(message)
        elif isinstance(message, Ping):
            self._send(Pong(self._seq_out, message.sent))
        elif isinstance(message, Refuse):
            self._go_down(f"the engine ended the session: {quoted(message.reason)}")

    def _on_handshake(self, message: Message) -> None:
        """No session: only the answer to our latest hello counts; the rest is stale."""
        if isinstance(message, Refuse):
            if message.version != PROTOCOL_VERSION:
                why = f"the engine speaks protocol v{message.version}, not v{PROTOCOL_VERSION}"
                self._refused(why, f"engine refused the hello: {quoted(message.reason)}")
            elif message.reason.startswith(HELLO_TOO_LARGE):
                # (hellos go on, for an engine restarted with a larger cap)
                why = f"the engine refused this front's hello: {quoted(message.reason)}"
                self._refused(why, f"engine refused the hello: {quoted(message.reason)}")
            else:
                self._why_down = f"the engine refused a session: {quoted(message.reason)}"
        elif isinstance(message, Welcome) and message.attempt == self._awaited:
            if message.version != PROTOCOL_VERSION:
                why = f"the engine speaks protocol v{message.version}, not v{PROTOCOL_VERSION}"
                self._refused(why, f"engine welcome with protocol v{message.version}: ignored")
                return
            if message.max_message < MIN_MESSAGE:
                self._counts["malformed"] += 1
                self._why_down = f"the engine's max_message={message.max_message} is unusable"
                return
            self._up = True
            self._awaited = None
            self._paced = False
            self._seq_in = 1
            self._unanswered_since = None
            self._limit = min(self._max_message, message.max_message)
            self._engine = clip(message.engine, MAX_NAME)  # (kept for the whole session)
            self._counts["sessions"] += 1
            self._said.clear()  # (a refusal after this session is news again)
            self._held.clear()
            self._ready.set()

    def _refused(self, why: str, line: str) -> None:
        """A hello refused for a reason saying it again cannot change: counted at each
        refusal, logged once per reason until a session comes up (a hello goes every
        ``hello_interval`` while down, and the engine reconnects after each restart:
        a line each time would flood the log for as long as the mismatch lasts), and
        new reasons no faster than the throttle lets them (an engine picks its text)."""
        self._counts["refused"] += 1
        self._why_down = why
        said, held = self._said, self._held
        if why in said:
            return
        # (a reason already held back is one line unsaid, however often it comes again)
        if not self._refusal_lines.log(logger, logging.ERROR, "%s", line, count=why not in held):
            _remember(held, why)
            return
        held.pop(why, None)
        _remember(said, why)

    def _on_step(self, step: Step) -> None:
        registry = self._registry
        assert registry is not None
        live = self._live
        decode_payload = self._codec.decode
        items: list[tuple[str, Any, bool]] = []
        broken: list[str] = []
        late = 0
        for sid, payload, finished in step.outputs:
            rid = live.get(sid)
            if rid is None:
                late += 1  # aborted here, or superseded: never another request's
                continue
            try:
                items.append((rid, decode_payload(payload), finished))
            except Exception:
                self._end(sid)
                broken.append(rid)
                continue
            if finished:
                self._end(sid)
        self._counts["outputs"] += len(items)
        self._counts["steps"] += 1
        registry.deliver_many(items)
        for rid in broken:
            self._counts["malformed"] += 1
            registry.fail(rid, RemoteFailure("an output could not be decoded", 502))
        for sid, text, status in step.failures:
            rid = self._end(sid)
            if rid is None:
                late += 1
                continue
            registry.fail(rid, RemoteFailure(clip(text, MAX_FAILURE_TEXT), status))
        self._counts["late_outputs"] += late


def _remember(reasons: dict[str, None], why: str) -> None:
    """Add ``why`` to ``reasons``, forgetting the oldest past :data:`_REMEMBERED_REFUSALS`."""
    if why not in reasons and len(reasons) >= _REMEMBERED_REFUSALS:
        del reasons[next(iter(reasons))]
    reasons[why] = None


def _nothing() -> None:
    """The front has nothing to do once a batch of messages is read."""
