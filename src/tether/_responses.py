"""What an exception becomes on the wire: the one shared mapping to a status and JSON body.

Both adapters, and any adapter written for another framework, answer a failure
with :func:`error_response`: the status (``Overloaded`` → 503 with ``Retry-After``,
``RequestTimeout`` → 504, a client disconnect → 499, ...) and a body in one shape,
``{"error": {"message", "type", "code"}}``. What a client may read of a failure is
decided here too: exceptions outside tether's tree are an internal error without
their text, and a producer's exception text is logged, never sent, unless it
declares itself client-facing (see :class:`~tether.ProducerError`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Final

from ._errors import (
    NOBODY_READS,
    Aborted,
    BatchTooLarge,
    ConsumerTooSlow,
    DuplicateRequest,
    InvalidRequest,
    Overloaded,
    ProducerError,
    RegistryClosed,
    RequestTimeout,
    TetherError,
    UnknownRequest,
    declared_status,
)

__all__ = [
    "CLIENT_CLOSED_REQUEST",
    "DEFAULT_SEND_TIMEOUT",
    "JSON_HEADERS",
    "TOKEN_HEADER",
    "ErrorResponse",
    "Head",
    "error_body",
    "error_response",
]

logger = logging.getLogger("tether")

CLIENT_CLOSED_REQUEST: Final = 499
"""The status logged for a request whose client left (nobody reads it)."""

DEFAULT_SEND_TIMEOUT: Final = 30.0
"""Seconds one write may wait for a client that stopped reading (see :class:`Exchange`)."""

JSON_HEADERS: Final = {"content-type": "application/json"}

TOKEN_HEADER: Final = "tether-resume-token"
"""The response header that carries a resumable stream's token (and the request
header a reconnect may carry it in)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorResponse:
    """What an exception becomes on the wire.

    :param status: the HTTP status code.
    :param body: ``{"error": {"message": ..., "type": ..., "code": status}}``.
    :param headers: extra headers (``Retry-After`` for 503s that can be retried).
    """

    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def _status_of(exc: BaseException) -> tuple[int, dict[str, str]]:
    if isinstance(exc, Overloaded):
        return 503, {"retry-after": str(max(1, math.ceil(exc.retry_after)))}
    if isinstance(exc, RegistryClosed):
        return 503, {"retry-after": "1"}
    if isinstance(exc, RequestTimeout):
        return 504, {}
    if isinstance(exc, ConsumerTooSlow):
        return 503, {}
    if isinstance(exc, Aborted):
        if exc.reason in NOBODY_READS:
            return CLIENT_CLOSED_REQUEST, {}
        return 503, {}
    if isinstance(exc, DuplicateRequest):
        return 409, {}
    if isinstance(exc, UnknownRequest):
        return 404, {}
    if isinstance(exc, BatchTooLarge):
        return 413, {}
    if isinstance(exc, InvalidRequest):
        return 422, {}
    if isinstance(exc, ProducerError):
        # A producer may reject a request for the client's fault (a prompt too
        # long, say) by failing it with an exception carrying a 4xx status_code.
        return declared_status(exc.__cause__) or 500, {}
    return 500, {}


def _log_level(cause: BaseException | None) -> int:
    """The level a producer's exception declares for its line (a plain ``int``, kept
    between DEBUG and ERROR: lower, never hidden), else ERROR: one whose ``log_level``
    raises, or is no plain int, declares nothing, and none can raise its line above
    ERROR."""
    try:
        level = getattr(cause, "log_level", logging.ERROR)
    except Exception:
        return logging.ERROR
    if type(level) is int:  # (exactly: a bool or an int subclass declares nothing)
        return max(logging.DEBUG, min(level, logging.ERROR))
    return logging.ERROR


def error_body(exc: BaseException, status: int) -> dict[str, Any]:
    """The JSON error body for ``exc``: ``{"error": {"message", "type", "code"}}``.

    Exceptions outside tether's tree are reported as an internal error without
    their message, which may hold server details; so is a producer's exception
    behind a :class:`~tether.ProducerError`, unless it declares itself client-facing
    (see :class:`~tether.ProducerError`).
    """
    if isinstance(exc, TetherError):
        message, kind = str(exc), type(exc).__name__
    else:
        message, kind = "internal server error", "InternalError"
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(exc: BaseException) -> ErrorResponse:
    """Map an exception to its status, JSON body and headers (the one shared mapping).

    ``Overloaded`` and ``RegistryClosed`` → 503 with ``Retry-After``;
    ``RequestTimeout`` → 504; ``ConsumerTooSlow`` and server aborts → 503;
    client disconnects → 499; ``DuplicateRequest`` → 409; ``UnknownRequest`` → 404;
    ``ProducerError`` → 500, or its cause's ``status_code`` when that is 4xx/5xx;
    ``BatchTooLarge`` → 413; ``InvalidRequest`` (``InvalidRequestId`` among them) → 422;
    anything else → 500.

    A producer's exception that the body does not show is logged here (``tether``
    logger, with its traceback), so that the detail the client is spared is not lost:
    at ERROR, unless the exception declares a lower ``log_level`` (an ``int``; a
    failure its producer expects and logs itself, once for many requests, such as a
    lost link's).
    """
    status, headers = _status_of(exc)
    if isinstance(exc, ProducerError) and status >= 500:
        # The text, not the error: a kept log record must not keep its traceback's frames.
        cause = exc.__cause__
        logger.log(_log_level(cause), "%s (the client sees no detail)", str(exc), exc_info=cause)
    return ErrorResponse(status, error_body(exc, status), headers)


@dataclasses.dataclass(frozen=True, slots=True)
class Head:
    """How a response starts.

    :param status: the HTTP status.
    :param headers: lower-case header names to values.
    :param body: the first bytes of the body; the whole body when the exchange is
        :attr:`~Exchange.done` once it returned this head.
    """

    status: int
    headers: dict[str, str]
    body: bytes
