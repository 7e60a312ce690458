"""What the link raises, and what it fails requests with.

::

    tether.Overloaded
    └── EngineUnavailable      submit() while no session is up, or the link is
                               full: 503 + Retry-After at once, nothing registered
    tether.InvalidRequest       (a ValueError)
    └── UnencodableRequest     a request the codec cannot encode (a lone surrogate,
                               an object it does not know): 422, nothing registered
    tether.BatchTooLarge        (a ValueError)
    └── PayloadTooLarge        a request that cannot fit one message: 413 through
                               both adapters' error_response, nothing registered
    RuntimeError                (causes of tether.ProducerError, on the front)
    ├── EngineLost             the link died under a request in flight (503)
    ├── RemoteFailure          the engine failed the request (its status code)
    └── LinkDown               EngineServer.receive(): the link's own machinery
                               died (one of its tasks); every front was let go
"""

from __future__ import annotations

import logging

import tether

__all__ = [
    "EngineLost",
    "EngineUnavailable",
    "LinkDown",
    "PayloadTooLarge",
    "RemoteFailure",
    "UnencodableRequest",
]


class EngineUnavailable(tether.Overloaded):
    """Raised by the front's ``submit()``/``open()`` when the engine cannot take work now.

    It is an :class:`~tether.Overloaded`, so both adapters' ``error_response`` answer
    503 with ``Retry-After``; a handler never waits for an engine that is not there.
    """

    def __init__(self, reason: str, *, retry_after: float = 1.0) -> None:
        # Overloaded's own message speaks of max_in_flight: say what happened instead.
        tether.TetherError.__init__(self, f"the engine is not available: {reason}; retry later")
        self.limit = 0
        self.retry_after = retry_after
        self.reason = reason


class PayloadTooLarge(tether.BatchTooLarge):
    """Raised by ``submit()`` for a request larger than the engine accepts (its
    ``max_message``, announced in its welcome, or the front's own if smaller).

    It is a :class:`~tether.BatchTooLarge`, so ``error_response`` answers 413 with no
    ``Retry-After``: the same request can never fit, however long the client waits.
    """

    status_code = 413

    def __init__(self, size: int, limit: int, *, unit: str = "bytes") -> None:
        # BatchTooLarge's own message speaks of max_in_flight: say what happened instead.
        tether.TetherError.__init__(
            self, f"a request of {size} {unit} exceeds the link's limit of {limit} {unit}"
        )
        self.size = size
        self.limit = limit


class UnencodableRequest(tether.InvalidRequest):
    """Raised by ``submit()`` for a request the link's codec cannot encode: text with
    a lone surrogate (not UTF-8), an object the codec does not know. ``error_response``
    answers 422; the codec's own error is the ``__cause__``."""

    def __init__(self, rid: str, error: Exception) -> None:
        super().__init__(f"request {rid!r} cannot be sent to the engine: {error}")
        self.rid = rid


class EngineLost(RuntimeError):
    """The cause of the ``ProducerError`` of every request in flight when the link died
    (engine killed, hung, restarted, or a sequence gap): the client gets 503.

    The front logs the loss once (``engine link lost ...: failing N requests``,
    throttled), so ``error_response`` logs each request it failed at DEBUG only
    (:attr:`log_level`): one loss is never N lines at ERROR."""

    status_code = 503
    log_level = logging.DEBUG


class RemoteFailure(RuntimeError):
    """The cause of a ``ProducerError`` the engine sent: its message and status code
    (the message reaches the client only for a 4xx, as for any producer error).

    Any other status's message reaches only logs (``error_response`` logs the cause
    with its traceback): its ``str`` is then the engine's text quoted and escaped, so
    that a newline in it can forge no line. :attr:`text` is the text as sent.
    """

    def __init__(self, message: str, status_code: int) -> None:
        client_facing = 400 <= status_code <= 499
        # (repr: every control character escaped, as quoted() does, with nothing cut)
        super().__init__(message if client_facing else repr(message))
        self.status_code = status_code
        self.text = message


class LinkDown(RuntimeError):
    """Raised by :meth:`EngineServer.receive` once the link itself has stopped: one of
    its background tasks died. The socket is closed (every front sees the engine
    gone and fails its requests with :class:`EngineLost`); the engine loop should
    end, loudly, and be restarted."""
