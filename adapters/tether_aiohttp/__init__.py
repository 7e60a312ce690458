"""tether for aiohttp: ``setup(app, registry)`` and ``await respond(request, stream, ...)``.

``setup`` installs the plugin (registry under :data:`REGISTRY_KEY`, one middleware
that opens a :class:`tether.RequestScope` per request and notices clients that
leave, a shutdown drain); ``respond`` turns a :class:`tether.Stream` or
:class:`tether.Batch` into a JSON or streamed response; ``json_errors`` answers
aiohttp's own errors (404, 405, 413) as JSON too. See ``docs/aiohttp.md``.
"""

from __future__ import annotations

from ._errors import json_errors
from ._plugin import REGISTRY_KEY, get_registry, setup
from ._respond import respond, resume

__all__ = ["REGISTRY_KEY", "get_registry", "json_errors", "respond", "resume", "setup"]
