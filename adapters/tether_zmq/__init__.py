"""tether_zmq: the engine in its own process or host, any number of front workers, over ZeroMQ.

The engine binds one ROUTER (:class:`EngineServer`); every front worker process
connects one DEALER per engine (:class:`EngineClient`), created after the fork,
that submits requests, feeds the outputs into its ``tether.Registry`` and turns
the registry's aborts into abort messages. ``docs/zmq.md`` has the topology, the
protocol and the failure handling. Needs ``pip install -e '.[zmq]'`` from a checkout.
"""

from __future__ import annotations

from ._engine import EngineServer
from ._errors import (
    EngineLost,
    EngineUnavailable,
    LinkDown,
    PayloadTooLarge,
    RemoteFailure,
    UnencodableRequest,
)
from ._events import Cancellation, EngineClientStats, EngineServerStats, RequestKey, Submission
from ._front import EngineClient
from ._protocol import PROTOCOL_VERSION, Codec, MsgpackCodec
from ._security import CurveClient, CurveServer, InsecureAddress

__all__ = [
    "PROTOCOL_VERSION",
    "Cancellation",
    "Codec",
    "CurveClient",
    "CurveServer",
    "EngineClient",
    "EngineClientStats",
    "EngineLost",
    "EngineServer",
    "EngineServerStats",
    "EngineUnavailable",
    "InsecureAddress",
    "LinkDown",
    "MsgpackCodec",
    "PayloadTooLarge",
    "RemoteFailure",
    "RequestKey",
    "Submission",
    "UnencodableRequest",
]
