"""tether for Starlette and FastAPI: install :class:`TetherMiddleware`, answer with
``await respond(request, stream_or_batch, streaming=...)``; :func:`json_errors` answers
Starlette's own errors as JSON. asyncio only. See ``docs/starlette.md``."""

from __future__ import annotations

from tether.http import lifespan

from ._errors import json_errors
from ._middleware import REGISTRY_KEY, TetherMiddleware, get_registry
from ._respond import respond, resume

__all__ = [
    "REGISTRY_KEY",
    "TetherMiddleware",
    "get_registry",
    "json_errors",
    "lifespan",
    "respond",
    "resume",
]
