"""What crosses the link's two APIs besides messages: request keys, engine events, stats."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

__all__ = [
    "Cancellation",
    "EngineClientStats",
    "EngineServerStats",
    "Event",
    "RequestKey",
    "Submission",
]


class RequestKey(NamedTuple):
    """A request as the engine knows it: the front it came from (its incarnation, as
    it named itself), its rid there, and ``submission``, a number this engine gives
    each submission and never gives again. Keys are unique on the submission alone:
    a rid reused by its front, a restarted front, or a peer naming itself after
    another front all get keys that no message about an older request can match."""

    front: bytes
    rid: str
    submission: int


@dataclasses.dataclass(frozen=True, slots=True)
class Submission:
    """A new request: ``request`` is the payload the front submitted, decoded."""

    key: RequestKey
    request: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Cancellation:
    """Stop working on ``key``: ``reason`` is ``"aborted"`` (the front closed it:
    client gone, deadline, cancel) or ``"front_lost"`` (the front died, hung, or
    opened a new session). Sent at most once per request."""

    key: RequestKey
    reason: str


Event = Submission | Cancellation


@dataclasses.dataclass(frozen=True, slots=True)
class EngineServerStats:
    """A snapshot of the engine end's counters.

    :param fronts: fronts with a session now.
    :param stalled: the engine loop has left its events untaken for
        ``consumer_timeout``: every session was ended and hellos are refused until
        it takes them again.
    :param in_flight: requests live on every front together.
    :param late_outputs: outputs or failures sent for a request no longer live.
    :param late_aborts: aborts for a request no longer live.
    :param malformed: frames that were no message of the protocol, dropped.
    :param no_session: messages from a peer without a session (told to say hello).
    :param refused: hellos refused for a protocol version mismatch.
    :param fronts_lost: sessions ended by a front's death, silence, gap or new hello.
    :param too_large: outputs that could not fit one message (their request failed),
        and frames past ``max_message`` from a front (their submissions refused, 413).
    :param refused_submissions: submissions refused at the door (undecodable, a
        submission id reused, too large); each one's front was told.
    :param stalls: times the engine loop was found not taking its events.
    """

    fronts: int
    stalled: bool
    in_flight: int
    submitted: int
    cancelled: int
    late_outputs: int
    late_aborts: int
    malformed: int
    no_session: int
    refused: int
    fronts_lost: int
    too_large: int
    refused_submissions: int
    stalls: int


@dataclasses.dataclass(frozen=True, slots=True)
class EngineClientStats:
    """A snapshot of a front's link counters.

    :param ready: a session is up: submissions are accepted.
    :param in_flight: requests submitted and not yet ended.
    :param steps: step messages received (one per engine step, more past ``max_message``).
    :param sessions: sessions opened (1 + reconnections).
    :param links_lost: sessions that ended under this front (kill, hang, gap).
    :param failed_on_loss: requests failed because their session ended.
    :param malformed: frames that were no message of the protocol, dropped.
    :param refused: refusals of this front's hello received from the engine (another
        protocol version, a hello too large; a welcome of another version), each one
        counted, however many one hello draws.
    :param late_outputs: outputs or failures for a submission no longer live here
        (aborted, or superseded by a new submission of its rid), dropped.
    :param too_large: submissions refused here for exceeding the engine's cap (413).
    """

    ready: bool
    in_flight: int
    submitted: int
    aborts_sent: int
    outputs: int
    steps: int
    sessions: int
    links_lost: int
    failed_on_loss: int
    malformed: int
    refused: int
    late_outputs: int
    too_large: int
