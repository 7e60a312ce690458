"""The default store of resumable streams: their channels in this process, and the
pump task per stream that reads it into its channel (see ``_resume``)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import secrets
from collections.abc import Coroutine
from typing import Any, Final

from ._errors import Aborted, AbortReason, TetherError
from ._resume_log import Channel, Follower
from ._stream import Stream

logger = logging.getLogger("tether")

__all__ = ["MemoryStore", "new_token"]

_TOKEN_BYTES: Final = 16
"""128 random bits per resume token."""


def new_token() -> str:
    """A fresh resume token: 128 random bits, URL-safe, with no ``.`` in it."""
    return secrets.token_urlsafe(_TOKEN_BYTES)


class MemoryStore:
    """The logs of resumable streams in this process (the default store).

    Owns the pump task of each stream it holds; :meth:`aclose` cancels and awaits them.
    """

    __slots__ = ("_channels", "_tasks")

    def __init__(self) -> None:
        self._channels: dict[str, Channel] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        """How many streams are resumable now."""
        return len(self._channels)

    @property
    def parked(self) -> int:
        """How many of them have no client now (each waits out its grace period)."""
        return sum(channel.follower is None for channel in self._channels.values())

    def open(
        self, stream: Stream, grace: float, max_events: int, max_bytes: int | None = None
    ) -> Follower:
        """Start recording ``stream``; the follower of its first client."""
        token = new_token()
        channel = Channel(
            self,
            stream.rid,
            token,
            grace=grace,
            max_events=max_events,
            abort=stream.cancel,
            max_bytes=max_bytes,
        )
        self._channels[token] = channel
        follower = Follower(channel, 0)
        channel.attach(follower)
        self.spawn(_pump(channel, stream))
        return follower

    async def opened(self, follower: Follower) -> None:
        """``follower``'s stream was just opened: a shared store publishes its token
        before the client can see it; nothing to do in one process."""

    def spawn(self, job: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``job`` as a task this store owns (:meth:`aclose` cancels and awaits it),
        in a context of its own: it belongs to no HTTP request's scope."""
        task = asyncio.get_running_loop().create_task(job, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def channel(self, token: str) -> Channel | None:
        """The channel of ``token`` if this process holds it."""
        return self._channels.get(token) if token else None

    # Hooks for a store shared between processes; nothing to do in one.
    def recorded(self, channel: Channel, outputs: list[Any]) -> None:
        """``outputs`` were appended to ``channel``."""

    def ended(self, channel: Channel) -> None:
        """``channel``'s stream ended."""

    def attached(self, channel: Channel, follower: Follower) -> None:
        """``follower`` is ``channel``'s client now."""

    def respite(self, channel: Channel) -> float:
        return 0.0  # (a client of this process can always come back)

    def detached(self, channel: Channel, follower: Follower) -> None:
        """``follower``, ``channel``'s client, left."""

    async def follow(self, token: str, after: int) -> Follower | None:
        """A new client of the stream of ``token`` after event ``after``, or ``None``."""
        channel = self._channels.get(token) if token else None
        if channel is None or not channel.first - 1 <= after <= channel.count:
            return None
        follower = Follower(channel, after)
        channel.attach(follower)
        return follower

    async def cancel(self, token: str) -> bool:
        """Abort the stream of ``token`` now and forget it; whether it was known."""
        channel = self._channels.get(token) if token else None
        if channel is None:
            return False
        self.forget(channel)
        if not channel.ended:
            channel.abort(AbortReason.CANCELLED)
        follower = channel.follower
        if follower is not None:
            follower.detach(AbortReason.CANCELLED)
        return True

    def holds(self, channel: Channel) -> bool:
        """Whether ``channel`` is still resumable here."""
        return self._channels.get(channel.token) is channel

    def forget(self, channel: Channel) -> None:
        """Make ``channel`` resumable no more."""
        if self._channels.get(channel.token) is channel:
            del self._channels[channel.token]
        channel.disarm()

    def abort_all(self) -> None:
        """Forget every log and abort every stream still running (reason ``server``)."""
        for channel in list(self._channels.values()):
            self.forget(channel)
            if not channel.ended:
                channel.abort(AbortReason.SERVER)

    async def aclose(self) -> None:
        """Abort every stream still recorded, forget every log, end every task."""
        self.abort_all()
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


async def _pump(channel: Channel, stream: Stream) -> None:
    """Read ``stream`` into ``channel`` until it ends, whoever is attached. Outputs the
    store cannot record (a copy that cannot encode them) abort the request, as an
    output its response cannot write does: its clients are told, never left waiting."""
    try:
        while (outputs := await stream.next_ready()) is not None:
            channel.append(outputs)
    except TetherError as exc:
        channel.end(exc)
    except Exception as exc:  # (the store's: recording them failed)
        logger.error(
            "%r: outputs could not be recorded; the request is aborted", stream, exc_info=exc
        )
        stream.cancel(AbortReason.SERVER)
        channel.end(Aborted(channel.rid, AbortReason.SERVER, "an output could not be recorded"))
    except asyncio.CancelledError:  # the store is closing: the stream was aborted
        channel.end(Aborted(channel.rid, AbortReason.SERVER, "the server is shutting down"))
        raise
    else:
        channel.end(None)
    finally:
        await stream.aclose()
