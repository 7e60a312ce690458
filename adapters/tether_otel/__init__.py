"""OpenTelemetry tracing for tether: ``pip install -e '.[otel]'`` from a checkout (the API only).

::

    tether_otel.instrument(registry)   # spans go to the global tracer provider

Each request gets a ``tether.request`` span, a child of the span current where
``registry.open()`` was called (the incoming HTTP span, under an instrumented
server); a batch gets a ``tether.batch`` span with one child per sub-request.
Attributes: ``tether.rid``, ``tether.request_id`` (the client's ``X-Request-Id``),
``tether.outcome`` (finished, failed, aborted), ``tether.abort_reason``,
``tether.time_to_first_output`` and ``tether.total_time`` (seconds); events
``tether.first_output`` and ``tether.aborted``.

Opt-in, and a no-op when ``opentelemetry-api`` is not installed (``instrument``
attaches nothing and returns ``None``) or no SDK provider is set (spans are
non-recording and nothing is kept).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import tether

if TYPE_CHECKING:
    from ._tracing import RequestTracer

__all__ = ["instrument"]

logger = logging.getLogger("tether.otel")


def instrument(registry: tether.Registry, *, tracer_provider: Any = None) -> RequestTracer | None:
    """Trace every request of ``registry`` from now on.

    :param tracer_provider: an ``opentelemetry.trace.TracerProvider``; the global one
        by default.
    :returns: the attached tracer (detach it with ``registry.remove_observer``), or
        ``None`` when ``opentelemetry-api`` is not installed.
    """
    try:
        from ._tracing import RequestTracer
    except ImportError:
        logger.debug("opentelemetry-api is not installed: tether requests are not traced")
        return None
    tracer = RequestTracer(tracer_provider)
    registry.add_observer(tracer)
    return tracer
