"""tether: the request-state table for asyncio servers that hand work to a producer.

``Registry.open()`` registers a request and returns a :class:`Stream` that already
holds its state; the producer routes outputs with ``deliver()``/``fail()``; an
adapter (``tether_starlette``, ``tether_aiohttp``) turns streams into HTTP
responses and client disconnects into aborts. This package imports no web
framework.

These names are for application authors. Adapter authors find the HTTP exchange
and the error mapping in :mod:`tether.http`. Where each concept lives:
``_registry`` (the public front), ``_table`` (admission, the one end-of-request
path, ``on_abort``, counters), ``_state`` (mailboxes), ``_consumer`` (the reading
loop of ``_stream`` and ``_batch``), ``_scope``, ``_errors``, ``_encoders``,
``_stats``, ``_observe`` (hooks for metrics, traces, logs), ``_resume`` (resumable
streams); and for adapters ``_exchange``, ``_framing``, ``_responses``, ``_guard``.
"""

from __future__ import annotations

import logging

from ._batch import Batch
from ._encoders import NDJSON, SSE, Encoder
from ._errors import (
    MAX_RID_LENGTH,
    Aborted,
    AbortReason,
    BatchTooLarge,
    ConcurrentRead,
    ConsumerTooSlow,
    DuplicateRequest,
    InvalidRequest,
    InvalidRequestId,
    Overloaded,
    ProducerError,
    RegistryClosed,
    RequestTimeout,
    TetherError,
    UnknownRequest,
    WrongLoop,
)
from ._limits import DEFAULT_MAX_PENDING_BYTES, approximate_size
from ._observe import Observer, Outcome, RequestEnd
from ._registry import Registry
from ._replay import MemoryStore
from ._resume import Resume
from ._scope import RequestScope
from ._stats import RegistryStats, Summary
from ._stream import Stream

__version__ = "0.1.0"

# The library convention: records go nowhere until the application configures logging
# (not to Python's last-resort handler, which prints them bare); see docs/starlette.md.
logging.getLogger("tether").addHandler(logging.NullHandler())

__all__ = [
    "DEFAULT_MAX_PENDING_BYTES",
    "MAX_RID_LENGTH",
    "NDJSON",
    "SSE",
    "AbortReason",
    "Aborted",
    "Batch",
    "BatchTooLarge",
    "ConcurrentRead",
    "ConsumerTooSlow",
    "DuplicateRequest",
    "Encoder",
    "InvalidRequest",
    "InvalidRequestId",
    "MemoryStore",
    "Observer",
    "Outcome",
    "Overloaded",
    "ProducerError",
    "Registry",
    "RegistryClosed",
    "RegistryStats",
    "RequestEnd",
    "RequestScope",
    "RequestTimeout",
    "Resume",
    "Stream",
    "Summary",
    "TetherError",
    "UnknownRequest",
    "WrongLoop",
    "approximate_size",
]
