"""How a request ends: the :class:`End` value that the table's one end path takes.

An end is finished (no error), failed (a :class:`~tether.ProducerError`) or aborted
(an :class:`~tether.Aborted`, whose reason is what gets counted), with how far it
reaches in a batch (:class:`Reach`) and whether the producer must hear of it
through ``on_abort``. Deciding the end is the caller's; carrying it out is
``Table.end``'s alone.
"""

from __future__ import annotations

import enum
from typing import Final

from ._errors import Aborted, AbortReason, TetherError, WrongLoop

__all__ = [
    "ALONE",
    "FINISHED",
    "SIBLINGS",
    "WHOLE",
    "End",
    "Reach",
    "failed_sibling",
    "wrong_loop",
]

FAILED_SIBLING: Final = AbortReason.FAILED_SIBLING


class Reach(enum.Enum):
    """Which requests an :class:`End` reaches beyond the ones it is given."""

    ALONE = "alone"
    """Only those."""
    SIBLINGS = "siblings"
    """A failure decided for one sub-request: its batch's live siblings are aborted
    (``failed_sibling``), unless the batch keeps going."""
    WHOLE = "whole"
    """A consumer's abort: a batch read whole (or not yet read) ends whole."""


ALONE: Final = Reach.ALONE
SIBLINGS: Final = Reach.SIBLINGS
WHOLE: Final = Reach.WHOLE


class End:
    """How requests end, the one value :meth:`Table.end` takes: finished (no
    ``error``), failed (a :class:`~tether.ProducerError`) or aborted (an
    :class:`~tether.Aborted`, whose ``reason`` is counted).

    :param error: what their consumers get; ``None``: they finished.
    :param reach: see :class:`Reach`.
    :param tell: call ``on_abort`` for them (not when the producer knows: it
        finished or failed them); the requests an end pulls in are always told.
    """

    __slots__ = ("error", "reach", "reason", "tell")

    def __init__(
        self, error: TetherError | None, reach: Reach = ALONE, *, tell: bool = True
    ) -> None:
        self.error = error
        self.reach = reach
        self.reason = error.reason if isinstance(error, Aborted) else None
        self.tell = tell


FINISHED: Final = End(None, tell=False)
"""The producer delivered the last output."""


def failed_sibling(rid: str, failed: str, error: TetherError) -> Aborted:
    """How a sub-request ends when ``failed``, another of its batch, ended first with
    ``error`` (its ``__cause__``): aborted, reason ``failed_sibling``."""
    aborted = Aborted(
        rid,
        FAILED_SIBLING,
        f"request {rid!r} was aborted: request {failed!r} of its batch ended first "
        f"({type(error).__name__})",
    )
    aborted.__cause__ = error
    return aborted


def wrong_loop() -> WrongLoop:
    """What a consumer read on another loop than its requests' raises."""
    return WrongLoop(
        "a Stream or Batch is read on another event loop than the one its request "
        "was opened on: read it where it was opened"
    )
