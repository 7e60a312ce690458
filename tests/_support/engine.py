"""A batching engine the tests drive by hand: each :meth:`StepEngine.step` emits one
token for every running request, in one ``deliver_many``, as inference engines do.

Tokens are deterministic (:func:`expected_text`), so a test can tell whose tokens a
client got; the engine knows requests only by their id, as real engines do, which is
what makes a rid reused too early dangerous.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tether


def token_at(prompt: str, position: int) -> str:
    """The token emitted for ``prompt`` at ``position`` (0-based)."""
    return f" {prompt}#{position}"


def expected_text(prompt: str, tokens: int) -> str:
    """The text of the first ``tokens`` tokens for ``prompt``."""
    return "".join(token_at(prompt, position) for position in range(tokens))


def merge_outputs(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    """The registry's ``merge`` for this engine's outputs: the texts concatenate."""
    return {"text": older["text"] + newer["text"]}


class EngineFailure(RuntimeError):
    """The engine failed one request on purpose (``fail_after``)."""


@dataclasses.dataclass
class _Job:
    prompt: str
    max_tokens: int
    fail_after: int | None
    produced: int = 0


class StepEngine:
    """Requests submitted by id, advanced one token per :meth:`step`; ``abort`` (the
    registry's ``on_abort``) drops a request at once."""

    def __init__(self) -> None:
        self.registry: tether.Registry | None = None
        self.jobs: dict[str, _Job] = {}

    def bind(self, registry: tether.Registry) -> None:
        self.registry = registry

    def submit(
        self, rid: str, prompt: str, max_tokens: int, *, fail_after: int | None = None
    ) -> None:
        """Run ``rid``; with ``fail_after``, fail it once it has produced that many tokens."""
        self.jobs[rid] = _Job(prompt, max_tokens, fail_after)

    def abort(self, rid: str) -> None:
        self.jobs.pop(rid, None)

    def step(self) -> None:
        """One token for each running request; failures go out after the step's outputs."""
        assert self.registry is not None, "bind() the engine to a registry first"
        items: list[tuple[str, dict[str, Any], bool]] = []
        failing: list[str] = []
        for rid, job in list(self.jobs.items()):
            if job.fail_after == job.produced:
                failing.append(rid)
                continue
            token = token_at(job.prompt, job.produced)
            job.produced += 1
            finished = job.produced == job.max_tokens
            items.append((rid, {"text": token}, finished))
            if finished:
                del self.jobs[rid]
        self.registry.deliver_many(items)
        for rid in failing:
            produced = self.jobs.pop(rid).produced
            self.registry.fail(rid, EngineFailure(f"{rid} failed after {produced} tokens"))
