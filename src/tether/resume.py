"""What store authors need: resumable streams.

A client that reconnects with ``Last-Event-ID`` (or the resume token) continues a
stream where it left off, exactly once and in order: :class:`Resume` is the policy
an application passes to an adapter's ``respond(..., resume=)`` and ``resume()``;
a store (:class:`MemoryStore` in process, ``tether_redis.RedisStore`` across
workers) keeps each stream's log (:class:`Channel`) and hands out its readers
(:class:`Follower`, which the HTTP exchange reads as a :class:`tether.http.Numbered`
source). See ``docs/resume.md``. Built on :mod:`tether` and :mod:`tether.http`.
"""

from __future__ import annotations

from ._memory_store import MemoryStore, new_token
from ._responses import TOKEN_HEADER
from ._resume import NOT_RESUMABLE, RESUME_UNAVAILABLE, Resume, ResumePoint, resume_point
from ._resume_log import Channel, Follower, Keeper
from ._scope import wait_withdrawn

__all__ = [
    "NOT_RESUMABLE",
    "RESUME_UNAVAILABLE",
    "TOKEN_HEADER",
    "Channel",
    "Follower",
    "Keeper",
    "MemoryStore",
    "Resume",
    "ResumePoint",
    "new_token",
    "resume_point",
    "wait_withdrawn",
]
