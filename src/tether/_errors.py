"""The one error tree of tether.

Every error the core raises derives from :class:`TetherError`::

    TetherError
    ├── DuplicateRequest (KeyError)   open() with a rid that is still live
    ├── UnknownRequest (KeyError)     a server's own lookup by id found no live rid
    ├── InvalidRequest (ValueError)   a request the registry cannot take as given:
    │   │                             an empty batch, repeated ids, a bad timeout
    │   └── InvalidRequestId          a rid that is no valid id
    ├── BatchTooLarge (ValueError)    open_batch() larger than ``max_in_flight``:
    │                                 it could never be admitted, so no retry helps
    ├── Overloaded                    open() beyond ``max_in_flight``
    ├── RegistryClosed                open() after ``Registry.close()`` began
    ├── WrongLoop (RuntimeError)      the registry called from another thread or
    │                                 event loop, or with no loop running
    ├── ConcurrentRead (RuntimeError) a second task read a Stream or Batch that
    │                                 another task is reading
    ├── Aborted                       the request was closed before it finished;
    │   │                             ``reason`` says why (an :class:`AbortReason`)
    │   ├── RequestTimeout (TimeoutError)  its deadline passed
    │   └── ConsumerTooSlow               more than ``max_pending`` outputs (or
    │                                     ``max_pending_bytes``) waited
    └── ProducerError                 the producer called ``Registry.fail()``

Consumers (``Stream``/``Batch``) raise these from ``__anext__``, ``result()`` and
``next_ready()``; the producer-side methods of ``Registry`` never raise for an
unknown rid (they return ``False`` and count a late output instead).
"""

from __future__ import annotations

import enum
import re
from typing import Final

__all__ = [
    "MAX_RID_LENGTH",
    "NOBODY_READS",
    "AbortReason",
    "Aborted",
    "BatchTooLarge",
    "ConcurrentRead",
    "ConsumerTooSlow",
    "DuplicateRequest",
    "InvalidRequest",
    "InvalidRequestId",
    "Overloaded",
    "ProducerError",
    "RegistryClosed",
    "RequestTimeout",
    "TetherError",
    "UnknownRequest",
    "WrongLoop",
    "check_rid",
    "client_facing",
    "declared_status",
]


class AbortReason(enum.StrEnum):
    """Why a request was closed before its producer finished it."""

    CLIENT_DISCONNECTED = "client_disconnected"
    """The HTTP client went away (set by the adapters through ``RequestScope``)."""
    CANCELLED = "cancelled"
    """The consumer closed the stream early, or its task was cancelled."""
    TIMEOUT = "timeout"
    """The per-request deadline passed."""
    CONSUMER_TOO_SLOW = "consumer_too_slow"
    """More than ``max_pending`` outputs waited and no ``merge`` was given."""
    SERVER = "server"
    """``Registry.abort()`` was called, or ``Registry.close()`` drained out."""
    FAILED_SIBLING = "failed_sibling"
    """Another sub-request of the same batch failed."""


NOBODY_READS: Final = frozenset({AbortReason.CLIENT_DISCONNECTED, AbortReason.CANCELLED})
"""The abort reasons that mean nobody reads the request any more (its client left, or
its reader stopped): nothing more is written, a resumable stream is parked."""


class TetherError(Exception):
    """Base class of every error raised by tether."""


class DuplicateRequest(TetherError, KeyError):
    """Raised by ``Registry.open()``/``open_batch()`` for a rid that is still live."""

    def __init__(self, rid: str) -> None:
        super().__init__(f"request id {rid!r} is already in flight; pass rid=None for a fresh id")
        self.rid = rid

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class UnknownRequest(TetherError, KeyError):
    """For a server's own lookups by id: raise it when a client names a rid that is not
    in flight (an abort endpoint, say); ``error_response`` maps it to 404.

    tether's producer-side methods never raise it: they return ``False`` and count a
    late output instead.
    """

    def __init__(self, rid: str) -> None:
        super().__init__(f"request id {rid!r} is not in flight (finished, aborted or never opened)")
        self.rid = rid

    def __str__(self) -> str:
        return str(self.args[0])


MAX_RID_LENGTH: Final = 256
"""The longest request id ``Registry.open()`` accepts, in characters."""


class InvalidRequest(TetherError, ValueError):
    """Raised by ``Registry.open()``/``open_batch()`` for a request it cannot take as
    given: an empty batch, the same id twice in a batch, a timeout that is not a
    positive number. ``error_response`` maps it to 422: these usually come from the
    client."""


class InvalidRequestId(InvalidRequest):
    """Raised by ``Registry.open()``/``open_batch()`` for a rid that is not a valid id:
    not a string, empty, longer than :data:`MAX_RID_LENGTH`, or holding a control
    character or a lone surrogate (which no JSON encoder or log line takes safely).
    ``error_response`` maps it to 422: a rid usually comes from the client.
    """

    def __init__(self, rid: object, why: str) -> None:
        shown = repr(rid) if len(repr(rid)) <= 80 else repr(rid)[:77] + "..."
        super().__init__(f"invalid request id {shown}: {why}; pass rid=None for a fresh id")
        self.rid = rid


_UNSAFE_IN_RID = re.compile("[\\x00-\\x1f\\x7f-\\x9f\\ud800-\\udfff]")
"""Control characters (log and header injection) and lone surrogates (no encoder takes them)."""


def check_rid(rid: object) -> None:
    """Refuse a client-chosen request id that is not a valid id.

    :raises InvalidRequestId: ``rid`` is not a ``str``, is empty, is longer than
        ``MAX_RID_LENGTH``, or holds a control character or a lone surrogate.
    """
    if not isinstance(rid, str):
        raise InvalidRequestId(rid, f"a request id is a str, not {type(rid).__name__}")
    if not rid:
        raise InvalidRequestId(rid, "a request id cannot be empty")
    if len(rid) > MAX_RID_LENGTH:
        raise InvalidRequestId(rid, f"a request id has at most {MAX_RID_LENGTH} characters")
    if _UNSAFE_IN_RID.search(rid) is not None:
        raise InvalidRequestId(rid, "a control character or a lone surrogate is not allowed")


class BatchTooLarge(TetherError, ValueError):
    """Raised by ``Registry.open_batch()`` for a batch of more sub-requests than
    ``max_in_flight``: it could never be admitted, however long the client waits.
    ``error_response`` maps it to 413 (no ``Retry-After``: a retry cannot help).
    """

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"a batch of {size} sub-requests can never be admitted: max_in_flight={limit}; "
            "split it into batches of at most that size"
        )
        self.size = size
        self.limit = limit


class Overloaded(TetherError):
    """Raised by ``Registry.open()`` when ``max_in_flight`` requests are already live."""

    def __init__(self, limit: int, *, retry_after: float = 1.0) -> None:
        super().__init__(
            f"{limit} requests are already in flight (max_in_flight={limit}); retry later"
        )
        self.limit = limit
        self.retry_after = retry_after


class RegistryClosed(TetherError):
    """Raised by ``Registry.open()`` once ``Registry.close()`` has begun."""

    def __init__(self) -> None:
        super().__init__("the registry is closed (server shutting down); no new requests")


class WrongLoop(TetherError, RuntimeError):
    """Raised when the registry, or one of its consumers, is used outside the event
    loop its requests run on: from another thread (a sync FastAPI dependency runs in
    a thread pool), from a second event loop, or with no loop running. Nothing was
    changed; the message says what to call instead."""


class ConcurrentRead(TetherError, RuntimeError):
    """Raised to a task that reads a :class:`~tether.Stream` or :class:`~tether.Batch`
    (``result()``, ``async for``, ``next_ready()``) while another task is reading it.

    The refusal leaves the first reader undisturbed: it reads on as if the second
    had never asked. Read each consumer from one task; to share a result, await it in
    one task and hand the value on.
    """

    def __init__(self, consumer: object) -> None:
        super().__init__(
            f"{consumer!r} is already being read by another task; read a stream or a "
            "batch from one task at a time (await result() once and share the value)"
        )


class Aborted(TetherError):
    """Raised to the consumer of a request that was closed before it finished."""

    def __init__(self, rid: str, reason: AbortReason, message: str | None = None) -> None:
        super().__init__(message or f"request {rid!r} was aborted: {reason.value}")
        self.rid = rid
        self.reason = reason


class RequestTimeout(Aborted, TimeoutError):
    """Raised to the consumer when the request's deadline (``open(timeout=...)``) passed."""

    def __init__(self, rid: str, timeout: float) -> None:
        super().__init__(
            rid,
            AbortReason.TIMEOUT,
            f"request {rid!r} did not finish within its timeout of {timeout:g}s",
        )
        self.timeout = timeout


class ConsumerTooSlow(Aborted):
    """Raised to a consumer that let more than ``max_pending`` outputs, or more than
    ``max_pending_bytes`` bytes of them, wait (``max_bytes`` says which).

    Pass ``merge=`` to the ``Registry`` to combine waiting outputs instead.
    """

    def __init__(self, rid: str, max_pending: int, *, max_bytes: int | None = None) -> None:
        if max_bytes is None:
            message = (
                f"request {rid!r}: more than max_pending={max_pending} outputs waited for the "
                "consumer; read faster, raise max_pending or give the Registry a merge function"
            )
        else:
            message = (
                f"request {rid!r}: more than max_pending_bytes={max_bytes} bytes of outputs "
                "waited for the consumer; read faster or raise max_pending_bytes"
            )
        super().__init__(rid, AbortReason.CONSUMER_TOO_SLOW, message)
        self.max_pending = max_pending
        self.max_bytes = max_bytes


class ProducerError(TetherError):
    """Raised to the consumer when the producer called ``Registry.fail(rid, exc)``.

    The producer's exception is ``__cause__``. Its text is *not* part of this error's
    message, which clients may see (``tether.error_response``): a producer's exception
    can hold database URLs, paths or secrets. A cause that declares itself
    client-facing, with an ``int`` ``status_code`` from 400 to 499 (a prompt too long,
    say), lends its text to the message; any other stays in ``__cause__``, for logs:
    ``error_response`` logs it at ERROR, or at the lower ``log_level`` (an ``int``) it
    declares (a failure its producer expects and already logged, once for many).
    """

    def __init__(self, rid: str, cause: BaseException) -> None:
        message = f"request {rid!r} failed in the producer"
        if client_facing(cause):
            try:
                message = f"request {rid!r} was refused by the producer: {cause}"
            except Exception:  # the cause's own __str__ failed: keep the plain message
                pass
        super().__init__(message)
        self.rid = rid
        self.__cause__ = cause


def declared_status(cause: BaseException | None) -> int | None:
    """The HTTP status ``cause`` declares (an ``int`` ``status_code`` from 400 to 599),
    or ``None``; a ``status_code`` that raises when read declares nothing."""
    try:
        status = getattr(cause, "status_code", None)
    except Exception:
        return None
    if isinstance(status, int) and not isinstance(status, bool) and 400 <= status <= 599:
        return status
    return None


def client_facing(cause: BaseException) -> bool:
    """Whether ``cause`` declares itself the client's fault (a 4xx ``status_code``),
    so that its text may be shown to the client."""
    status = declared_status(cause)
    return status is not None and status < 500
