"""tether for aiohttp: ``setup(app, registry)`` installs the plugin, ``await
respond(request, stream_or_batch, ...)`` answers; :func:`json_errors` answers aiohttp's
own errors as JSON. See ``docs/aiohttp.md``."""

from __future__ import annotations

from ._errors import json_errors
from ._plugin import REGISTRY_KEY, get_registry, setup
from ._respond import respond, resume

__all__ = ["REGISTRY_KEY", "get_registry", "json_errors", "respond", "resume", "setup"]
