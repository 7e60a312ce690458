"""Observers: how metrics, traces and logs learn of a request's life without a hot path.

An :class:`Observer` attached to a registry (``Registry.add_observer``) hears three
things per request: it opened (in the handler, so the caller's context, such as
the incoming HTTP span, is current), its first output arrived (once), and it
ended, with one frozen :class:`RequestEnd` that says how and how long it took.
Nothing is called per output: a collector reads the registry's counters at scrape
time and keeps only what a counter cannot give (histogram buckets, open spans).

Observers must be cheap and must not raise; one that raises is logged and the
request goes on (the producer never sees it). The end of a request is also logged,
one line at DEBUG on the ``tether.requests`` logger, whether or not any observer
is attached; nothing is logged per output.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from typing import NamedTuple

from ._errors import TetherError
from ._scope import RequestScope
from ._state import RequestState

__all__ = [
    "Observer",
    "Outcome",
    "RequestEnd",
    "announce_end",
    "announce_first_output",
    "announce_open",
    "observe_end",
    "opened",
    "request_logger",
]

logger = logging.getLogger("tether")

request_logger = logging.getLogger("tether.requests")
"""One DEBUG line per ended request: rid, request id, outcome, timings."""


class Outcome(enum.StrEnum):
    """How a request ended."""

    FINISHED = "finished"
    """The producer delivered its last output."""
    FAILED = "failed"
    """The producer failed it (``fail()``, ``fail_all()``, a ``merge`` that raised)."""
    ABORTED = "aborted"
    """It was closed before it finished; :attr:`RequestEnd.reason` says why."""


class RequestEnd(NamedTuple):
    """What an observer learns when one request (or one sub-request) ends.

    A named tuple, not a frozen dataclass: one is built per request whenever an
    observer is attached, and a frozen dataclass costs several times as much to build.

    :param rid: the request id (tether's own, server-side).
    :param outcome: finished, failed or aborted.
    :param reason: the :class:`~tether.AbortReason` value of an aborted request, else ``None``.
    :param error: the error its consumer gets, ``None`` when it finished.
    :param request_id: the client's ``X-Request-Id`` label, if its adapter took one.
    :param batch_index: its index in its batch, ``None`` for a single request.
    :param time_to_first_output: seconds from ``open()`` to the first output, or
        ``None`` when no output arrived.
    :param total_time: seconds from ``open()`` to the end.
    :param outputs: how many outputs the producer delivered to it (folded ones too).
    """

    rid: str
    outcome: Outcome
    reason: str | None
    error: TetherError | None
    request_id: str | None
    batch_index: int | None
    time_to_first_output: float | None
    total_time: float
    outputs: int = 0


class Observer:
    """Hooks called by a registry at the edges of a request's life; override any.

    Every hook runs on the registry's loop, synchronously, and must return quickly.
    ``on_end`` runs inside the table's end path, before the consumer is woken and
    before ``on_abort``: it must not call back into the registry.
    """

    __slots__ = ()

    def on_open(self, rids: Sequence[str], *, batch: bool, request_id: str | None) -> None:
        """Requests were registered: one (``batch`` false) or a batch's, in index order.

        Called in the opening handler's context (contextvars, e.g. its HTTP span).
        """

    def on_first_output(self, rid: str, elapsed: float) -> None:
        """The first output of ``rid`` arrived, ``elapsed`` seconds after it opened."""

    def on_end(self, end: RequestEnd) -> None:
        """A request ended (each sub-request of a batch, separately)."""


def observe_end(
    observers: Sequence[Observer],
    state: RequestState,
    error: TetherError | None,
    reason: str | None,
    total: float,
) -> float:
    """Log and announce that ``state`` ended with ``error`` (``None``: finished) under
    ``reason`` (``None``: not an abort) after ``total`` seconds; returns ``total``.

    Costs one check when no observer is attached and DEBUG is off."""
    debug = request_logger.isEnabledFor(logging.DEBUG)
    if observers or debug:
        end = _end_of(state, error, reason, total)
        if debug:
            _log_end(end)
        announce_end(observers, end)
    return total


def _end_of(
    state: RequestState, error: TetherError | None, reason: str | None, total: float
) -> RequestEnd:
    if error is None:
        outcome = Outcome.FINISHED
    elif reason is None:
        outcome = Outcome.FAILED
    else:
        outcome = Outcome.ABORTED
    first_at = state.first_at
    return RequestEnd(
        state.rid,
        outcome,
        None if reason is None else str(reason),
        error,
        state.request_id,
        None if state.group is None else state.index,
        first_at - state.opened_at if first_at else None,
        total,
        state.noutputs,
    )


def opened(
    observers: Sequence[Observer],
    states: Sequence[RequestState],
    scope: RequestScope | None,
    *,
    batch: bool,
) -> None:
    """``states`` were registered in ``scope``: stamp them with its request id (the
    client's label), and tell the observers."""
    request_id = None if scope is None else scope.request_id
    if request_id is not None:
        for state in states:
            state.label(request_id)
    if observers:
        rids = [state.rid for state in states]
        announce_open(observers, rids, batch=batch, request_id=request_id)


def announce_open(
    observers: Sequence[Observer], rids: Sequence[str], *, batch: bool, request_id: str | None
) -> None:
    """Call every observer's ``on_open``; one that raises is logged and skipped."""
    for observer in observers:
        try:
            observer.on_open(rids, batch=batch, request_id=request_id)
        except Exception:
            logger.exception("observer %r raised in on_open; ignored", observer)


def announce_first_output(observers: Sequence[Observer], rid: str, elapsed: float) -> None:
    """Call every observer's ``on_first_output``; one that raises is logged and skipped."""
    for observer in observers:
        try:
            observer.on_first_output(rid, elapsed)
        except Exception:
            logger.exception("observer %r raised in on_first_output; ignored", observer)


def announce_end(observers: Sequence[Observer], end: RequestEnd) -> None:
    """Call every observer's ``on_end``; one that raises is logged and skipped."""
    for observer in observers:
        try:
            observer.on_end(end)
        except Exception:
            logger.exception("observer %r raised in on_end; ignored", observer)


def _log_end(end: RequestEnd) -> None:
    """One line per ended request: readable as text, and structured for a JSON
    formatter under the record's ``tether`` attribute."""
    ttfo = end.time_to_first_output
    request_logger.debug(
        "request ended rid=%s request_id=%s outcome=%s reason=%s "
        "time_to_first_output=%s total_time=%.6f",
        end.rid,
        end.request_id or "-",
        end.outcome,
        end.reason or "-",
        "-" if ttfo is None else f"{ttfo:.6f}",
        end.total_time,
        extra={
            "tether": {
                "rid": end.rid,
                "request_id": end.request_id,
                "outcome": str(end.outcome),
                "reason": end.reason,
                "batch_index": end.batch_index,
                "time_to_first_output": ttfo,
                "total_time": end.total_time,
            }
        },
    )
