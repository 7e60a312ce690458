"""Any sequence of public operations on a Registry keeps DESIGN's invariants.

A hypothesis ``RuleBasedStateMachine`` drives the core through its public names
only: ``open()`` (fresh and client-chosen rids), ``open_batch()`` (with and without
``keep_going``, a deadline, ``max_in_flight``), the producer's ``deliver()``,
``deliver_many()``, ``fail()``, ``abort()``, ``fail_all()``; consumers that read a
stream or a batch (``async for``, ``next_ready()`` as the adapters read, ``result()``,
or per sub-stream through ``Batch.streams``), stop, ``aclose()``, ``cancel()``, have
their reading task cancelled, or are dropped; a clock that moves only when told, so that deadlines
fire deterministically; and ``close(drain_timeout=0)`` in the middle or at the end.
Misuse too: a second task reading a consumer that one task reads (``result()``,
``async for``, ``next_ready()``, ``ready()``, in either order), calls from another
thread, and calls after ``close()``. A dropped consumer may be held in a reference
cycle, so that only a garbage collection frees it: the machine runs with the
automatic collector off and forces collections at chosen points, inside ``merge``,
inside ``on_abort``, inside an observer's hook, or as a step of its own.

The model beside it is a table of requests (:class:`Req`) and of the consumers that
read them (:class:`Con`, read through :class:`Target`). It predicts what every
operation does, with one exception: when a consumer that falls behind gets
:class:`~tether.ConsumerTooSlow` depends on what its reader had buffered, so the model
keeps a lower and an upper bound on the outputs waiting and checks that an
observed overflow lies between them. After every step it checks:

- ``registry.in_flight`` and ``rid in registry`` agree with the model;
- ``on_abort`` ran exactly once for every request closed before it finished
  (consumer gone, server abort, deadline, too slow, shutdown), never for one that
  finished or failed;
- every output a consumer read was delivered to that request, once, in order (or
  folded by ``merge``); a read that ends cleanly got everything, one that fails
  raises the error of what ended the request;
- no exception reached the producer, none was unraisable, none reached the loop's
  exception handler;
- ``stats()`` agrees: late producer calls, requests opened, finished, failed, aborted;
  and ``opened == finished + failed + sum(aborted) + in_flight`` holds after every
  step and at every moment the core calls out (``merge``, ``on_abort``, observers).

At the end of every example the producer finishes what is still in flight and every
consumer reads to its end (invariant 1), then everything is closed and nothing may
be left in flight (invariant 2).

Each step runs a short coroutine on the example's own event loop
(``loop.run_until_complete``), then lets the loop turn a few times so that woken
readers and deferred ``on_abort`` calls run: those turns are scheduling yields,
never timing. Nothing waits for I/O or for time, so a step that would block the
loop fails at once as a hang.

``HOLES_STILL_OPEN`` is the one switch for the holes the core is being fixed for:
for each hole named there, the machine does not generate the inputs that fall into
it (client rids shaped like auto rids, batches larger than ``max_in_flight``, merely
reading ``Batch.streams``, splitting a batch after it failed, a raising ``merge``,
dropping a consumer read with an idle interval) or, for one, allows ``on_abort``
for a ``ConsumerTooSlow`` on a ``finished=True`` delivery. Every other check is
strict either way. Remove a name once its hole is fixed
(``TETHER_HOLES_STILL_OPEN=`` overrides the set for a run: empty for none, ``all``,
or names separated by commas).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import os
import selectors
import sys
import warnings
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final, TypeAlias, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import tether
from tether import AbortReason

from ._eager import eager_task_factory

_KNOWN_HOLES: Final = frozenset(
    {
        "auto_rid_can_equal_a_live_client_rid",
        "batch_over_max_in_flight_is_overloaded",
        "reading_batch_streams_splits_the_batch",
        "split_after_failure_ends_clean_and_empty",
        "raising_merge_reaches_the_producer",
        "too_slow_on_finished_delivery_calls_on_abort",
        # Found by this test: next_ready(timeout=...) leaves its idle timer armed
        # after returning outputs, and the loop's TimerHandle keeps a dropped
        # consumer alive (its request in flight, no on_abort) until the interval ends.
        "idle_timer_keeps_a_dropped_consumer_alive",
    }
)


def _holes_from_env(default: frozenset[str]) -> frozenset[str]:
    value = os.environ.get("TETHER_HOLES_STILL_OPEN")
    if value is None:
        return default
    names = _KNOWN_HOLES if value == "all" else frozenset(filter(None, value.split(",")))
    assert names <= _KNOWN_HOLES, f"unknown holes: {sorted(names - _KNOWN_HOLES)}"
    return names


# As the core gets fixed: _holes_from_env(_KNOWN_HOLES - {"the_fixed_hole", ...}),
# and frozenset() once every one is fixed.
HOLES_STILL_OPEN: Final = _holes_from_env(frozenset())  # every hole above is fixed
"""The known holes of the core this test steers around (see the module docstring)."""


def _open(hole: str) -> bool:
    assert hole in _KNOWN_HOLES, hole
    return hole in HOLES_STILL_OPEN


_SETTLE_TURNS: Final = 4
"""Loop turns after each step: a woken reader runs in one, a deferred on_abort in one."""

_T = TypeVar("_T")

Kind: TypeAlias = tuple[str, str]
"""What an error says ended a request: ("producer", rid) or ("aborted", reason)."""

ANY_ERROR: Final[Kind] = ("any", "")
"""Any TetherError will do (a request failed by a raising merge: the fix chooses which)."""


def _aborted(reason: AbortReason) -> Kind:
    return ("aborted", str(reason))


def kind_of(exc: tether.TetherError) -> Kind:
    """The :data:`Kind` of an error a consumer raised, checking its class matches its reason."""
    if isinstance(exc, tether.ProducerError):
        return ("producer", exc.rid)
    assert isinstance(exc, tether.Aborted), f"unexpected error class: {exc!r}"
    if exc.reason is AbortReason.TIMEOUT:
        assert isinstance(exc, tether.RequestTimeout), repr(exc)
    if exc.reason is AbortReason.CONSUMER_TOO_SLOW:
        assert isinstance(exc, tether.ConsumerTooSlow), repr(exc)
    return _aborted(exc.reason)


def allows(allowed: Iterable[Kind], kind: Kind) -> bool:
    allowed = set(allowed)
    return kind in allowed or ANY_ERROR in allowed


def numbers(output: Any) -> list[int]:
    """An output is a tuple of output numbers; a poisoned one is negative (see merge)."""
    assert isinstance(output, tuple), f"outputs are tuples, got {output!r}"
    return [abs(n) for n in output]


class MergeFailed(Exception):
    """What the test's merge raises for a poisoned output."""


@dataclasses.dataclass(frozen=True)
class ErrorSeen:
    """An error that stood in a sub-request's place (keep_going), as the reader saw it."""

    kind: Kind


# -- the model ------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Req:
    """One request as the model sees it."""

    rid: str
    con: Con = dataclasses.field(repr=False)
    index: int  # in its batch; 0 for a stream
    abort_base: int  # on_abort calls for this rid before it was opened (rids are reused)
    live: bool = True
    outcome: str = "live"  # finished | failed | aborted | merge_failed
    errors_ok: set[Kind] = dataclasses.field(default_factory=set)
    aborts: tuple[int, int] = (0, 0)  # how many on_abort calls are right: (least, most)
    delivered: list[int] = dataclasses.field(default_factory=list)  # output numbers, in order
    last: Any = None  # the last delivered output (result() without merge)
    received: list[int] = dataclasses.field(default_factory=list)
    waiting_low: int = 0  # outputs surely waiting in the mailbox (the reader cannot have taken)
    collecting: bool = False  # a result() reader started: outputs are folded, never queued
    kept_outputs: bool = True  # when it ended: a batch read whole drops all on a failure


@dataclasses.dataclass(eq=False)
class Target:
    """Something a reader reads: a stream, a whole batch, or one sub-stream of a batch."""

    con: Con = dataclasses.field(repr=False)
    index: int | None  # the sub-stream's index, None for the stream or the whole batch
    reqs: list[Req]
    mode: str | None = None  # "iter", "ready" or "result", fixed by the first read
    task: asyncio.Task[tuple[str, Any]] | None = None
    done: bool = False  # its reading ended: end, error, result or cancelled
    closed: bool = False  # aclose() was called: an early clean end is then right
    last_number: int = 0  # arrival-order check of a whole batch without merge
    error_pairs: set[int] = dataclasses.field(default_factory=set)
    unchecked_errors: list[tuple[int, Kind]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Con:
    """One Stream or Batch the test holds (``obj`` is None once it was dropped)."""

    obj: tether.Stream | tether.Batch | None
    is_batch: bool
    keep_going: bool
    deadline: float | None
    reqs: list[Req] = dataclasses.field(default_factory=list)
    whole: Target = dataclasses.field(init=False)
    subs: list[Target] = dataclasses.field(default_factory=list)
    split: bool = False  # a sub-stream was read: the batch is read per sub-request
    idle_used: bool = False  # read with next_ready(timeout=...): an idle timer may be armed
    group_err: set[Kind] | None = None  # what the whole batch must raise, once it failed


class _NeverBlockingSelector(selectors.DefaultSelector):
    """Nothing in this test waits for I/O or for time to pass: a step that would block
    the loop is a hang, and fails at once instead of at the suite's timeout."""

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None or timeout > 0:
            raise AssertionError("the step waits for something that cannot happen: a hang")
        return super().select(timeout)


class _ManualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the test moves it: deadlines fire
    exactly when the model says, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_NeverBlockingSelector())

    def time(self) -> float:
        return self.now


_CLIENT_RIDS: Final = ("client-a", "client-b", "client-c")
_OPEN_RIDS: Final = (None, None, *_CLIENT_RIDS, "auto-shaped+0", "auto-shaped+1", "auto-shaped+2")
_TIMEOUTS: Final = (None, None, None, 1.0, 3.0)
_pick = st.integers(0, 1 << 16)
# Odds for the steps that end requests, lest few live long enough to be interesting.
# Hypothesis favours the first value of sampled_from (and 0 of integers), so the
# rare outcome comes last.
_rarely = st.sampled_from([False] * 7 + [True])
"""For the steps that end everything."""
_sometimes = st.sampled_from([False, False, True])
"""For the steps that end a request or a consumer's requests."""
_last = st.sampled_from([False, False, False, True])
"""``finished=`` of a delivery: most requests have several outputs."""


_OTHER_THREAD: Final = concurrent.futures.ThreadPoolExecutor(1, "another-thread")
"""One thread for the calls made from another thread (a new one per call costs more
than the rest of the step)."""


class _Watch(tether.Observer):
    """Checks the counters at every end, and collects garbage inside ``deliver()``."""

    def __init__(self, machine: RegistryMachine) -> None:
        self.machine = machine

    def on_first_output(self, rid: str, elapsed: float) -> None:
        self.machine.check_identity(f"on_first_output({rid!r})")
        if "observer" in self.machine.gc_points:
            self.machine.force_gc(in_deliver=True)

    def on_end(self, end: tether.RequestEnd) -> None:
        self.machine.check_identity(f"on_end({end.rid!r})")


class RegistryMachine(RuleBasedStateMachine):
    """The registry, its producer and its consumers, against the model above."""

    def __init__(self) -> None:
        super().__init__()
        self.registry: tether.Registry | None = None
        self.loop: _ManualClockLoop | None = None
        self.merge_on = False
        self.max_pending = 1
        self.max_in_flight: int | None = None
        self.closed = False
        self.reqs: list[Req] = []
        self.latest: dict[str, Req] = {}
        self.cons: list[Con] = []
        self.aborts: Counter[str] = Counter()
        self.counter = 0
        self.owner: dict[int, Req] = {}
        self.merge_raised: list[int] = []
        self.late = (0, 0)
        self.opened = 0
        self.auto_prefix: str | None = None
        self.auto_next = 1
        # Everything that escaped, for the whole run.
        self.unraisable: list[str] = []
        self.loop_errors: list[str] = []
        self.on_abort_too_early: list[str] = []
        self.identity_broken: list[str] = []
        # Garbage collection at chosen points (the automatic collector is off).
        self.gc_points: frozenset[str] = frozenset()
        # Dropped consumers that only a collection frees (a weak reference to each),
        # and those a collection freed, with whether it ran inside deliver().
        self.doomed: dict[int, tuple[Con, weakref.ref[Any]]] = {}
        self.freed: list[tuple[Con, bool]] = []
        self._gc_was_enabled = gc.isenabled()
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._on_unraisable

    # -- plumbing -----------------------------------------------------------------------

    def _on_unraisable(self, info: Any) -> None:
        self.unraisable.append(f"{info.exc_type.__name__}: {info.exc_value!r} in {info.object!r}")

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.loop_errors.append(f"{context.get('message')}: {context.get('exception')!r}")

    def _on_abort(self, rid: str) -> None:
        self.aborts[rid] += 1
        if rid in self.reg:  # on_abort may re-enter: open(rid) again, say
            self.on_abort_too_early.append(rid)
        self.check_identity(f"on_abort({rid!r})")
        if "on_abort" in self.gc_points:
            self.force_gc()

    def check_identity(self, where: str) -> None:
        """Record (never raise: a callback's exception is the core's to swallow) any
        moment the counters do not add up."""
        stats = self.reg.stats()
        ended = stats.finished + stats.failed + sum(stats.aborted.values())
        if stats.opened != ended + stats.in_flight:
            self.identity_broken.append(f"in {where}: {stats}")

    def force_gc(self, *, in_deliver: bool = False) -> None:
        """A garbage collection now: a doomed consumer's finaliser aborts its requests.

        The youngest generation is enough: what holds a doomed consumer was made when
        it was dropped, and no collection ran since (the collector is off)."""
        if not self.doomed:
            return  # nothing of the machine's to free
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect(0)
        self._note_freed(in_deliver)

    def _note_freed(self, in_deliver: bool) -> None:
        for key, (con, ref) in list(self.doomed.items()):
            if ref() is None:
                del self.doomed[key]
                self.freed.append((con, in_deliver))

    def _merge(self, older: Any, newer: Any) -> Any:
        self.check_identity("merge")
        if "merge" in self.gc_points:
            self.force_gc(in_deliver=True)
        poisoned = [-n for n in newer if n < 0]
        if poisoned:
            self.merge_raised.extend(poisoned)
            raise MergeFailed(f"cannot merge output {poisoned}")
        return older + newer

    @property
    def reg(self) -> tether.Registry:
        assert self.registry is not None
        return self.registry

    def _run(self, action: Callable[[], Awaitable[_T]]) -> _T:
        """Run one step's coroutine on the loop, then let woken readers and deferred
        callbacks run (the invariant checks the readers that finished)."""
        assert self.loop is not None

        async def step() -> _T:
            result = await action()
            for _ in range(_SETTLE_TURNS):
                await asyncio.sleep(0)
            return result

        return self.loop.run_until_complete(step())

    def _producer(self, call: Callable[[], _T]) -> _T:
        """Call a producer-side method: it must never raise (invariant 10)."""
        try:
            return call()
        except Exception as exc:
            raise AssertionError(f"an exception reached the producer: {exc!r}") from exc

    def _live(self) -> list[Req]:
        return [req for req in self.reqs if req.live]

    def _pick_rid(self, pick: int) -> str:
        """A rid for a producer call: mostly live ones, sometimes ended or unknown ones."""
        live = [req.rid for req in self._live()]
        choices = live * 8 + list(self.latest) + ["never-opened"]
        return choices[pick % len(choices)]

    def _live_req(self, rid: str) -> Req | None:
        req = self.latest.get(rid)
        return req if req is not None and req.live else None

    def _new_output(self, req: Req | None, poison: bool) -> tuple[int]:
        self.counter += 1
        if req is not None:
            self.owner[self.counter] = req
        if poison and not _open("raising_merge_reaches_the_producer"):
            return (-self.counter,)
        return (self.counter,)

    def _expect_late(self, count: int = 1, *, maybe: int = 0) -> None:
        low, high = self.late
        self.late = (low + count, high + count + maybe)

    # -- the model's transitions ------------------------------------------------------

    def _end(
        self, req: Req, outcome: str, errors_ok: Iterable[Kind], aborts: tuple[int, int]
    ) -> None:
        req.live = False
        req.outcome = outcome
        req.kept_outputs = not req.con.is_batch or req.con.split or req.con.keep_going
        req.errors_ok = set(errors_ok)
        req.aborts = aborts

    def _group_failed(self, con: Con, kinds: set[Kind]) -> None:
        if con.is_batch and not con.split and con.group_err is None:
            con.group_err = kinds

    def _request_error(self, req: Req, outcome: str, kind: Kind, aborts: tuple[int, int]) -> None:
        """One request ended with an error (fail, abort, close, raising merge): in a batch
        without keep_going, its live siblings are aborted and the batch fails."""
        self._end(req, outcome, {kind}, aborts)
        con = req.con
        if con.is_batch and not con.keep_going:
            for sibling in con.reqs:
                if sibling.live:
                    self._end(
                        sibling, "aborted", {kind, _aborted(AbortReason.FAILED_SIBLING)}, (1, 1)
                    )
            self._group_failed(con, {kind})

    def _consumer_abort(self, con: Con, reqs: list[Req], kind: Kind) -> None:
        """The consumer side ended these requests (close, cancel, drop, deadline, too slow)."""
        live = [req for req in reqs if req.live]
        for req in live:
            self._end(req, "aborted", {kind}, (1, 1))
        if live:
            self._group_failed(con, {kind})

    def _delivered(self, req: Req, output: tuple[int], finished: bool) -> None:
        req.delivered.extend(numbers(output))
        req.last = output
        if not self.merge_on and not req.collecting:
            req.waiting_low += 1
        if finished:
            self._end(req, "finished", (), (0, 0))

    def _merge_failed(self, req: Req, finished: bool) -> None:
        # A request the producer finished must never see on_abort; one it did not
        # finish may (the producer may need telling): the fix chooses.
        self._request_error(req, "merge_failed", ANY_ERROR, (0, 0) if finished else (0, 1))

    def _too_slow(self, req: Req, finished: bool) -> None:
        con = req.con
        whole_group = con.is_batch and not con.split
        victims = [r for r in con.reqs if r.live] if whole_group else [req]
        kind = _aborted(AbortReason.CONSUMER_TOO_SLOW)
        for victim in victims:
            if victim is req and finished:
                aborts = (0, 1) if _open("too_slow_on_finished_delivery_calls_on_abort") else (0, 0)
            else:
                aborts = (1, 1)
            self._end(victim, "aborted", {kind, _aborted(AbortReason.FAILED_SIBLING)}, aborts)
        self._group_failed(con, {kind})

    def _overflow_bounds(self, req: Req) -> tuple[bool, bool]:
        """(may, must): whether one more output may / must overflow ``max_pending``."""
        if self.merge_on or req.collecting:
            return False, False
        upper = len(req.delivered) - len(req.received)
        return upper >= self.max_pending, req.waiting_low >= self.max_pending

    # -- readers ----------------------------------------------------------------------

    def _obj(self, target: Target) -> tether.Stream | tether.Batch:
        obj = target.con.obj
        assert obj is not None
        if target.index is not None:
            assert isinstance(obj, tether.Batch)
            return obj.streams[target.index]
        return obj

    async def _read(
        self,
        target: Target,
        obj: tether.Stream | tether.Batch,
        mode: str,
        n: int,
        idle: float | None,
    ) -> tuple[str, Any]:
        """A reading task: ``n`` items with ``async for``, ``n`` calls of ``next_ready()``
        (as the adapters read, with an idle interval), or ``result()``."""
        try:
            if mode == "ready":
                loop = asyncio.get_running_loop()
                for _ in range(n):
                    asked_at = loop.time()
                    chunk = await obj.next_ready(timeout=idle)
                    if chunk is None:
                        return ("end", None)
                    if not chunk:  # only once the idle interval passed on the clock
                        assert idle is not None, "next_ready() without timeout returned []"
                        waited = loop.time() - asked_at
                        assert waited >= idle - 1e-3, f"next_ready() gave up after {waited}s"
                    for item in chunk:
                        self._record(target, item)
                return ("paused", None)
            if mode == "result":
                value = await obj.result()
                if isinstance(value, list):
                    value = [
                        ErrorSeen(kind_of(v)) if isinstance(v, tether.TetherError) else v
                        for v in value
                    ]
                return ("result", value)
            count = 0
            async for item in obj:
                self._record(target, item)
                count += 1
                if count == n:
                    return ("paused", None)
            return ("end", None)
        except tether.TetherError as exc:
            return ("error", kind_of(exc))

    def _record(self, target: Target, item: Any) -> None:
        if target.con.is_batch and target.index is None:
            index, output = item
            req = target.reqs[index]
            if isinstance(output, tether.TetherError):
                assert target.con.keep_going, f"an error in place of {req.rid} without keep_going"
                assert index not in target.error_pairs, f"{req.rid}: two errors in its place"
                target.error_pairs.add(index)
                target.unchecked_errors.append((index, kind_of(output)))  # see _collect_readers
                return
            assert index not in target.error_pairs, f"{req.rid}: an output after its error"
            got = numbers(output)
            if not self.merge_on:  # arrival order across the batch's sub-requests
                assert got[0] > target.last_number, f"batch outputs out of arrival order: {got}"
                target.last_number = got[-1]
            req.received.extend(got)
        else:
            target.reqs[0].received.extend(numbers(item))

    def _collect_readers(self) -> None:
        """Check every reading task that finished; the ones still parked took what waited."""
        for con in self.cons:
            for target in [con.whole, *con.subs]:
                task = target.task
                if task is None:
                    continue
                for req in target.reqs:
                    req.waiting_low = 0  # the reader ran: it may have taken everything
                for index, kind in target.unchecked_errors:
                    req = target.reqs[index]
                    assert not req.live, f"{req.rid}: an error in its place while in flight"
                    assert allows(req.errors_ok, kind), (
                        f"{req.rid}: read error {kind} in its place, expected {req.errors_ok} "
                        f"({req.outcome})"
                    )
                    if kind == ("producer", req.rid):
                        assert req.received == req.delivered, (
                            f"{req.rid}: outputs delivered before fail() must be read first: "
                            f"read {req.received} of {req.delivered}"
                        )
                target.unchecked_errors.clear()
                if not task.done():
                    continue
                target.task = None
                if task.cancelled():
                    target.done = True
                    continue
                error = task.exception()
                if error is not None:
                    raise AssertionError(
                        f"reading {self._name(target)} raised {error!r}"
                    ) from error
                self._check_outcome(target, *task.result())

    def _name(self, target: Target) -> str:
        if target.con.is_batch and target.index is None:
            return f"batch {[req.rid for req in target.reqs]}"
        return f"stream {target.reqs[0].rid}"

    def _errors_allowed(self, target: Target) -> set[Kind]:
        if target.con.is_batch and target.index is None:
            return target.con.group_err or set()
        return target.reqs[0].errors_ok

    def _check_outcome(self, target: Target, how: str, value: Any) -> None:
        name = self._name(target)
        if how == "paused":
            return
        target.done = True
        closed = target.closed
        whole_batch = target.con.is_batch and target.index is None
        if how == "error":
            allowed = self._errors_allowed(target)
            assert allows(allowed, value), f"{name} raised {value}, expected one of {allowed}"
            req = target.reqs[0]
            own_failure = value == ("producer", req.rid) and req.kept_outputs
            if not whole_batch and target.mode != "result" and own_failure:
                assert req.received == req.delivered, (
                    f"{name}: outputs delivered before fail() must be read first: "
                    f"read {req.received} of {req.delivered}"
                )
            return
        if closed:
            return  # aclose(): later reads end the iteration, whatever was left
        if whole_batch:
            assert target.con.group_err is None, f"{name} ended cleanly, but it failed"
            assert how == "end" or len(value) == len(target.reqs), f"{name}: result {value!r}"
        for req in target.reqs:
            assert not req.live, f"{name} ended while {req.rid} is in flight"
            if req.outcome == "finished":
                if how == "end":
                    assert req.received == req.delivered, (
                        f"{name} ended cleanly having read {req.received} of {req.delivered}"
                    )
                else:
                    got = value[req.index] if whole_batch else value
                    self._check_result(req, got)
            else:
                assert whole_batch, (
                    f"{name} ended cleanly but {req.rid} {req.outcome} "
                    f"(the failure must be reported however the batch is read)"
                )
                assert target.con.keep_going, f"{name} ended cleanly, {req.rid} {req.outcome}"
                if how == "end":
                    assert req.index in target.error_pairs, f"{req.rid}'s error was not read"
                else:
                    got = value[req.index]
                    assert isinstance(got, ErrorSeen), f"{name}: result for {req.rid}: {got!r}"
                    assert allows(req.errors_ok, got.kind), (
                        f"{name}: result for {req.rid} is {got!r}, expected {req.errors_ok}"
                    )

    def _check_result(self, req: Req, got: Any) -> None:
        if self.merge_on:
            flat = [] if got is None else numbers(got)
            assert flat == req.delivered, f"result of {req.rid}: {got!r}, delivered {req.delivered}"
        else:
            assert got == req.last, f"result of {req.rid}: {got!r}, last output {req.last!r}"

    # -- set-up -----------------------------------------------------------------------

    @initialize(
        eager=st.booleans(),
        merge=st.booleans(),
        max_in_flight=st.sampled_from([None, None, 2, 5]),
        max_pending=st.integers(1, 3),
        streams=st.integers(0, 2),
        batch=st.sampled_from([None, 2, 3]),
        keep_going=st.booleans(),
        gc_points=st.frozensets(st.sampled_from(["merge", "on_abort", "observer"])),
    )
    def start(
        self,
        eager: bool,
        merge: bool,
        max_in_flight: int | None,
        max_pending: int,
        streams: int,
        batch: int | None,
        keep_going: bool,
        gc_points: frozenset[str],
    ) -> None:
        """A registry, and a few requests in flight from the start: hypothesis runs
        each example with only some of the rules (swarm testing), and many would
        otherwise never open anything."""
        self.loop = loop = _ManualClockLoop()
        loop.set_exception_handler(self._on_loop_error)
        if eager:
            loop.set_task_factory(eager_task_factory)
        self.merge_on = merge
        self.max_pending = max_pending
        self.max_in_flight = max_in_flight
        self.registry = tether.Registry(
            self._on_abort,
            max_in_flight=max_in_flight,
            max_pending=max_pending,
            merge=self._merge if merge else None,
        )
        self.registry.add_observer(_Watch(self))
        self.gc_points = gc_points
        gc.disable()  # collections happen where the machine forces them, nowhere else
        for _ in range(streams):
            self.open_stream(None, None)
        if batch is not None:
            self.open_batch(batch, None, keep_going, None)

    # -- opening ------------------------------------------------------------------------

    def _client_rid(self, choice: str | None) -> str | None:
        if choice is None or not choice.startswith("auto-shaped+"):
            return choice
        if _open("auto_rid_can_equal_a_live_client_rid") or self.auto_prefix is None:
            return None
        return f"{self.auto_prefix}-{self.auto_next + int(choice.rsplit('+', 1)[1])}"

    def _register(self, con: Con, rids: Iterable[str], auto: bool) -> None:
        live = {req.rid for req in self._live()}
        for index, rid in enumerate(rids):
            if auto:
                assert rid not in live, f"auto rid {rid!r} equals a live rid (invariant 8)"
                prefix, _, n = rid.rpartition("-")
                if n.isdigit():
                    self.auto_prefix = prefix
                    self.auto_next = max(self.auto_next, int(n) + 1)
            previous = self.latest.get(rid)
            if previous is not None:
                self._check_aborts(previous)
            req = Req(rid, con, index, abort_base=self.aborts[rid])
            con.reqs.append(req)
            self.reqs.append(req)
            self.latest[rid] = req
        self.opened += len(con.reqs)
        con.whole = Target(con, None, list(con.reqs))
        if con.is_batch:
            con.subs = [Target(con, i, [req]) for i, req in enumerate(con.reqs)]
        self.cons.append(con)

    def _open_errors(self, rids: list[str] | None, count: int) -> tuple[type[Exception], ...]:
        """Every error that open()/open_batch() may rightly raise here; () if it must succeed."""
        errors: list[type[Exception]] = []
        if self.closed:
            errors.append(tether.RegistryClosed)
        if rids is not None and len(set(rids)) != len(rids):
            errors.append(ValueError)
        limit = self.max_in_flight
        if limit is not None and count > limit:
            errors.append(ValueError)  # can never fit: a bad argument, not overload
        elif limit is not None and len(self._live()) + count > limit:
            errors.append(tether.Overloaded)
        live = {req.rid for req in self._live()}
        if rids is not None and live.intersection(rids):
            errors.append(tether.DuplicateRequest)
        return tuple(errors)

    def _try_open(
        self, make: Callable[[], _T], errors: tuple[type[Exception], ...], what: str
    ) -> _T | None:
        before = self.reg.in_flight

        async def action() -> _T | Exception:
            try:
                return make()
            except (tether.TetherError, ValueError) as exc:
                return exc

        got = self._run(action)
        if isinstance(got, Exception):
            assert errors, f"{what} raised {got!r}, expected it to succeed"
            assert isinstance(got, errors), f"{what} raised {got!r}, expected {errors}"
            assert self.reg.in_flight == before, f"{what} raised {got!r} but changed the table"
            return None
        assert not errors, f"{what} succeeded, expected one of {errors}"
        return got

    @rule(rid=st.sampled_from(_OPEN_RIDS), timeout=st.sampled_from(_TIMEOUTS))
    def open_stream(self, rid: str | None, timeout: float | None) -> None:
        rid = self._client_rid(rid)
        errors = self._open_errors(None if rid is None else [rid], 1)
        stream = self._try_open(
            lambda: self.reg.open(rid, timeout=timeout), errors, f"open({rid!r})"
        )
        if stream is None:
            return
        assert isinstance(stream, tether.Stream)
        assert rid is None or stream.rid == rid
        deadline = None if timeout is None else self.loop_now + timeout
        self._register(Con(stream, False, False, deadline), [stream.rid], auto=rid is None)

    @rule(
        size=st.integers(1, 3),
        names=st.none() | st.lists(st.sampled_from(_CLIENT_RIDS), min_size=1, max_size=3),
        keep_going=st.booleans(),
        timeout=st.sampled_from(_TIMEOUTS),
    )
    def open_batch(
        self, size: int, names: list[str] | None, keep_going: bool, timeout: float | None
    ) -> None:
        limit = self.max_in_flight
        if _open("batch_over_max_in_flight_is_overloaded") and limit is not None:
            size = min(size, limit)
            names = None if names is None else names[:limit]
        count = size if names is None else len(names)
        errors = self._open_errors(names, count)
        arg: int | list[str] = size if names is None else names
        batch = self._try_open(
            lambda: self.reg.open_batch(arg, timeout=timeout, keep_going=keep_going),
            errors,
            f"open_batch({arg!r})",
        )
        if batch is None:
            return
        assert isinstance(batch, tether.Batch)
        assert len(batch) == count
        assert len(set(batch.rids)) == count, f"a batch's rids must be distinct: {batch.rids}"
        assert batch.keep_going is keep_going
        assert names is None or list(batch.rids) == names
        deadline = None if timeout is None else self.loop_now + timeout
        self._register(Con(batch, True, keep_going, deadline), batch.rids, auto=names is None)

    @property
    def loop_now(self) -> float:
        assert self.loop is not None
        return self.loop.now

    # -- the producer -------------------------------------------------------------------

    @rule(pick=_pick, finished=_last, poison=st.booleans())
    def deliver(self, pick: int, finished: bool, poison: bool) -> None:
        self._deliver(self._pick_rid(pick), finished, poison)

    def _deliver(self, rid: str, finished: bool, poison: bool) -> None:
        # (first: a collection inside an earlier call, such as the last deliver of a
        # teardown, may have freed this rid's consumer, whose finaliser ended it)
        self._take_in_gc()
        req = self._live_req(rid)
        output = self._new_output(req, poison)
        may, must = self._overflow_bounds(req) if req is not None else (False, False)
        too_slow_before = self.reg.stats().aborted.get(AbortReason.CONSUMER_TOO_SLOW, 0)
        self.merge_raised.clear()

        async def action() -> bool:
            return self._producer(lambda: self.reg.deliver(rid, output, finished=finished))

        self._take_in_gc()
        live = self._run(action)
        raised = {self.owner[n].rid for n in self.merge_raised}
        if req is not None and (req.con, True) in self.freed:
            # A collection inside deliver() (merge, an observer) ran the dropped
            # consumer's finaliser: its request was aborted before the output landed.
            assert live is True, f"deliver({rid!r}) returned {live}"
            self._take_in_gc()
            return
        if req is None:
            assert live is False, f"deliver({rid!r}) to a rid not in flight returned {live}"
            assert not raised, f"merge was called for {raised}, not in flight"
            self._expect_late()
            return
        if raised:
            assert raised == {rid}, f"deliver({rid!r}) made merge raise for {raised}"
            if not live:
                self._expect_late(0, maybe=1)
            self._merge_failed(req, finished)
            return
        assert live is True, f"deliver({rid!r}) to a live request returned {live}"
        too_slow_after = self.reg.stats().aborted.get(AbortReason.CONSUMER_TOO_SLOW, 0)
        too_slow = too_slow_after > too_slow_before or (not finished and rid not in self.reg)
        if too_slow:
            assert may, (
                f"deliver({rid!r}) ended it as too slow with at most "
                f"{len(req.delivered) - len(req.received)} outputs unread, "
                f"max_pending={self.max_pending}"
            )
            self._too_slow(req, finished)
        else:
            assert finished or not must, (
                f"{req.waiting_low} outputs waited for {rid!r}, max_pending={self.max_pending}, "
                "yet one more was queued"
            )
            self._delivered(req, output, finished)

    @rule(items=st.lists(st.tuples(_pick, _last, st.booleans()), min_size=1, max_size=4))
    def deliver_many(self, items: list[tuple[int, bool, bool]]) -> None:
        """One engine step: one output per request. Outputs that may overflow a slow
        consumer are left to ``deliver`` (where the model can observe the overflow)."""
        step: list[tuple[str, tuple[int], bool, Req | None]] = []
        for pick, finished, poison in items:
            rid = self._pick_rid(pick)
            if any(rid == other for other, *_ in step):
                continue
            req = self._live_req(rid)
            if req is not None and (self._overflow_bounds(req)[0] or id(req.con) in self.doomed):
                continue  # (a doomed one's end inside the step would be unobservable)
            step.append((rid, self._new_output(req, poison), finished, req))
        self.merge_raised.clear()

        async def action() -> int:
            triples = [(rid, output, finished) for rid, output, finished, _ in step]
            return self._producer(lambda: self.reg.deliver_many(triples))

        count = self._run(action)
        raised = {self.owner[n] for n in self.merge_raised}
        live = merge_failed = 0
        for _, output, finished, req in step:
            if req is None or not req.live:
                self._expect_late()
            elif req in raised:
                merge_failed += 1
                self._merge_failed(req, finished)
            else:
                live += 1
                self._delivered(req, output, finished)
        assert live <= count <= live + merge_failed, f"deliver_many returned {count}"
        self._expect_late(0, maybe=merge_failed)

    @rule(pick=_pick, now=_sometimes)
    def fail(self, pick: int, now: bool) -> None:
        if not now:
            return
        rid = self._pick_rid(pick)
        req = self._live_req(rid)

        async def action() -> bool:
            return self._producer(lambda: self.reg.fail(rid, RuntimeError("engine step failed")))

        assert self._run(action) is (req is not None), f"fail({rid!r})"
        if req is None:
            self._expect_late()
        else:
            self._request_error(req, "failed", ("producer", rid), (0, 0))

    @rule(pick=_pick, now=_sometimes)
    def abort(self, pick: int, now: bool) -> None:
        if not now:
            return
        rid = self._pick_rid(pick)
        req = self._live_req(rid)

        async def action() -> bool:
            return self._producer(lambda: self.reg.abort(rid))

        assert self._run(action) is (req is not None), f"abort({rid!r})"
        if req is None:
            self._expect_late()
        else:
            self._request_error(req, "aborted", _aborted(AbortReason.SERVER), (1, 1))

    @rule(now=_rarely)
    def fail_all(self, now: bool) -> None:
        if not now:
            return
        live = self._live()

        async def action() -> int:
            return self._producer(lambda: self.reg.fail_all(RuntimeError("engine crashed")))

        assert self._run(action) == len(live), "fail_all() must count every request in flight"
        for req in live:
            self._end(req, "failed", {("producer", req.rid)}, (0, 0))
        for con in {req.con for req in live}:
            if not con.keep_going:
                self._group_failed(con, {("producer", req.rid) for req in con.reqs})

    # -- consumers ----------------------------------------------------------------------

    def _readable(self) -> list[Target]:
        targets = []
        for con in self.cons:
            if con.obj is None:
                continue
            if not con.split:
                targets.append(con.whole)
            may_split = con.whole.mode is None and (
                con.group_err is None or not _open("split_after_failure_ends_clean_and_empty")
            )
            if con.split or may_split:
                targets.extend(con.subs)
        return [t for t in targets if not t.done and t.task is None]

    @rule(
        pick=_pick,
        mode=st.sampled_from(["iter", "iter", "ready", "result"]),
        n=st.integers(1, 3),
        idle=st.sampled_from([None, 1.0]),
    )
    def read(self, pick: int, mode: str, n: int, idle: float | None) -> None:
        targets = self._readable()
        if not targets:
            return
        self._start_reader(targets[pick % len(targets)], mode, n, idle)

    def _start_reader(self, target: Target, mode: str, n: int, idle: float | None) -> None:
        con = target.con
        if target.index is not None and not con.split:
            con.split = True  # from now on the batch is read per sub-request
            for req in con.reqs:  # a failure must be reported however the batch is read
                req.errors_ok |= con.group_err or set()
        if target.mode is None:
            target.mode = mode
        if target.mode == "result":
            for req in target.reqs:
                req.collecting = True
        if target.mode == "ready" and idle is not None:
            con.idle_used = True
        obj = self._obj(target)

        async def action() -> None:
            loop = asyncio.get_running_loop()
            assert target.mode is not None
            target.task = loop.create_task(self._read(target, obj, target.mode, n, idle))

        self._run(action)

    @precondition(lambda self: not _open("reading_batch_streams_splits_the_batch"))
    @rule(pick=_pick)
    def peek_at_batch_streams(self, pick: int) -> None:
        """Reading ``Batch.streams`` only to log the rids must not change the batch.

        Only before the batch itself is read: whether ``streams`` may raise once the
        batch is being read is the core's choice (today it raises RuntimeError).
        """
        batches = [
            con
            for con in self.cons
            if con.is_batch and con.obj is not None and con.whole.mode is None
        ]
        if not batches:
            return
        batch = batches[pick % len(batches)].obj
        assert isinstance(batch, tether.Batch)
        assert [stream.rid for stream in batch.streams] == list(batch.rids)

    def _closable(self) -> list[Target]:
        targets = []
        for con in self.cons:
            if con.obj is not None:
                targets.append(con.whole)
                if con.split:
                    targets.extend(con.subs)
        return targets

    @rule(pick=_pick, how=st.sampled_from(["aclose", "cancel"]), now=_sometimes)
    def close_consumer(self, pick: int, how: str, now: bool) -> None:
        targets = self._closable()
        if not targets or not now:
            return
        target = targets[pick % len(targets)]
        con = target.con
        obj = self._obj(target)
        whole = target.index is None
        reqs = con.reqs if whole else target.reqs

        async def action() -> None:
            if how == "aclose":
                await obj.aclose()
            else:
                obj.cancel()

        self._run(action)
        if how == "aclose":
            for closed in [con.whole, *con.subs] if whole else [target]:
                closed.closed = True
        self._consumer_abort(con, reqs, _aborted(AbortReason.CANCELLED))

    @rule(pick=_pick, now=_sometimes)
    def cancel_reading_task(self, pick: int, now: bool) -> None:
        """Cancelling the task parked in a read is an abort of that consumer."""
        parked = [t for con in self.cons for t in [con.whole, *con.subs] if t.task is not None]
        if not parked or not now:
            return
        target = parked[pick % len(parked)]
        task = target.task
        assert task is not None

        async def action() -> None:
            task.cancel()

        self._consumer_abort(target.con, target.reqs, _aborted(AbortReason.CANCELLED))
        self._run(action)
        assert task.cancelled(), f"reading {self._name(target)} was not cancelled: {task!r}"

    @rule(
        pick=_pick,
        mode=st.sampled_from(["result", "iter", "next_ready", "ready"]),
    )
    def second_reader(self, pick: int, mode: str) -> None:
        """A second task reading a consumer that one task is reading is refused at once,
        and the first reads on as if nothing had happened (the model is unchanged)."""
        parked = [
            target
            for con in self.cons
            if con.obj is not None
            for target in [con.whole, *con.subs]
            if target.task is not None and not target.task.done()
        ]
        if not parked:
            return
        target = parked[pick % len(parked)]
        obj = self._obj(target)

        async def action() -> object:
            try:
                if mode == "result":
                    return await obj.result()
                if mode == "iter":
                    return await anext(obj)
                if mode == "next_ready":
                    return await obj.next_ready()
                return obj.ready()
            except tether.ConcurrentRead as exc:
                return exc

        got = self._run(action)
        assert isinstance(got, tether.ConcurrentRead), (
            f"a second reader ({mode}) of {self._name(target)} got {got!r}, not refused"
        )

    @precondition(lambda self: self.opened > 0)
    @rule(
        pick=_pick,
        call=st.sampled_from(
            ["open", "open_batch", "fail", "abort", "fail_all", "cancel", "deliver"]
        ),
    )
    def call_from_another_thread(self, pick: int, call: str) -> None:
        """Whatever changes the table, called from another thread than the loop's, is
        refused at once with WrongLoop and changes nothing."""
        rid = self._pick_rid(pick)
        held = [con for con in self.cons if con.obj is not None]
        fresh = [req for req in self._live() if not req.delivered]
        con = held[pick % len(held)] if held else None
        calls: dict[str, Callable[[], object]] = {
            "open": lambda: self.reg.open(),
            "open_batch": lambda: self.reg.open_batch(2),
            "fail": lambda: self.reg.fail(rid, RuntimeError("from a thread")),
            "abort": lambda: self.reg.abort(rid),
            "fail_all": lambda: self.reg.fail_all(RuntimeError("from a thread")),
        }
        refused = True
        if call == "cancel":
            if con is None or con.obj is None:
                return
            calls["cancel"] = con.obj.cancel
            refused = any(req.live for req in con.reqs)
        elif call == "deliver":  # (checked at a request's first output: once per request)
            if not fresh:
                return
            first = fresh[pick % len(fresh)].rid
            calls["deliver"] = lambda: self.reg.deliver(first, (0,))
        before = self.reg.stats()

        def run() -> object:
            try:
                return calls[call]()
            except tether.WrongLoop as exc:
                return exc

        outcome = [_OTHER_THREAD.submit(run).result(timeout=10)]
        if refused:
            assert isinstance(outcome[0], tether.WrongLoop), f"{call}() from a thread: {outcome}"
        else:
            assert outcome[0] is False, f"{call}() from a thread: {outcome}"
        after = self.reg.stats()
        assert (after.opened, after.in_flight, after.late_outputs) == (
            before.opened,
            before.in_flight,
            before.late_outputs,
        ), f"{call}() from a thread changed the table: {before} -> {after}"

    @rule()
    def collect_garbage(self) -> None:
        async def action() -> None:
            self.force_gc()

        self._run(action)

    def _take_in_gc(self) -> None:
        """The consumers that collections freed since the model last looked: their
        finalisers aborted what was in flight."""
        for con, _ in self.freed:
            self._consumer_abort(con, con.reqs, _aborted(AbortReason.CANCELLED))
        self.freed.clear()

    @rule(pick=_pick, now=_sometimes, cycle=_sometimes)
    def drop_consumer(self, pick: int, now: bool, cycle: bool) -> None:
        """A consumer dropped without being closed is aborted by its finaliser: at once,
        or (held in a reference cycle) at the next garbage collection, wherever that
        runs (inside merge, on_abort, an observer, or a step of its own)."""
        droppable = [
            con
            for con in self.cons
            if con.obj is not None
            and all(t.task is None for t in [con.whole, *con.subs])
            and not (
                con.idle_used
                and any(req.live for req in con.reqs)
                and _open("idle_timer_keeps_a_dropped_consumer_alive")
            )
        ]
        if not droppable or not now:
            return
        con = droppable[pick % len(droppable)]
        had_live = any(req.live for req in con.reqs)
        caught: list[type[Warning]] = []
        if cycle and had_live:

            async def hold() -> None:
                holder: list[Any] = [con.obj]
                holder.append(holder)  # only a collection frees the consumer now
                self.doomed[id(con)] = (con, weakref.ref(con.obj))
                con.obj = None

            self._run(hold)
            for target in [con.whole, *con.subs]:
                target.done = True
            return

        async def action() -> None:
            assert con.obj is not None
            ref = weakref.ref(con.obj)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always", ResourceWarning)
                con.obj = None
                caught.extend(w.category for w in seen)
                seen.clear()  # a warning holds its source: the consumer
                if had_live and ref() is not None:  # an error's traceback holds it in a cycle
                    gc.collect()
                    self._note_freed(False)  # (doomed consumers may go too)
                    caught.extend(w.category for w in seen)
                    seen.clear()
            assert not had_live or ref() is None, (
                "the dropped consumer is still referenced (not by the test), so its finaliser "
                "did not run and its requests stay in flight"
            )

        self._run(action)
        for target in [con.whole, *con.subs]:
            target.done = True
        assert ResourceWarning in caught or not had_live, (
            "a consumer dropped while in flight gave no ResourceWarning"
        )
        self._consumer_abort(con, con.reqs, _aborted(AbortReason.CANCELLED))

    # -- time and shutdown ------------------------------------------------------------

    @rule(dt=st.sampled_from([0.5, 1.0, 2.0]))
    def advance_clock(self, dt: float) -> None:
        assert self.loop is not None
        self.loop.now += dt
        for con in self.cons:
            if con.deadline is not None and con.deadline <= self.loop.now:
                self._consumer_abort(con, con.reqs, _aborted(AbortReason.TIMEOUT))

        async def action() -> None:
            pass

        self._run(action)

    def _shutdown(self) -> None:
        live = self._live()

        async def action() -> None:
            await self.reg.close(drain_timeout=0)

        self._run(action)
        self.closed = True
        for req in live:
            if req.live:
                self._request_error(req, "aborted", _aborted(AbortReason.SERVER), (1, 1))

    @rule(now=_rarely, really=_sometimes)
    def close_registry(self, now: bool, really: bool) -> None:
        if now and really:
            self._shutdown()

    # -- invariants ---------------------------------------------------------------------

    def _check_aborts(self, req: Req) -> None:
        calls = self.aborts[req.rid] - req.abort_base
        low, high = req.aborts
        assert low <= calls <= high, (
            f"on_abort({req.rid!r}) ran {calls} times; {req.outcome} requests want {low}..{high}"
        )

    @invariant()
    def registry_agrees_with_the_model(self) -> None:
        if self.registry is None:
            return
        self._take_in_gc()
        self._collect_readers()
        assert not self.identity_broken, f"the counters did not add up {self.identity_broken}"
        assert not self.unraisable, f"unraisable exceptions: {self.unraisable}"
        assert not self.loop_errors, f"errors in the loop's exception handler: {self.loop_errors}"
        assert not self.on_abort_too_early, (
            f"on_abort ran while the rid was still in flight: {self.on_abort_too_early}"
        )
        live = self._live()
        assert self.reg.in_flight == len(live), (
            f"in_flight={self.reg.in_flight}, the model has {sorted(r.rid for r in live)}"
        )
        for req in self.latest.values():
            assert (req.rid in self.reg) is req.live, f"{req.rid} live={req.live} ({req.outcome})"
            self._check_aborts(req)
        for req in self.reqs:
            got = req.received
            assert got == req.delivered[: len(got)], (
                f"{req.rid}: read {got}, delivered {req.delivered} (order, once, own outputs)"
            )
        stats = self.reg.stats()
        ended = stats.finished + stats.failed + sum(stats.aborted.values())
        assert stats.opened == ended + stats.in_flight, f"the counters do not add up: {stats}"
        low, high = self.late
        assert low <= stats.late_outputs <= high, f"late_outputs={stats.late_outputs}, {self.late}"
        assert stats.opened == self.opened
        assert stats.closed is self.closed is self.reg.closed
        assert stats.in_flight == len(live)
        ended = Counter(req.outcome for req in self.reqs)
        assert stats.finished == ended["finished"], f"stats {stats}, model {ended}"
        # A request failed by a raising merge counts as failed or aborted: the fix chooses.
        assert ended["failed"] <= stats.failed <= ended["failed"] + ended["merge_failed"]
        assert stats.failed + stats.aborted_total == (
            ended["failed"] + ended["aborted"] + ended["merge_failed"]
        ), f"stats {stats}, model {ended}"
        for con in self.cons:
            if con.obj is not None:
                assert con.obj.finished is not any(req.live for req in con.reqs), con.obj

    # -- the end ------------------------------------------------------------------------

    def teardown(self) -> None:
        failing = sys.exc_info()[0] is not None
        try:
            if self.registry is not None and not failing:
                self._close_everything()
        finally:
            self._dispose()
            sys.unraisablehook = self._previous_hook
            if self._gc_was_enabled:
                gc.enable()
        if not failing:
            assert not self.unraisable, f"unraisable exceptions: {self.unraisable}"
            assert not self.loop_errors, (
                f"errors in the loop's exception handler: {self.loop_errors}"
            )

    def _close_everything(self) -> None:
        """The producer finishes what is in flight and every consumer reads to its end
        (invariant 1); then what a server's handlers do at the end: every consumer
        closed, then shutdown; then nothing is in flight and every on_abort ran
        (invariants 2 and 3)."""
        for req in self._live():
            if req.live:  # a sibling's overflow may have ended it meanwhile
                self._deliver(req.rid, True, False)
        for _ in range(3):  # readers that pause after n items go on reading
            self._collect_readers()
            for target in self._readable():
                if target.index is None or target.con.split:
                    self._start_reader(target, target.mode or "iter", 1 << 30, None)
            self.registry_agrees_with_the_model()
        for con in self.cons:
            for target in [con.whole, *con.subs]:
                if target.mode is not None and con.obj is not None:
                    assert target.done, f"reading {self._name(target)} did not end: {target}"
        for con in self.cons:
            for target in [con.whole, *con.subs]:
                if target.task is not None:
                    self._consumer_abort(con, target.reqs, _aborted(AbortReason.CANCELLED))
                    target.task.cancel()
        for con in self.cons:
            if con.obj is not None:
                obj = con.obj

                async def action(obj: tether.Stream | tether.Batch = obj) -> None:
                    await obj.aclose()

                self._run(action)
                self._consumer_abort(con, con.reqs, _aborted(AbortReason.CANCELLED))
        self._shutdown()
        self.registry_agrees_with_the_model()
        assert self.reg.in_flight == 0

    def _dispose(self) -> None:
        """Cancel and await every reading task, free every consumer, close the loop."""
        loop = self.loop
        if loop is None:
            return
        tasks = [t.task for con in self.cons for t in [con.whole, *con.subs] if t.task]
        for task in tasks:
            task.cancel()

        async def finish() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)
            refs = [weakref.ref(con.obj) for con in self.cons if con.obj is not None]
            for con in self.cons:
                con.obj = None
            self.cons.clear()
            if any(not getattr(ref(), "finished", True) for ref in refs):
                gc.collect()  # finalisers that abort run now, on this loop, not in the next example
            for _ in range(_SETTLE_TURNS):
                await asyncio.sleep(0)

        try:
            loop.run_until_complete(finish())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def test_any_sequence_of_public_operations_keeps_the_registry_invariants() -> None:
    run_state_machine_as_test(
        RegistryMachine,
        settings=settings(
            max_examples=1000,
            stateful_step_count=30,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


def test_a_consumer_freed_by_a_collection_inside_another_deliver_leaves_its_rid_late() -> None:
    """What the machine found, as one sequence: at the end, delivering to the first
    stream sets off a collection (an observer's, at its first output) that frees a second
    stream dropped in a cycle; the producer's next deliver to that stream's rid is then
    late (``False``, counted), as ``Registry.deliver`` says, and the model must agree."""
    machine = RegistryMachine()
    machine.start(
        eager=False,
        merge=False,
        max_in_flight=None,
        max_pending=1,
        streams=1,
        batch=None,
        keep_going=False,
        gc_points=frozenset(["merge", "observer"]),
    )
    machine.open_stream(rid=None, timeout=None)
    machine.read(idle=None, mode="iter", n=1, pick=0)
    machine.drop_consumer(cycle=True, now=True, pick=0)
    machine.teardown()


async def test_a_consumer_dropped_after_an_idle_read_is_aborted_at_once() -> None:
    """What the machine found, as one example: the loop must not keep a dropped
    consumer alive, or its request runs on until the idle interval ends."""
    aborted = asyncio.Event()
    registry = tether.Registry(lambda rid: aborted.set())
    stream = registry.open()
    asyncio.get_running_loop().call_soon(registry.deliver, stream.rid, "first")
    assert await stream.next_ready(timeout=60.0) == ["first"]  # it waited: its idle timer is armed
    ref = weakref.ref(stream)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del stream
        assert registry.in_flight == 0, "the dropped stream is still alive: nothing aborted it"
        async with asyncio.timeout(10):
            await aborted.wait()
    finally:
        survivor = ref()
        if survivor is not None:  # close it here, not in a later test's garbage collection
            await survivor.aclose()
