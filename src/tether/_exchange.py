"""Exchange: one HTTP response from a ``Stream`` or ``Batch``, and its one write loop.

The exchange decides the status line (which waits for the first output, so that a
failure before it gets a real status rather than a 200 followed by an error event),
frames every ready output into one chunk, pings when idle, and ends with one error
event and the terminal frame when the request fails after the stream has started.
:meth:`Exchange.run` writes the response through a :class:`Writer`, the few writes
an adapter's framework offers: each write is bounded by the send timeout (a client
that stopped reading counts as gone), a handler cancelled by its server still ends
its response (the farewell), and where the framework can write without waiting
(:meth:`Writer.direct`) the producer's step writes what it delivers itself; a write
it began but could not finish there (:class:`~tether.http.Stepped`) is the first thing
the write loop finishes.

Departure, on purpose: the write loop is not the framework's. Adapters hand their
writes in; they keep no loop, no framing and no error mapping of their own.
"""

from __future__ import annotations

import abc
import asyncio
import copy
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol, cast

from ._batch import Batch
from ._encoders import SSE, Encoder, default_dumps
from ._errors import NOBODY_READS, Aborted, AbortReason, TetherError
from ._framing import Framer, error_inline
from ._guard import SendGuard
from ._responses import DEFAULT_SEND_TIMEOUT, JSON_HEADERS, TOKEN_HEADER, Head, error_response
from ._scope import RequestScope
from ._stream import Stream

__all__ = [
    "FAREWELL_TIMEOUT",
    "Direct",
    "Exchange",
    "Numbered",
    "Writer",
    "error_head",
    "server_ended",
]

logger = logging.getLogger("tether")

_now = time.monotonic  # read once per producer-side write: cheaper than the loop's time()

WOKEN_IN_PLACE: Final = 4
"""Woken waits a stream's write loop does in the handler's task before it goes on in a
task of its own (:meth:`Exchange.run`): a short stream pays for no task."""

FAREWELL_TIMEOUT: Final = 1.0
"""Seconds the last write of a response whose handler the server cancelled may take:
enough for a client that reads, short for one that stopped."""

_SSE: Final = SSE()
"""The default framing, shared: an encoder holds no state of its own response."""


def error_head(exc: BaseException) -> Head:
    """The whole answer to a failure before the status line: its status and JSON body
    (:func:`error_response`), for an adapter to send as it is."""
    response = error_response(exc)
    return Head(response.status, {**JSON_HEADERS, **response.headers}, default_dumps(response.body))


def _ended_by_server(rid: str) -> Aborted:
    return Aborted(rid, AbortReason.SERVER, "the server ended the request")


def server_ended(rid: str = "-") -> Head:
    """The whole answer to a request whose handler the server cancelled before its
    status line went out (a shutdown whose grace period ran out): a JSON 503."""
    return error_head(_ended_by_server(rid))


class Numbered(abc.ABC):
    """A source whose outputs come as ``(event id, output)`` pairs: a resumable stream's
    follower (:class:`tether.resume.Follower`). The exchange streams it with event ids,
    names its error event ``error`` and sends its token (:data:`TOKEN_HEADER`).

    Its ``cancel`` aborts the request, as a stream's does; :meth:`detach` is how its
    client leaves without ending it (the stream is parked for a reconnect).
    """

    __slots__ = ()

    @property
    @abc.abstractmethod
    def rid(self) -> str:
        """The request id of the stream followed."""

    @property
    @abc.abstractmethod
    def token(self) -> str:
        """The stream's resume token."""

    @property
    @abc.abstractmethod
    def finished(self) -> bool:
        """Whether this client is done with the stream (nothing for a scope to end)."""

    @property
    @abc.abstractmethod
    def exhausted(self) -> bool:
        """Whether everything was handed out and the stream ended cleanly."""

    @abc.abstractmethod
    def ready(self) -> list[Any] | None:
        """Every event ready now; ``[]`` if none yet; ``None`` at the end."""

    @abc.abstractmethod
    async def wait_ready(self, *, timeout: float | None = None) -> None:
        """Wait until an event or the end is ready, or ``timeout`` passed."""

    @abc.abstractmethod
    async def next_ready(self, *, timeout: float | None = None) -> list[Any] | None:
        """:meth:`ready`, waiting (up to ``timeout``: then ``[]``) for one if none is."""

    @abc.abstractmethod
    async def result(self) -> Any:
        """A resumable stream is only streamed: :class:`TypeError`."""

    @abc.abstractmethod
    def cancel(self, reason: AbortReason = AbortReason.CANCELLED) -> bool:
        """Abort the request followed; whether it was live."""

    @abc.abstractmethod
    def detach(self, reason: AbortReason = AbortReason.CLIENT_DISCONNECTED) -> bool:
        """This client leaves (the stream is parked); a reason outside
        :data:`~tether.NOBODY_READS` aborts instead. Whether a request was aborted."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Detach this client (idempotent)."""


class Direct(Protocol):
    """A write that never waits, where a framework offers one (aiohttp's transport), or
    one driven a step at once (an ASGI ``send``: :class:`~tether.http.Stepped`)."""

    def writable(self) -> bool:
        """Whether a write now goes out at once (nothing queued, the connection open)."""

    def write(self, chunk: bytes) -> bool | Awaitable[object]:
        """Write ``chunk`` now if :meth:`writable`; ``False`` (nothing written) if not; or
        the write begun, which the writing task awaits before it writes anything else
        (or closes, if the response is cut: nothing more of it is written).

        A writer may also offer ``write_checked(chunk)``, the same write when
        :meth:`writable` said ``True`` just now, in this synchronous step: the write
        of each event from the producer's step asks :meth:`writable` before it encodes,
        and calls that rather than ask twice (:class:`~tether.http.Stepped` offers it).
        It is used only where the class defines it beside, or below, the ``write`` it
        uses: a subclass that overrides ``write`` alone sees every write through it."""


class _CheckedDirect(Direct, Protocol):
    def write_checked(self, chunk: bytes) -> bool | Awaitable[object]: ...


def _checked(direct: Direct | None) -> _CheckedDirect | None:
    """``direct``, if its class offers ``write_checked`` no less derived than the
    ``write`` it uses (a subclass or a wrapper that overrides ``write`` sees every write
    go through it). Looked up on the class, never on the instance: no ``__getattr__``
    is asked."""
    for cls in type(direct).__mro__:
        defined = vars(cls)
        if "write_checked" in defined:
            return cast(_CheckedDirect, direct) if callable(defined["write_checked"]) else None
        if "write" in defined:
            return None
    return None


class Writer(Protocol):
    """The writes of one response, as its framework offers them, for :meth:`Exchange.run`.

    ``start`` and ``write`` return the framework's awaitable (no coroutine of their
    own on the hot path); the exchange bounds each one by the send timeout.
    """

    lost_when_cut: bool
    """Whether a write cut by cancellation wrote nothing (uvicorn cancels in the wait
    for flow control, before writing): the farewell then sends its bytes again."""

    def start(self) -> Awaitable[object]:
        """Send the status line and headers the response was built with."""

    def write(self, chunk: bytes, last: bool) -> Awaitable[object]:
        """Send ``chunk``; ``last``: it ends the body."""

    async def answer(self, head: Head) -> None:
        """Send ``head`` as the whole response instead (nothing was started)."""

    def drop(self) -> None:
        """The client stopped reading: drop its connection where the framework can."""

    def direct(self) -> Direct | None:
        """The write that never waits, once started, if the framework has one (or its
        own write, driven a step at a time: :class:`~tether.http.Stepped`)."""


class Exchange:
    """Drives one HTTP response from a :class:`~tether.Stream` or :class:`~tether.Batch`.

    :param source: what to answer with (a resumable stream's follower: its outputs
        carry event ids, its error event is named ``error``).
    :param streaming: stream every output (``True``) or answer with one JSON body.
    :param encoder: the streaming framing; :class:`~tether.SSE` by default.
    :param ping_interval: seconds of silence after which a keep-alive is sent.
    :param send_timeout: seconds one write of the response may wait for a client
        that stopped reading (the server's writes blocked by flow control); past it,
        the client counts as gone: the request is aborted and freed, the
        connection dropped where the framework allows. ``None`` waits for ever.
    :param transform: turns what is answered into the value written: the result
        (``streaming=False``; a batch's: the list of results) or each output. Its
        errors fail the request as an unencodable output does.
    :param scope: the request's scope, told when the client is found gone.
    :raises ValueError: a non-positive ``ping_interval`` or ``send_timeout`` (the
        source is aborted: the exchange owns it from the start).
    :raises RuntimeError: ``source`` was answered already, or closed (a response
        takes a stream once; the one that has it keeps it).
    """

    __slots__ = (
        "_begun",
        "_begun_chunk",
        "_body",
        "_checked",
        "_direct",
        "_done",
        "_framer",
        "_guard",
        "_last",
        "_numbered",
        "_sunk_at",
        "encoder",
        "ping_interval",
        "scope",
        "send_timeout",
        "source",
        "streaming",
    )

    def __init__(
        self,
        source: Stream | Batch | Numbered,
        *,
        streaming: bool,
        encoder: Encoder | type[Encoder] | None = None,
        ping_interval: float = 15.0,
        send_timeout: float | None = DEFAULT_SEND_TIMEOUT,
        transform: Callable[[Any], Any] | None = None,
        scope: RequestScope | None = None,
    ) -> None:
        encoder = answer_encoder(source, streaming, encoder, ping_interval, send_timeout, transform)
        numbered = isinstance(source, Numbered)
        self.source = source
        self.streaming = streaming
        self.encoder: Encoder = encoder
        self.ping_interval = ping_interval
        self.send_timeout = send_timeout
        self.scope = scope
        """The request's scope, told when the client is found gone."""
        # A resumable stream's outputs come with their event ids (see _resume).
        self._numbered = numbered
        # (a one-shot JSON answer writes once: no send timeout's guard unless asked for)
        self._guard: SendGuard | None = SendGuard(send_timeout) if streaming else None
        batch = isinstance(source, Batch)
        inline = isinstance(source, Batch) and source.keep_going  # (errors stand inline)
        self._framer = Framer(encoder, indexed=batch, errors_inline=inline, numbered=numbered)
        self._done = False
        self._direct: Direct | None = None
        self._checked: _CheckedDirect | None = None  # the same writer, if it offers that
        self._sunk_at: float | None = None  # when the sink last wrote (monotonic)
        # A write the sink began and the write loop finishes before anything else:
        self._begun: Awaitable[object] | None = None
        self._begun_chunk = b""
        self._body = b""  # the chunk being written (run()), until its write returns
        self._last = False  # whether that chunk is the last

    @property
    def done(self) -> bool:
        """Whether the response has nothing more to send: the one end signal.

        After :meth:`start`: the head's body is the whole response (answer it with
        a plain, sized response). Later: the last chunk was handed out.
        """
        return self._done

    def _error_head(self, exc: BaseException) -> Head:
        self._done = True
        return error_head(exc)

    async def start(self, *, head_only: bool = False) -> Head:
        """Wait until the status line is known and return it with the first bytes.

        Non-streaming: waits for the result. Streaming: waits for the first outputs,
        or the ping interval, whichever comes first. Errors raised by the source
        before that become an error status with a JSON body; so does an output the
        encoder cannot serialise (500, and the work is aborted). A stream that is
        already over is answered whole, terminal frame included (:attr:`done`).

        :param head_only: a HEAD request: nobody will read the body, so the work is
            aborted now (the producer is told through ``on_abort``) and the head
            carries the headers a GET would start with, status 200 and no body.
        """
        if head_only:
            await self.aclose()
            return Head(200, self._success_headers(), b"")
        if not self.streaming:
            self._done = True
            return await answer_whole(self.source, self.encoder)
        try:
            items = await self.source.next_ready(timeout=self.ping_interval)
        except TetherError as exc:
            return self._error_head(exc)
        encoder = self.encoder
        headers = self._success_headers()
        first = encoder.preamble()
        if items is None:
            self._done = True
            return Head(200, headers, first + encoder.terminal())
        if not items:
            return Head(200, headers, first + encoder.ping())
        framer = self._framer
        try:
            chunk = framer.some(items)
        except Exception as exc:
            return self._unencodable_head(exc)
        if framer.carry is None and self.source.exhausted:
            self._done = True
            return Head(200, headers, first + chunk + encoder.terminal())
        return Head(200, headers, first + chunk if first else chunk)

    def _unencodable(self, exc: Exception) -> None:
        _abort_unencodable(self.source, exc)

    def _unencodable_head(self, exc: Exception) -> Head:
        self._unencodable(exc)
        return self._error_head(exc)

    def _success_headers(self) -> dict[str, str]:
        if not self.streaming:
            return dict(JSON_HEADERS)
        encoder = self.encoder
        media_type = encoder.media_type
        if media_type.startswith("text/"):
            media_type += "; charset=utf-8"  # (tether's frames are UTF-8, always)
        headers = {"content-type": media_type, **{k.lower(): v for k, v in encoder.headers.items()}}
        source = self.source
        if isinstance(source, Numbered):
            headers[TOKEN_HEADER] = source.token
        return headers

    async def next_chunk(self) -> bytes:
        """The next bytes to write, while not :attr:`done`: every ready output in one
        chunk, a ping after ``ping_interval`` of silence, the terminal frame at the end
        (or one error event and the terminal frame on failure). For a writer that pulls
        (:meth:`run` is the loop that pushes).

        A client disconnect ends the response quietly (``b""``, and :attr:`done`):
        nobody is reading.
        """
        chunk = self._ready_chunk()
        if chunk is None:
            await self.source.wait_ready(timeout=self.ping_interval)
            chunk = self._waited_chunk()
        return chunk

    def _ready_chunk(self) -> bytes | None:
        """The next bytes if they are ready now (outputs, the end, an error), without
        waiting; ``None`` when the loop has to wait."""
        if self._done:
            return b""
        framer = self._framer
        items = framer.carry
        if items is not None:
            framer.carry = None
        else:
            try:
                items = self.source.ready()
            except TetherError as exc:
                return self._failed(exc)
            if items is None:
                self._done = True
                return self.encoder.terminal()
            if not items:  # (no `== []`: no list built per poll)
                return None
        try:
            chunk = framer.some(items)
        except Exception as exc:
            self._unencodable(exc)
            return self._failed(exc)
        if framer.carry is None and self.source.exhausted:
            # The last outputs and the terminal frame go out in one write.
            self._done = True
            return chunk + self.encoder.terminal()
        return chunk

    def _waited_chunk(self) -> bytes:
        chunk = self._ready_chunk()
        return self.encoder.ping() if chunk is None else chunk

    def _failed(self, exc: Exception) -> bytes:
        """The end of a stream that failed after its start: one error event and the
        terminal frame; nothing when its client left (nobody reads)."""
        self._done = True
        if isinstance(exc, Aborted) and exc.reason in NOBODY_READS:
            return b""
        encoder = self.encoder
        return encoder.error(error_response(exc).body, event=self._error_event) + encoder.terminal()

    @property
    def _error_event(self) -> str | None:
        # A resumable stream names its error event: a reconnecting client tells it apart.
        return "error" if self._numbered else None

    async def run(self, writer: Writer, first: bytes) -> None:
        """Write the whole response through ``writer``: the status line and headers,
        ``first`` (the head's body), then every chunk until :attr:`done`; the source is
        closed at the end, however it ends.

        Each write is bounded by ``send_timeout``: past it the client counts as gone
        (the scope is told, the connection dropped, and this returns). A write that
        fails with :class:`ConnectionError` means the client left (this returns). A
        cancellation from elsewhere (the server's shutdown) ends the response first
        (:meth:`_farewell`), then goes on: ``CancelledError`` is raised again.

        A stream whose task is woken for each event goes on, after a few, in a task of
        its own (:data:`WOKEN_IN_PLACE`): each event then resumes the loop's own
        frames, not every frame of the application above the response. That task is
        awaited here, and a cancellation of this one is its cancellation.
        """
        guard = self._guard
        if guard is None:
            guard = self._guard = SendGuard(self.send_timeout)
        started = False
        self._body, self._last = b"", False
        pumping: asyncio.Task[bool] | None = None
        try:
            guard.begin()
            await writer.start()
            guard.end()
            started = True
            self._direct = direct = writer.direct()
            self._checked = _checked(direct)
            pump = self._pump(writer, first, framed=True, in_place=WOKEN_IN_PLACE)
            del first  # (the pump's to write and let go: an idle stream holds no chunk)
            if await pump:
                loop = asyncio.get_running_loop()
                pumping = loop.create_task(self._pump(writer, None, framed=False, in_place=-1))
                await pumping
        except ConnectionError:  # aiohttp's ClientConnectionResetError, ASGI 2.4's OSError
            self._gone()
        except asyncio.CancelledError:
            if pumping is not None and pumping.done() and not pumping.cancelled():
                # Its task had ended the response (written whole, or the client gone)
                # before the cancellation came: nothing to say farewell to.
                if isinstance(pumping.exception(), ConnectionError):
                    self._gone()
                raise
            if guard.stalled_out():
                # The send timeout cut a write: the client read nothing for it.
                logger.warning(
                    "%r: the client read nothing for %gs; it counts as gone (as a disconnect)",
                    self.source,
                    self.send_timeout,
                )
                self._gone()
                writer.drop()
                return
            cut = self._abandon_begun()  # (a write begun in the sink was the one cut)
            await self._farewell(writer, started, self._body if cut is None else cut, self._last)
            raise
        finally:
            await self.aclose()

    async def _pump(
        self, writer: Writer, body: bytes | None, *, framed: bool, in_place: int
    ) -> bool:
        """The write loop: write ``body`` (``None``: wait first), then every chunk until
        :attr:`done` (``False``), or ``True`` before the woken wait past ``in_place``
        (``-1``: never), to go on in a task of its own. ``framed``: ``body`` goes
        through the framework's write (it may hold the head)."""
        guard = self._guard
        assert guard is not None
        direct = self._direct
        framer = self._framer
        source = self.source
        # (a batch read whole, or a resumable stream's follower: no sink)
        stream = source if direct is not None and type(source) is Stream else None
        # The hot loop: per chunk, one write and (only when nothing is ready) one
        # wait; the send timeout is bookkeeping around the write, not a coroutine.
        # (Methods are called, not held as bound methods in locals: a frame that
        # lives as long as its stream would keep one object per method, idle or not.)
        ping_interval = self.ping_interval
        while True:
            if body is not None:
                last = self._done
                written = False if framed or last or direct is None else direct.write(body)
                if written is not True:
                    guard.begin()
                    try:
                        await (writer.write(body, last) if written is False else written)
                    except BaseException:  # (for run(): the chunk it cut; no cost otherwise)
                        self._body, self._last = body, last
                        raise
                    guard.end()
                    framed = False
                if last:
                    return False
                body = None  # (written: not kept alive while the stream idles)
            if direct is None and framer.carry is None and not self._done:
                # Woken for each output: wait first (a wait with something ready
                # returns at once), so one poll per chunk, not two.
                if in_place == 0:
                    return True
                in_place -= 1
                try:
                    await source.wait_ready(timeout=ping_interval)
                except TetherError as exc:  # (another task reads: as ready() would say)
                    body = self._failed(exc)
                    continue
                chunk = self._ready_chunk()
            else:
                chunk = self._ready_chunk()
                if chunk is None:
                    if stream is not None and direct is not None and direct.writable():
                        chunk = await self._parked(stream, guard)
                    else:
                        if in_place == 0:
                            return True
                        in_place -= 1
                        await source.wait_ready(timeout=ping_interval)
                    if chunk is None:
                        chunk = self._ready_chunk()
            if chunk is None:  # (the wait timed out: silence)
                chunk = self.encoder.ping()
            body, chunk = chunk, None  # (only body holds it: let go once written)

    def _gone(self) -> None:
        """The client is gone: the work is aborted as for a disconnect."""
        self._done = True
        if self.scope is not None:
            self.scope.disconnect()
        else:
            self._leave(AbortReason.CLIENT_DISCONNECTED)

    def _leave(self, reason: AbortReason) -> None:
        """Nobody reads this response any more: its work is aborted (a resumable
        stream's follower only detaches: the stream is parked for a reconnect)."""
        source = self.source
        if isinstance(source, Numbered):
            source.detach(reason)
        else:
            source.cancel(reason)

    async def _parked(self, stream: Stream, guard: SendGuard) -> bytes | None:
        """Wait while the producer's step writes what it delivers (:meth:`_sink`): what
        is ready once the task is woken, or ``None`` when a keep-alive is due, after
        ``ping_interval`` of silence since the sink's last write (not since parking).
        The task wakes for the end, an error, a ping, once the transport holds bytes
        back (the sink declines: the outputs wait for this loop, in order), or to
        finish a write the sink began (then it parks again)."""
        now = _now
        interval = timeout = self.ping_interval
        self._last_sink_write()  # (earlier writes do not count)
        while True:
            if not stream.set_sink(self._sink):
                await stream.wait_ready(timeout=timeout)
                return None
            try:
                await stream.wait_ready(timeout=timeout)
            finally:
                stream.set_sink(None)
            begun = self._begun
            if begun is not None:
                guard.begin()  # (bounded by the send timeout, like any write)
                await begun
                guard.end()
                self._begun, self._begun_chunk = None, b""  # (written: nothing kept)
                self._sunk_at = now()
            ready = self._ready_chunk()
            sunk_at = self._last_sink_write()
            if ready is not None or sunk_at is None:
                return ready
            timeout = sunk_at + interval - now()
            if timeout <= 0:
                return None

    def _abandon_begun(self) -> bytes | None:
        """The response is cut: a write the sink began is closed, never finished; its
        chunk, if there was one (``None``: none was pending)."""
        begun, self._begun = self._begun, None
        if begun is None:
            return None
        close = getattr(begun, "close", None)
        if close is not None:
            try:
                close()
            except Exception as exc:  # (a write that would not stop: nothing more to do)
                logger.debug("%r: a begun write did not close: %r", self.source, exc)
        return self._begun_chunk

    def _last_sink_write(self) -> float | None:
        """When the sink last wrote (monotonic time) since this was last asked, if it did."""
        sunk_at, self._sunk_at = self._sunk_at, None
        return sunk_at

    def _sink(self, outputs: list[Any]) -> bool:
        """The stream's sink (``Stream.set_sink``), in the producer's step: write
        ``outputs`` now if the direct write is still possible; ``False`` (nothing
        written, never an end or an abort) hands them back to the write loop."""
        direct = self._direct
        framer = self._framer
        if (
            direct is None
            or self._done
            or framer.carry is not None
            or self._begun is not None
            or not direct.writable()  # (before encoding: declined outputs are shaped once)
        ):
            return False
        try:
            chunk = framer.encode(outputs)
        except Exception:  # the write loop meets it again, and fails the request there
            return False
        # (writable() said yes above: a writer that offers write_checked is not asked
        # again; write() asks itself, and a decline, rare, wastes one encoding)
        checked = self._checked
        written = direct.write(chunk) if checked is None else checked.write_checked(chunk)
        if written is False:
            return False
        self._sunk_at = _now()
        if written is not True:
            # Begun (suspended, or failed): the write loop finishes it before anything
            # else. A sink that removes itself has the reading task woken for it.
            self._begun, self._begun_chunk = written, chunk
            source = self.source
            if isinstance(source, Stream):
                source.set_sink(None)
        return True

    async def _farewell(self, writer: Writer, started: bool, unsent: bytes, last: bool) -> None:
        """End the response of a cancelled handler (the server's shutdown), best effort
        and bounded by :data:`FAREWELL_TIMEOUT`: the work is aborted now, and the client,
        still there, is told that the server ended its request (503): the whole JSON
        answer if nothing was started, else one error event and the terminal frame."""
        self._done = True
        source = self.source
        self._leave(AbortReason.CANCELLED)
        try:
            async with asyncio.timeout(FAREWELL_TIMEOUT):
                if not started:
                    await writer.answer(server_ended(self._rid))
                    return
                unsent = unsent if writer.lost_when_cut else b""
                await writer.write(unsent if last else unsent + self._goodbye(), True)
        except Exception as exc:  # best effort: the cancellation is what goes on
            logger.debug("%r: the end of a cancelled response was not sent: %r", source, exc)

    @property
    def _rid(self) -> str:
        source = self.source
        return source.rids[0] if isinstance(source, Batch) else source.rid

    def _goodbye(self) -> bytes:
        """Whatever the exchange held and the source has ready, then the terminal frame:
        after one error event (503) unless the request had finished (all of it is here)."""
        framer = self._framer
        held = framer.take_carry() or []
        try:
            held += self.source.ready() or []
        except Exception:  # (it ended badly: what matters now is the end)
            pass
        try:
            body = framer.encode(held) if held else b""
        except Exception:  # unencodable: what matters now is the end
            body = b""
        encoder = self.encoder
        if self.source.exhausted:
            return body + encoder.terminal()
        error = error_response(_ended_by_server(self._rid)).body
        return body + encoder.error(error, event=self._error_event) + encoder.terminal()

    async def aclose(self) -> None:
        """End the response: whatever is unfinished is aborted and freed (idempotent).

        It never waits: the source is freed synchronously and an asynchronous
        ``on_abort`` runs as a task the registry owns and bounds. So adapters call it
        in a ``finally`` even while their task is being cancelled.
        """
        self._done = True
        if self._guard is not None:
            self._guard.close()
        self._abandon_begun()
        await self.source.aclose()


_READ_WHOLE: Final = (Stream, Batch)
"""(A tuple of types, not ``Stream | Batch``: that builds a union object at each call.)"""


def answer_encoder(
    source: Stream | Batch | Numbered,
    streaming: bool,
    encoder: Encoder | type[Encoder] | None,
    ping_interval: float,
    send_timeout: float | None,
    transform: Callable[[Any], Any] | None,
) -> Encoder:
    """The encoder of an answer from ``source`` with these options (an
    :class:`Exchange`'s), once they are checked: see the exchange's ``:raises:``."""
    numbered = not isinstance(source, _READ_WHOLE)  # (no ABC check for them)
    if numbered and not isinstance(source, Numbered):
        raise TypeError(f"expected a tether Stream or Batch, got {type(source).__name__}")
    if isinstance(source, _READ_WHOLE) and not source.claim():
        # (it would answer an empty success, or take outputs from the first response)
        raise RuntimeError(
            f"{source!r} was already answered or closed; a response takes a stream "
            "once: open another stream for another response"
        )
    if encoder is None:
        encoder = _SSE
    elif isinstance(encoder, type):
        encoder = encoder()
    bad = None
    if numbered and not (streaming and encoder.has_event_ids):
        bad = "a resumable stream is streamed with event ids: streaming=True and SSE"
    elif not ping_interval > 0:
        bad = f"ping_interval must be positive, got {ping_interval}"
    elif send_timeout is not None and not send_timeout > 0:
        bad = f"send_timeout must be positive or None, got {send_timeout}"
    if bad is not None:
        # the answer owned the source all the same: nothing is left open
        source.cancel()
        raise ValueError(bad)
    return encoder if transform is None else _shaped(encoder, transform, streaming=streaming)


async def answer_whole(source: Stream | Batch | Numbered, encoder: Encoder) -> Head:
    """The one JSON body answering ``source`` (``streaming=False``): its result (a
    batch's results in order, an error standing in place as its error body), or the
    failure's status and JSON body (:func:`error_head`); a result that ``encoder``
    cannot serialise is a 500, and the work is aborted. ``source`` is left open."""
    try:
        result = await source.result()
    except TetherError as exc:
        return error_head(exc)
    if isinstance(source, Batch) and source.keep_going:  # (a stream's list is its own)
        result = [error_inline(item) for item in result]
    try:
        body = encoder.dumps(result)
    except Exception as exc:
        _abort_unencodable(source, exc)
        return error_head(exc)
    return Head(200, dict(JSON_HEADERS), body)


def _abort_unencodable(source: Stream | Batch | Numbered, exc: Exception) -> None:
    logger.error("%r: an output could not be encoded; the request is aborted", source, exc_info=exc)
    source.cancel(AbortReason.SERVER)


def _shaped(encoder: Encoder, transform: Callable[[Any], Any], *, streaming: bool) -> Encoder:
    """``encoder`` with ``transform`` applied to each output (streaming), or to the
    result before it is serialised (one JSON body, written with ``dumps``)."""
    if streaming:
        return encoder.shaped(transform)
    shaped = copy.copy(encoder)
    dumps = encoder.dumps
    shaped.dumps = lambda result: dumps(transform(result))
    return shaped
