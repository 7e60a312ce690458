"""tether for Starlette and FastAPI: a pure ASGI middleware and ``respond()``.

Install :class:`TetherMiddleware` (it gives each request a
:class:`tether.RequestScope` and turns client disconnects into aborts), answer
with ``await respond(request, stream_or_batch, streaming=...)``, and close the
registry at shutdown with :func:`lifespan`. asyncio only.
"""

from __future__ import annotations

from ._middleware import TetherMiddleware, lifespan
from ._respond import respond

__all__ = ["TetherMiddleware", "lifespan", "respond"]
