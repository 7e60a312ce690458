"""A simulated continuous-batching engine: the producer the example servers hand work to.

It stands in for an inference engine. A scheduler loop admits waiting requests
into the running batch, up to ``max_batch``, and every step (a few milliseconds)
emits one token for every running request, delivering the whole step into the
registry in one pass. Each request finishes at its own ``max_tokens``; the
registry frees it and its slot goes to the next waiting request at the next step.
:meth:`Engine.abort` is the registry's ``on_abort``: an aborted request leaves the
running batch at the next step and its slot is reused.

Tokens are a pure function of the prompt and the position (:func:`token_at`), so a
client can check that it received every token, in order. For tests, the engine
can fail a fraction of its requests (:class:`SimulatedFailure`) or crash as a
whole (every request in flight fails; new ones are refused until
:meth:`Engine.recover`). Otherwise one request's failure stays its own: a request
whose token cannot be computed is failed alone, and the rest of its step goes
out as usual.

Wiring, as in the example servers::

    engine = Engine(max_batch=32)
    registry = tether.Registry(on_abort=engine.abort, merge=merge_outputs)
    async with engine.running(registry):
        ...  # handlers: stream = registry.open(); engine.submit(stream.rid, prompt, n)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import logging
import random
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import tether
import tether.http
from tether.http import stop_tasks

__all__ = [
    "Engine",
    "EngineStats",
    "EngineUnavailable",
    "SimulatedFailure",
    "chat_prompt",
    "expected_text",
    "merge_outputs",
    "output",
    "prompt_tokens",
    "token_at",
]

logger = logging.getLogger("tether.examples.engine")

VOCAB = (
    "amber", "bridge", "cedar", "delta", "ember", "fjord", "glade", "harbor",
    "island", "juniper", "kelp", "lagoon", "meadow", "nectar", "orchid", "prairie",
    "quartz", "river", "summit", "tundra", "umber", "valley", "willow", "xenon",
    "yarrow", "zephyr", "anchor", "beacon", "canyon", "dune", "estuary", "forest",
)  # fmt: skip


def token_at(prompt: str, position: int) -> str:
    """The token the engine emits for ``prompt`` at ``position`` (0-based): a space and a word."""
    digest = hashlib.blake2b(f"{position}\x00{prompt}".encode(), digest_size=4).digest()
    return " " + VOCAB[int.from_bytes(digest, "big") % len(VOCAB)]


def prompt_tokens(prompt: str) -> int:
    """How many tokens ``prompt`` counts for (the usage an answer reports): its words."""
    return len(prompt.split())


def chat_prompt(messages: Iterable[tuple[str, str]]) -> str:
    """The prompt a chat's ``(role, text)`` messages become (the engine's chat template):
    one ``role: text`` line each, then the line the assistant's answer continues."""
    return "".join(f"{role}: {text}\n" for role, text in messages) + "assistant:"


def expected_text(prompt: str, tokens: int) -> str:
    """The text of the first ``tokens`` tokens for ``prompt``: what a client must have seen."""
    return "".join(token_at(prompt, position) for position in range(tokens))


def output(
    rid: str, text: str, completion_tokens: int, finish_reason: str | None
) -> dict[str, Any]:
    """One engine output, already in the ``/generate`` wire shape.

    :param text: the new text (a delta) of this output.
    :param completion_tokens: how many tokens the request has produced so far.
    :param finish_reason: ``"length"`` on the last output, else ``None``.
    """
    meta = {"id": rid, "finish_reason": finish_reason, "completion_tokens": completion_tokens}
    return {"text": text, "meta_info": meta}


def merge_outputs(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    """The registry's ``merge``: deltas concatenate, the newest ``meta_info`` wins.

    It folds outputs that wait for a slow reader into one, and builds the full
    text for a non-streaming ``result()``.
    """
    return {"text": older["text"] + newer["text"], "meta_info": newer["meta_info"]}


class SimulatedFailure(RuntimeError):
    """The engine failed one request on purpose (``fail_fraction``)."""


class EngineUnavailable(RuntimeError):
    """The engine crashed: requests in flight failed, new ones are refused (HTTP 503)."""

    status_code = 503  # tether.http.error_response uses a producer error's 4xx/5xx status_code


@dataclasses.dataclass(slots=True)
class _Job:
    rid: str
    prompt: str
    max_tokens: int
    fail_after: int | None  # fail instead of emitting token number fail_after (0-based)
    produced: int = 0
    aborted_at: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's counters (the example servers add it to ``/stats``).

    :param running: requests in the running batch now.
    :param waiting: requests queued for a slot now.
    :param abort_to_free: from ``abort(rid)`` to the slot being freed, in seconds.
    """

    max_batch: int
    running: int
    waiting: int
    steps: int
    tokens: int
    submitted: int
    finished: int
    aborted: int
    failed: int
    crashed: bool
    abort_to_free: tether.Summary

    def as_dict(self) -> dict[str, Any]:
        """The snapshot as plain JSON-ready data."""
        return dataclasses.asdict(self)


class Engine:
    """A continuous-batching scheduler that delivers one token per running request per step.

    :param max_batch: how many requests run at once; the rest wait in arrival order.
    :param step_interval: seconds between two steps.
    :param fail_fraction: the share of requests (0 to 1) that fail part-way.
    :param seed: seeds the choice of the failing requests, for reproducible runs.
    """

    def __init__(
        self,
        *,
        max_batch: int = 32,
        step_interval: float = 0.005,
        fail_fraction: float = 0.0,
        seed: int = 0,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if not 0.0 <= fail_fraction <= 1.0:
            raise ValueError(f"fail_fraction must be between 0 and 1, got {fail_fraction}")
        self.max_batch = max_batch
        self.step_interval = step_interval
        self.fail_fraction = fail_fraction
        self._random = random.Random(seed)
        self._registry: tether.Registry | None = None
        self._waiting: dict[str, _Job] = {}
        self._running: dict[str, _Job] = {}
        self._leaving: list[_Job] = []
        self._wakeup = asyncio.Event()
        self._crash: BaseException | None = None
        self._crashed = False
        self._steps = self._tokens = self._submitted = 0
        self._finished = self._aborted = self._failed = 0
        self._abort_to_free: collections.deque[float] = collections.deque(maxlen=4096)
        self._abort_log: collections.deque[tuple[str, float]] = collections.deque(maxlen=4096)

    # -- wiring ----------------------------------------------------------------------

    def bind(self, registry: tether.Registry) -> None:
        """Deliver into ``registry`` from now on (:meth:`running` does this for you)."""
        self._registry = registry

    @contextlib.asynccontextmanager
    async def running(self, registry: tether.Registry) -> AsyncIterator[Engine]:
        """Run the scheduler loop against ``registry`` for the duration of the block.

        The loop task is owned here: cancelled and awaited on exit.
        """
        self.bind(registry)
        task = asyncio.create_task(self._loop(), name="engine-scheduler")
        try:
            yield self
        finally:
            await stop_tasks((task,))

    def _require_registry(self) -> tether.Registry:
        if self._registry is None:
            raise RuntimeError(
                "the engine is not bound to a registry: use engine.running(registry)"
            )
        return self._registry

    # -- requests ----------------------------------------------------------------------

    def submit(
        self, rid: str, prompt: str, max_tokens: int, *, fail_after: int | None = None
    ) -> None:
        """Queue a request whose stream is already open in the registry.

        A crashed engine fails it at once with :class:`EngineUnavailable`.

        :param fail_after: fail the request with :class:`SimulatedFailure` after this
            many tokens; ``None`` leaves the choice to ``fail_fraction``.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        registry = self._require_registry()
        self._submitted += 1
        if self._crashed:
            self._failed += 1
            registry.fail(rid, EngineUnavailable("the engine crashed; retry later"))
            return
        if fail_after is None and self._random.random() < self.fail_fraction:
            fail_after = self._random.randrange(max_tokens)
        self._waiting[rid] = _Job(rid, prompt, max_tokens, fail_after)
        self._wakeup.set()

    def abort(self, rid: str) -> None:
        """Abort ``rid`` (the registry's ``on_abort``): a waiting request is dropped now,
        a running one leaves the batch at the next step. Unknown rids are ignored."""
        now = time.monotonic()
        job = self._waiting.pop(rid, None)
        if job is not None:
            self._aborted += 1
            self._abort_log.append((rid, now))
            return
        job = self._running.get(rid)
        if job is not None and job.aborted_at is None:
            job.aborted_at = now
            self._abort_log.append((rid, now))
            self._leaving.append(job)

    def crash(self, exc: BaseException | None = None) -> None:
        """Make the next step crash: every request in flight fails, new ones are refused."""
        self._crash = exc or EngineUnavailable("the engine crashed (simulated)")
        self._wakeup.set()

    def recover(self) -> None:
        """Accept requests again after a crash."""
        self._crash = None
        self._crashed = False

    @property
    def crashed(self) -> bool:
        """Whether the engine crashed and has not recovered."""
        return self._crashed

    # -- the scheduler -------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if not (self._running or self._waiting or self._leaving or self._crash):
                self._wakeup.clear()
                await self._wakeup.wait()
            await asyncio.sleep(self.step_interval)
            try:
                self.step()
            except Exception as exc:
                # A real engine's step can raise anything; the loop must not die
                # silently with requests waiting: fail them all and refuse new ones.
                logger.exception("engine step failed; failing every request in flight")
                self._fail_everything(self._require_registry(), exc)

    def step(self) -> None:
        """One step: free aborted slots, admit waiting requests, emit one token each."""
        registry = self._require_registry()
        if self._crash is not None:
            self._fail_everything(registry, self._crash)
            return
        self._steps += 1
        now = time.monotonic()
        for job in self._leaving:
            if self._running.pop(job.rid, None) is not None and job.aborted_at is not None:
                self._aborted += 1
                self._abort_to_free.append(now - job.aborted_at)
        self._leaving.clear()
        while self._waiting and len(self._running) < self.max_batch:
            job = self._waiting.pop(next(iter(self._waiting)))
            self._running[job.rid] = job
        items: list[tuple[str, dict[str, Any], bool]] = []
        failing: list[tuple[_Job, Exception]] = []
        done: list[str] = []
        for job in self._running.values():
            if job.fail_after == job.produced:
                failure = SimulatedFailure(f"simulated failure after {job.produced} tokens")
                failing.append((job, failure))
                continue
            try:
                item = self._advance(job)
            except Exception as exc:
                # One request's work failed (a prompt the tokenizer cannot take, a bug
                # its data triggers): that request fails alone. Its batch-mates and the
                # engine go on; only a failure of the step as a whole is a crash.
                logger.error("request %r failed in the engine step", job.rid, exc_info=exc)
                failing.append((job, exc))
                continue
            items.append(item)
            if item[2]:
                done.append(job.rid)
        for rid in done:
            del self._running[rid]
        self._tokens += len(items)
        self._finished += len(done)
        # The step goes out as one batch; failures come after it, so that a failed
        # sub-request's aborted siblings have already had this step's outputs.
        registry.deliver_many(items)
        for job, error in failing:
            del self._running[job.rid]
            self._failed += 1
            registry.fail(job.rid, error)

    @staticmethod
    def _advance(job: _Job) -> tuple[str, dict[str, Any], bool]:
        """Emit ``job``'s next token as a ``(rid, output, finished)`` delivery."""
        token = token_at(job.prompt, job.produced)
        job.produced += 1
        finished = job.produced == job.max_tokens
        reason = "length" if finished else None
        return job.rid, output(job.rid, token, job.produced, reason), finished

    def _fail_everything(self, registry: tether.Registry, exc: BaseException) -> None:
        self._crash = None
        self._crashed = True
        self._failed += len(self._running) + len(self._waiting)
        self._running.clear()
        self._waiting.clear()
        self._leaving.clear()
        registry.fail_all(exc)

    # -- figures -------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of the counters."""
        return EngineStats(
            max_batch=self.max_batch,
            running=len(self._running),
            waiting=len(self._waiting),
            steps=self._steps,
            tokens=self._tokens,
            submitted=self._submitted,
            finished=self._finished,
            aborted=self._aborted,
            failed=self._failed,
            crashed=self._crashed,
            abort_to_free=tether.Summary.of(self._abort_to_free),
        )

    def recent_aborts(self) -> list[tuple[str, float]]:
        """The last 4096 aborts as ``(rid, time.monotonic() when on_abort ran)``.

        ``time.monotonic()`` is one system-wide clock on Linux and macOS, so a client
        on the same machine can subtract its own disconnect time from these.
        """
        return list(self._abort_log)
