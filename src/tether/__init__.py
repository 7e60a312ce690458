"""tether: the request-state table for asyncio servers that hand work to a producer.

``Registry.open()`` registers a request and returns a :class:`Stream` that already
holds its state; the producer routes outputs with ``deliver()``/``fail()``; an
adapter (``tether_starlette``, ``tether_aiohttp``) turns streams into HTTP
responses and client disconnects into aborts. This package imports no web
framework.

These names are for application authors; adapter authors find the HTTP exchange
and its write loop in :mod:`tether.http`, store authors resumable streams in
:mod:`tether.resume` (``Resume``, ``MemoryStore``). This module imports neither.
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
    "Stream",
    "Summary",
    "TetherError",
    "UnknownRequest",
    "WrongLoop",
    "approximate_size",
]
