"""tether on Redis Streams: resumable streams that a reconnect continues on any worker.

``tether.resume.Resume(store=RedisStore(client))`` records each resumable stream's events
in a Redis stream (``XADD`` bounded by ``MAXLEN``) as well as in process; a
reconnect that lands on another worker reads the backlog there and follows the live
tail (``XREAD BLOCK``). See :class:`RedisStore`.
"""

from __future__ import annotations

from ._ear import StoreRefused, StoreUnreachable
from ._store import RedisStore

__all__ = ["RedisStore", "StoreRefused", "StoreUnreachable"]
