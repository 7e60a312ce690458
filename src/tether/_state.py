"""Mailboxes: where a request's outputs wait for its consumer.

A :class:`RequestState` is a rid's table entry and, for a single request, the
mailbox its consumer reads. The sub-requests of a batch share one :class:`Group`
instead: their outputs wait there as ``(index, output)`` pairs, in arrival order,
and one future wakes the batch. Each mailbox owns what is done to it: ``put`` (the
producer's output, folded by ``merge`` or bounded by the :class:`Limits`, or into
the result in collect mode), ``take`` (everything ready, for the consumer),
``collect``/``uncollect`` (``result()``'s mode), ``park``/``wake`` (the one
future a waiting consumer parks on) and ``close`` (the request's end, which the
table's one end path calls). No other module writes their fields.

Neither mailbox refers to its consumer or to the table, so a consumer dropped
without being closed is freed by reference counting and its ``__del__`` can clean
up. Both use ``__slots__`` and make no reference cycle (the cyclic collector is a
large share of the cost at ten thousand live requests); a group and its states
refer to each other until its last sub-request ends.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final, Protocol, TypeVar

from ._errors import Aborted, TetherError
from ._limits import Limits
from ._mailbox import NOTHING, Mailbox

logger = logging.getLogger("tether")

Sink = Callable[[list[Any]], object]
"""A sink as the state holds it: typed ``bool`` for its user, trusted for nothing more
(an answer that is no ``bool`` is read by ``_answer_of``)."""

__all__ = ["NOTHING", "Group", "Mailbox", "RequestState", "route"]

T = TypeVar("T")


class Group(Mailbox):
    """The shared mailbox of a batch's sub-requests.

    ``pending`` holds ``(index, output)`` pairs (less those of ``dropped`` indices,
    left out at the next ``take``). ``gen`` counts how often the
    consumer took ``pending``: a state whose ``gen`` differs has nothing in the
    current list. The batch is read one way or the other, decided by the first
    read: ``whole`` once the batch itself was read; ``split`` once one of its
    sub-streams was, after which each state is its own mailbox.
    """

    __slots__ = (
        "dropped",
        "error",
        "errors",
        "gen",
        "keep_going",
        "live",
        "pending",
        "remaining",
        "split",
        "states",
        "timer",
        "whole",
    )

    def __init__(self, rids: Sequence[str], opened_at: float, *, keep_going: bool) -> None:
        super().__init__()
        # () once all ended (RequestState.close): the group <-> states cycle is broken
        self.states: Sequence[RequestState] = [
            RequestState(rid, index, self, opened_at) for index, rid in enumerate(rids)
        ]
        self.remaining = len(rids)
        self.keep_going = keep_going
        self.pending: list[tuple[int, Any]] = []
        self.dropped: set[int] | None = None  # aborted indices whose pairs take() leaves out
        self.gen = 0
        self.live = True
        self.error: TetherError | None = None
        self.errors: dict[int, TetherError] | None = None  # per index, made on the first
        self.split = False
        self.whole = False
        self.timer: asyncio.TimerHandle | None = None

    def arm(self, timer: asyncio.TimerHandle) -> None:
        """The batch's deadline, cancelled when its last sub-request ends."""
        self.timer = timer

    def read_whole(self) -> None:
        """The batch itself is read (not its sub-streams)."""
        self.whole = True

    def fail_whole(self, error: TetherError) -> None:
        """Its consumer ended the batch read whole: reading it raises ``error``."""
        self.error = error

    def ended(self) -> None:
        """One more sub-request ended; after the last, the batch ends."""
        self.remaining -= 1
        if self.remaining == 0:
            self.live = False
            # Break the group <-> states cycle: a finished batch is freed by
            # reference counting, not left to the cyclic garbage collector.
            self.states = ()
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None

    def put(self, state: RequestState, output: Any, limits: Limits) -> bool:
        """Append (or fold) one of ``state``'s outputs; ``False`` if over a limit."""
        pairs = self.pending
        if state.gen != self.gen:
            state.gen = self.gen
            state.npending = 1
            state.nbytes = 0
            state.pos = len(pairs)
            pairs.append((state.index, output))
        elif limits.merge is not None:
            pos = state.pos
            pairs[pos] = (state.index, limits.merge(pairs[pos][1], output))
            state.npending += 1
            if not state.weigh(output, limits):
                return False
        elif state.npending < limits.max_pending:
            state.npending += 1
            state.pos = len(pairs)
            pairs.append((state.index, output))
            if not state.weigh(output, limits):
                return False
        else:
            return False
        self.wake()
        return True

    def take(self) -> list[tuple[int, Any]]:
        """Hand every waiting pair to the consumer, oldest first."""
        pending = self.pending
        if pending:
            self.pending = []
            self.gen += 1
            dropped = self.dropped
            if dropped is not None:
                self.dropped = None
                errors = self.errors or {}
                # (a keep-going batch's error pairs stand for their sub-request: kept)
                pending = [
                    pair
                    for pair in pending
                    if pair[0] not in dropped or errors.get(pair[0]) is pair[1]
                ]
        return pending

    def record(self, state: RequestState) -> None:
        """A sub-request ended with ``state.error``: note it where the batch reads it."""
        error = state.error
        if error is None or self.split:
            return  # a split batch's sub-streams read each state's own error
        if self.errors is None:
            self.errors = {}
        self.errors[state.index] = error
        if self.keep_going:
            # the error takes the sub-request's place in arrival order
            self.pending.append((state.index, error))
        elif self.error is None:
            self.error = error

    def drop(self, index: int) -> None:
        """Forget the waiting outputs of the sub-request at ``index`` (aborted), in
        O(1): its pairs are left out at the next ``take`` (which costs what the list
        holds anyway), so ending a batch of n costs O(n), not a rebuilt list per
        sub-request, and the survivors' places in the list stay where they fold."""
        if self.dropped is None:
            self.dropped = set()
        self.dropped.add(index)

    def split_up(self, states: Sequence[RequestState]) -> None:
        """Make each sub-request its own mailbox: from now on each state keeps its
        outputs, and a sub-request's ``state.error`` ends its own stream.

        :param states: every sub-request's state, in index order.
        """
        errors = self.errors or {}
        gen = self.gen
        for index, output in self.take():
            if errors.get(index) is not output:  # (a keep-going batch's errors stand inline)
                states[index].pending.append(output)
        for state in states:
            # A state of the list just taken keeps its count and its weight, now of its
            # own list: what waited in the batch's still counts against its budget.
            if state.gen != gen:
                state.nbytes = state.npending = 0
        self.split = True


class RequestState(Mailbox):
    """One rid's table entry, and the mailbox of a single request."""

    __slots__ = (
        "acc",
        "collecting",
        "error",
        "failed",
        "finishing",
        "first_at",
        "gen",
        "group",
        "held",
        "index",
        "live",
        "nbytes",
        "noutputs",
        "npending",
        "opened_at",
        "pending",
        "pos",
        "request_id",
        "resume",
        "rid",
        "sink",
        "timer",
    )

    def __init__(self, rid: str, index: int, group: Group | None, opened_at: float) -> None:
        self.waiter = None  # (Mailbox's one field, set here: no call per request)
        self.rid = rid
        self.index = index
        self.group = group
        self.opened_at = opened_at
        self.first_at = 0.0
        self.live = True
        self.pending: list[Any] = []
        self.error: TetherError | None = None
        # Called instead of waking the waiter when an output arrives (Consumer.set_sink);
        # OFFERING or MEANWHILE while it is being offered one (see offered()).
        self.sink: Sink | None = None
        # While the sink is offered an output: what a deliver() from inside it left
        # (held, unfolded), the sink set_sink() asked for meanwhile, and whether the
        # producer's last output is among the held ones.
        self.held: list[Any] | None = None
        # What a fold of the held ones raised when the caller cannot see it (a sink's
        # BaseException goes on instead, or merge's own): the caller fails the request.
        self.failed: BaseException | None = None
        self.resume: Sink | None = None
        self.finishing = False
        self.timer: asyncio.TimerHandle | None = None
        # In a group: where this state's newest output sits in group.pending
        # (valid while gen == group.gen) and how many of its outputs wait there.
        self.gen = -1
        self.pos = 0
        self.npending = 0
        self.noutputs = 0  # delivered so far (for observers)
        # Bytes waiting behind the oldest output, estimated while a backlog exists.
        self.nbytes = 0
        # collect mode (result() is waiting): the producer folds into acc and
        # wakes the consumer only when the request ends.
        self.collecting = False
        self.acc: Any = NOTHING
        # The client's own label (X-Request-Id), for logs and observers; never a key.
        self.request_id: str | None = None

    def __repr__(self) -> str:
        return f"<RequestState {self.rid!r} live={self.live}>"

    def arm(self, timer: asyncio.TimerHandle) -> None:
        """The request's deadline, cancelled when it ends."""
        self.timer = timer

    def label(self, request_id: str | None) -> None:
        """The client's own label for it (``X-Request-Id``), for logs and observers."""
        self.request_id = request_id

    def first_output(self, at: float) -> float:
        """The first output arrived at ``at``; seconds since the request opened."""
        self.first_at = at
        return at - self.opened_at

    def set_sink(self, sink: Sink | None) -> None:
        """Hand outputs to ``sink`` instead of waking the consumer (see ``set_sink``);
        asked while the sink is offered an output, it applies once the sink answers."""
        if self.sink is OFFERING or self.sink is MEANWHILE:
            self.sink = MEANWHILE
            self.resume = sink
        else:
            self.sink = sink

    def offering(self) -> bool:
        """Whether its sink is being offered an output (a call inside the sink's)."""
        return self.sink is OFFERING or self.sink is MEANWHILE

    def collect(self, acc: Any) -> None:
        """Collect mode (``result()`` waits): from now on outputs fold into ``acc``,
        and only the end wakes the consumer."""
        self.acc = acc
        self.collecting = True

    def uncollect(self) -> None:
        """Leave collect mode early: what was folded waits again, as one output ahead
        of anything newer, where this request's consumer reads; unless the request
        was aborted (a cancelled ``result()`` aborts it first), which forgot it."""
        self.collecting = False
        acc, self.acc = self.acc, NOTHING
        if acc is NOTHING or self.dropped():
            return
        group = self.group
        if group is not None and not group.split:
            # In collect mode nothing of this request waits in the shared list but, in a
            # keep-going batch, its error: what it delivered goes before it.
            pairs = group.pending
            error = self.error
            at = len(pairs)
            if error is not None:
                at = next((i for i, pair in enumerate(pairs) if pair[1] is error), at)
            pairs.insert(at, (self.index, acc))
        else:
            self.pending.insert(0, acc)
            self.npending += 1
        self.wake()

    def close(self, error: TetherError | None, *, drop: bool) -> None:
        """The request ended (the table freed its entry): its deadline goes, its batch
        counts it, and its consumer learns how, and is woken.

        :param error: why it ended early, or ``None`` when it finished.
        :param drop: forget its unread outputs (an abort); a failed request's stay
            readable before its error.
        """
        self.live = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if error is not None:
            self.error = error
        if drop:
            self.pending = []
            self.nbytes = self.npending = 0
            self.held = None
            self.finishing = False
        self.sink = None  # the end always wakes the consumer
        group = self.group
        if group is not None:
            group.ended()
            if drop and not group.split:
                group.drop(self.index)
            group.record(self)
        self.wake()

    def put(self, output: Any, limits: Limits) -> bool:
        """Add one output for the consumer; ``False`` if that puts it over a limit.

        In collect mode it folds into ``acc`` instead (``merge``, or the newer one),
        waking nobody. In a batch not split up, it goes to the group's shared list.
        With a sink set and nothing waiting, the sink is offered it (and if it
        declines, :meth:`offered`); with outputs waiting, the reader is woken for
        them all, in order. ``merge`` may raise: the caller fails the request.
        """
        self.noutputs += 1
        if self.collecting:  # result() waits: fold into it (fold(), inlined), wake nobody
            merge, acc = limits.merge, self.acc
            self.acc = output if merge is None or acc is NOTHING else merge(acc, output)
            return True
        group = self.group
        if group is not None and not group.split:
            return group.put(self, output, limits)
        pending = self.pending
        if not pending:
            sink = self.sink
            if sink is None:
                pending.append(output)
                self.npending = 1
            else:
                # Nothing waits: the sink is offered this output alone (inline: the
                # sink's path is per output), and nothing is counted unless it declines.
                # Meanwhile the sink is OFFERING: a deliver() from inside it is held
                # behind this output, never offered (see offered()).
                self.sink = OFFERING
                try:
                    took = sink([output])
                except (Exception, asyncio.CancelledError):
                    # A CancelledError too: a synchronous sink cannot receive its task's
                    # cancellation (cancel() on the running task only marks its next
                    # await), so it is its send chain's, however cancelled the task is.
                    logger.debug(
                        "the sink of %r raised; its consumer reads instead", self.rid, exc_info=True
                    )
                    took = False
                except BaseException:
                    # KeyboardInterrupt, SystemExit...: it goes on to the producer, the
                    # state whole again (the caller settles the end: settle_cut()). A merge
                    # that raises folding the held ones must not replace it: it is kept
                    # for the caller, which fails the request (settle_cut()).
                    try:
                        self.offered(output, sink, False, limits)
                    except Exception as exc:
                        self.failed = exc
                    raise
                if took is True and self.sink is OFFERING:
                    self.sink = sink
                    return True
                if type(took) is not bool:
                    took = _answer_of(self.rid, took)
                    if took and self.sink is OFFERING:  # (a truthy answer: taken, as True)
                        self.sink = sink
                        return True
                return self.offered(output, sink, took, limits)
        else:  # a backlog: folded or appended, and weighed
            merge = limits.merge
            if merge is not None:
                pending[-1] = merge(pending[-1], output)
            elif len(pending) < limits.max_pending:
                pending.append(output)
            else:
                return False
            self.npending += 1
            budget = limits.max_bytes  # (weigh(), inlined: per output of every backlog)
            if budget is not None:
                self.nbytes += limits.sizeof(output)
                if self.nbytes > budget:
                    return False
        # self.wake() (and the group's), inlined: this is the producer's per-output path.
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            # (cancelled meanwhile, rarely: a done() per output costs a call; try is free)
            try:
                waiter.set_result(None)
            except asyncio.InvalidStateError:
                pass
        if group is not None:
            group.wake()
        return True

    def offered(self, output: Any, sink: Sink, took: bool, limits: Limits) -> bool:
        """``sink`` answered the offer of ``output`` (``took``), and that is not all:
        it declined (or raised), or meanwhile something was delivered from inside it,
        it was removed or replaced, or the request ended. Whether everything waiting
        still fits the limits (``put``'s answer).

        Called for an output delivered from inside the sink (``sink`` is a marker),
        it is held behind the one offered, unfolded (:meth:`hold`). For the offered
        one, the sink is removed if it declined or if anything waits now, and what
        waits is, in delivery order: the output if declined, then the held ones,
        folded one delivered output at a time, as ``put`` folds them without a sink.
        A ``merge`` that raises leaves what was folded before it readable and raises
        (the caller fails the request). An abort from inside the sink forgot what
        waited, as an abort does: ``output`` and the held ones with it. If the
        producer's last output is held, ``False``: the caller settles the end
        (:meth:`~tether._table.Table.too_slow`).
        """
        if sink is OFFERING or sink is MEANWHILE:
            self.sink = sink  # (put set OFFERING before it called the marker)
            return self.hold(output, limits)
        current, held, self.held = self.sink, self.held, None
        self.sink = self.resume if current is MEANWHILE and took and not held else None
        self.resume = None
        if self.dropped():
            return True
        backlog = held or []
        if not took:
            backlog.insert(0, output)
        pending = self.pending
        merge = limits.merge
        npending = self.npending if pending else 0  # (hold() counted ahead)
        for later in backlog:
            if not pending:
                pending.append(later)
                npending = 1
            elif merge is None:
                pending.append(later)
                npending += 1
            else:
                try:
                    pending[-1] = merge(pending[-1], later)
                except BaseException as exc:
                    # Whatever it raises, the state is whole: what was folded waits,
                    # counted, its reader woken. A KeyboardInterrupt... goes on to the
                    # producer, and the request fails (settle_cut()): never finished
                    # without the outputs from this one on.
                    self.npending = npending
                    self.wake()
                    if not isinstance(exc, Exception):
                        self.failed = exc
                    raise
                npending += 1
        self.npending = npending
        self.wake()
        if self.finishing:
            return False
        return self.fits(limits)

    def hold(self, output: Any, limits: Limits, *, last: bool = False) -> bool:
        """``output`` was delivered while the sink is offered one: it waits, unfolded,
        behind that one until the sink answers (:meth:`offered`). Held outputs count
        against ``max_pending`` (merged or not: nothing folds them yet) and are each
        weighed against the byte budget; whether they still fit. ``last``: the
        producer's last output (the end is settled once the sink answers)."""
        held = self.held
        if held is None:
            held = self.held = []
            self.sink = MEANWHILE  # (put's check after the call: not only taken)
        held.append(output)
        if last:  # (deliver() hands it here, not through put())
            self.noutputs += 1
            self.finishing = True
        self.npending = len(held) + 1  # (and the one offered)
        if self.npending > limits.max_pending:
            return False
        if limits.max_bytes is not None:
            self.nbytes += limits.sizeof(output)
            return self.nbytes <= limits.max_bytes
        return True

    def settle_cut(self, limits: Limits, table: Ends, finished: bool) -> None:
        """A sink's ``BaseException`` cut :meth:`put` short (it goes on to the producer):
        the request's end is settled as ``put`` would have. What folding the held
        outputs raised, unseen (see :meth:`offered`), fails it (``merge_failed``);
        else a held last output or a broken limit, ``put``'s ``False``, ends it
        (``too_slow``). Never while offering."""
        failed, self.failed = self.failed, None
        if failed is not None:
            table.merge_failed(self, failed, finished)
        elif self.live and not self.offering() and (self.finishing or not self.fits(limits)):
            table.too_slow(self, finished)

    def last_was_held(self) -> bool:
        """Whether the producer's last output was held while the sink was offered one
        (:meth:`hold`): the request's end is then the caller's to settle, once the
        sink answered. Once: it forgets it."""
        finishing, self.finishing = self.finishing, False
        return finishing

    def fits(self, limits: Limits) -> bool:
        """Whether what waits is within ``max_pending`` (without ``merge``) and the
        byte budget."""
        return (limits.merge is not None or self.npending <= limits.max_pending) and not (
            self.over_bytes(limits)
        )

    def dropped(self) -> bool:
        """Whether it ended as an abort, which forgot its unread outputs (``close``):
        nothing may wait again."""
        return not self.live and isinstance(self.error, Aborted)

    def weigh(self, output: Any, limits: Limits) -> bool:
        """Count ``output``, one more waiting (or folded) output, against the byte
        budget; whether the backlog still fits.

        Every output that waits behind the oldest is weighed, once, as it arrives: a
        bound that holds whatever the sizes (weighing only some, and letting each
        stand for those since the last, let large outputs between small weighed ones
        pass unseen). Only a backlog pays it, never a consumer that keeps up, and a
        merged backlog is never weighed again (that would make a lag quadratic): with
        ``merge``, each newer output is what the merged one grew by.
        """
        budget = limits.max_bytes
        if budget is None:
            return True
        self.nbytes += limits.sizeof(output)
        return self.nbytes <= budget

    def over_bytes(self, limits: Limits) -> bool:
        """Whether the byte budget (rather than the count) is what the backlog broke."""
        return limits.max_bytes is not None and self.nbytes > limits.max_bytes

    def take(self) -> list[Any]:
        """Hand every waiting output to the consumer, oldest first."""
        pending = self.pending
        if pending:
            self.pending = []
            self.nbytes = self.npending = 0
        return pending

    def wake(self) -> None:
        """Wake whoever reads this request: its own waiter and, in a batch, the batch's."""
        super().wake()
        group = self.group
        if group is not None:
            group.wake()


def _offering(outputs: list[Any]) -> bool:
    """A request's sink while it is offered an output: a deliver() from inside the
    sink meets this, which declines, and ``put`` holds the output (``offered``)."""
    return False


def _meanwhile(outputs: list[Any]) -> bool:
    """As :func:`_offering`, once something happened meanwhile (an output held, a
    ``set_sink``, which applies after): the sink's answer is then not all there is."""
    return False


OFFERING: Final = _offering
MEANWHILE: Final = _meanwhile


class Delivers(Protocol):
    """What :func:`route` hands the unusual cases to (the registry)."""

    def deliver(self, rid: str, output: Any, *, finished: bool = False) -> bool: ...


class Ends(Protocol):
    """What :func:`route` tells of a request that must end (the table)."""

    def merge_failed(self, state: RequestState, exc: BaseException, finished: bool) -> None: ...

    def too_slow(self, state: RequestState, finished: bool) -> None: ...


def _answer_of(rid: str, took: object) -> bool:
    """What a sink's answer that is no ``bool`` means: a truthy one took the outputs,
    as before; an awaitable (a coroutine function given as a sink) took nothing, and is
    closed, never awaited: said loudly, the outputs wait for the reader."""
    if inspect.isawaitable(took):
        close = getattr(took, "close", None)
        if close is not None:
            close()
        logger.error(
            "the sink of %r returned %r: a sink answers at once, True (it took the "
            "outputs) or False; a coroutine function cannot be one (its consumer reads "
            "instead)",
            rid,
            type(took).__name__,
        )
        return False
    return bool(took)


_SIZED: Final = (list, tuple)
"""(A tuple of types, not ``list | tuple``: that builds a union object at each call.)"""


def route(
    entries: dict[str, RequestState],
    items: Iterable[tuple[str, Any, bool]],
    limits: Limits,
    registry: Delivers,
    table: Ends,
) -> int:
    """An engine step: each ``(rid, output, finished)`` to its request, in order; how
    many were live. ``registry.deliver`` takes what is not the usual case (a rid not
    in ``entries``, a request's first or last output); ``table`` is told of a
    ``merge`` that raised, or of a backlog over a limit.

    The usual case (a live request past its first output, not its last) is here, in
    the mailbox's own module, so that the fold of a request whose ``result()`` waits
    costs no call per output (``put``'s first case, inlined): an engine step calls
    this once for every live request, and a JSON request gets every output folded.
    """
    # Per output, every bytecode counts (a JSON answer folds 64): a list's or tuple's
    # items are counted by len(), an iterator's as it is consumed; only the late
    # ones are counted here. (enumerate() costs more than ``+= 1``.)
    seen: list[int] | None = None
    sized = items if isinstance(items, _SIZED) else None  # (counted by len() at the end)
    if sized is None:
        seen = [0]
        items = _counted(items, seen)
    late = 0
    last_wins = limits.merge is None
    get = entries.get
    for rid, output, finished in items:
        state = get(rid)
        if state is None or finished or not state.first_at:
            if not registry.deliver(rid, output, finished=finished):
                late += 1
            continue
        if last_wins and state.collecting:
            state.noutputs += 1
            state.acc = output
            continue
        try:
            fits = state.put(output, limits)
        except Exception as exc:  # as in deliver(): that request fails alone
            table.merge_failed(state, exc, False)
            continue
        except BaseException:  # as in deliver()
            state.settle_cut(limits, table, False)
            raise
        if not fits and state.live:
            table.too_slow(state, False)
    if sized is not None:  # (a step that grew meanwhile: its items were routed too)
        return len(sized) - late
    assert seen is not None
    return seen[0] - late


def _counted(items: Iterable[T], seen: list[int]) -> Iterator[T]:
    """``items`` one by one, as they are asked for; ``seen[0]``: how many so far."""
    for item in items:
        seen[0] += 1
        yield item
