"""The link's public names, pinned; and the core stays free of ZeroMQ."""

from __future__ import annotations

import subprocess
import sys

import tether_zmq


def test_tether_zmq_exports_a_pinned_list() -> None:
    # (its order is ruff's RUF022: constants, then classes, then functions)
    assert set(tether_zmq.__all__) == {
        "PROTOCOL_VERSION", "Cancellation", "Codec", "CurveClient", "CurveServer",
        "EngineClient", "EngineClientStats", "EngineLost", "EngineServer",
        "EngineServerStats", "EngineUnavailable", "InsecureAddress", "LinkDown", "MsgpackCodec",
        "PayloadTooLarge", "RemoteFailure", "RequestKey", "Submission", "UnencodableRequest",
    }  # fmt: skip
    for name in tether_zmq.__all__:
        assert getattr(tether_zmq, name) is not None


def test_importing_tether_loads_neither_zmq_nor_msgspec() -> None:
    code = "import sys, tether; print(sorted(m for m in sys.modules if m in ('zmq', 'msgspec')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_engine_unavailable_is_an_overload_so_both_adapters_answer_503_retry_after() -> None:
    import tether
    import tether.http

    refusal = tether.http.error_response(tether_zmq.EngineUnavailable("down", retry_after=3))
    assert isinstance(tether_zmq.EngineUnavailable("down"), tether.Overloaded)
    assert refusal.status == 503
    assert refusal.headers == {"retry-after": "3"}
    assert "down" in refusal.body["error"]["message"]
