"""The public namespaces: ``tether`` for application authors, ``tether.http`` for adapter
authors, ``tether.resume`` for store authors, each adapter the same verbs (and the same
signatures); sorted ``__all__`` lists, pinned; no framework."""

from __future__ import annotations

import inspect
import pathlib
import re
import subprocess
import sys
import types

import tether
import tether.http
import tether.resume
import tether_aiohttp
import tether_starlette

CONTRACT = {
    "Registry",
    "Stream",
    "Batch",
    "RequestScope",
    "TetherError",
    "DuplicateRequest",
    "UnknownRequest",
    "Overloaded",
    "RegistryClosed",
    "Aborted",
    "RequestTimeout",
    "ProducerError",
    "ConsumerTooSlow",
    "SSE",
    "NDJSON",
}


def _isort_key(name: str) -> tuple[int, str]:
    """Constants, then classes, then functions: the order ruff's RUF022 keeps."""
    kind = 0 if name.isupper() else 1 if name[0].isupper() else 2
    return kind, name


def test_all_is_sorted_and_holds_every_contract_name() -> None:
    assert tether.__all__ == sorted(tether.__all__, key=_isort_key)
    assert set(tether.__all__) >= CONTRACT


def test_all_lists_every_public_name_of_the_package() -> None:
    public = {
        name
        for name, value in vars(tether).items()
        if not name.startswith("_")
        and name != "annotations"  # the __future__ import
        and not isinstance(value, types.ModuleType)
    }
    assert public == set(tether.__all__)


def test_every_exported_name_exists_and_is_documented() -> None:
    for name in tether.__all__:
        value = getattr(tether, name)
        if callable(value):
            assert value.__doc__, f"tether.{name} has no docstring"


def test_every_error_derives_from_tether_error() -> None:
    for name in CONTRACT:
        value = getattr(tether, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, tether.TetherError)


def test_importing_tether_loads_no_web_framework() -> None:
    probe = (
        "import sys, tether, tether.http, tether.resume; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'aiohttp')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


APPLICATION = {
    *CONTRACT,
    "AbortReason",
    "BatchTooLarge",
    "ConcurrentRead",
    "DEFAULT_MAX_PENDING_BYTES",
    "Encoder",
    "InvalidRequest",
    "InvalidRequestId",
    "MAX_RID_LENGTH",
    "Observer",
    "Outcome",
    "RegistryStats",
    "RequestEnd",
    "Summary",
    "WrongLoop",
    "approximate_size",
}

ADAPTER_AUTHORS = {
    "CLIENT_CLOSED_REQUEST",
    "DEFAULT_SEND_TIMEOUT",
    "FAREWELL_TIMEOUT",
    "MAX_REQUEST_ID_LENGTH",
    "NOBODY_READS",
    "REQUEST_ID_HEADER",
    "ErrorResponse",
    "Exchange",
    "Direct",
    "DrainOnSignal",
    "Driven",
    "Framework",
    "Numbered",
    "Resumable",
    "Responder",
    "Writer",
    "error_head",
    "lifespan",
    "read_ahead",
    "server_ended",
    "Head",
    "accept_request_id",
    "current_scope",
    "error_body",
    "error_response",
    "event_stream_responses",
    "http_error",
    "Schema",
    "Stepped",
    "stop_tasks",
    "validation_error",
}

STORE_AUTHORS = {
    "Channel",
    "Follower",
    "Keeper",
    "MemoryStore",
    "NOT_RESUMABLE",
    "RESUME_UNAVAILABLE",
    "Resume",
    "ResumePoint",
    "TOKEN_HEADER",
    "new_token",
    "resume_point",
    "wait_withdrawn",
}


def test_star_import_gives_application_authors_names_only() -> None:
    namespace: dict[str, object] = {}
    exec("from tether import *", namespace)
    assert set(namespace) - {"__builtins__"} == APPLICATION
    assert not APPLICATION & ADAPTER_AUTHORS
    assert not APPLICATION & STORE_AUTHORS


def test_adapter_authors_find_their_names_in_tether_http() -> None:
    assert tether.http.__all__ == sorted(tether.http.__all__, key=_isort_key)
    assert set(tether.http.__all__) == ADAPTER_AUTHORS
    for name in tether.http.__all__:
        assert getattr(tether.http, name) is not None


def test_store_authors_find_their_names_in_tether_resume() -> None:
    assert tether.resume.__all__ == sorted(tether.resume.__all__, key=_isort_key)
    assert set(tether.resume.__all__) == STORE_AUTHORS
    assert not STORE_AUTHORS & ADAPTER_AUTHORS
    for name in tether.resume.__all__:
        value = getattr(tether.resume, name)
        if callable(value):
            assert value.__doc__, f"tether.resume.{name} has no docstring"


def test_both_adapters_export_the_same_verbs_and_their_own_install_call() -> None:
    verbs = {"REGISTRY_KEY", "get_registry", "json_errors", "respond", "resume"}
    assert set(tether_starlette.__all__) == verbs | {"TetherMiddleware", "lifespan"}
    assert set(tether_aiohttp.__all__) == verbs | {"setup"}
    for adapter in (tether_starlette, tether_aiohttp):
        assert adapter.__all__ == sorted(adapter.__all__, key=_isort_key)
        for name in adapter.__all__:
            assert getattr(adapter, name).__doc__ or name.isupper(), name


def test_both_adapters_verbs_take_the_same_arguments() -> None:
    for verb in ("respond", "resume", "json_errors"):
        signatures = [
            inspect.signature(getattr(adapter, verb))
            for adapter in (tether_starlette, tether_aiohttp)
        ]
        names = [
            [(p.name, p.kind, p.default) for p in sig.parameters.values()] for sig in signatures
        ]
        assert names[0] == names[1], verb
        first = {"respond": ["request", "source"], "resume": ["request", "resume"]}
        assert [p.name for p in signatures[0].parameters.values()][:2] == first.get(
            verb, ["app", "shape"]
        )
    assert "transform" in inspect.signature(tether_aiohttp.respond).parameters


EXCHANGE_METHODS = {"start", "next_chunk", "run", "aclose"}


def test_an_exchange_offers_adapters_a_handful_of_methods() -> None:
    """One verb per meaning: start it, write it (``run``, or ``next_chunk`` for a writer
    that pulls), close it; everything else is the exchange's own business."""
    methods = {
        name
        for name, value in vars(tether.http.Exchange).items()
        if not name.startswith("_") and callable(value)
    }
    assert methods == EXCHANGE_METHODS
    assert len(methods) <= 8


def test_both_adapters_drive_an_exchange_through_the_same_methods() -> None:
    """Every adapter moves bytes the one way: the responder starts the exchange, the
    adapter's response hands ``run`` its writer; nothing else of the exchange."""
    used = {}
    for adapter in (tether_starlette, tether_aiohttp):
        folder = pathlib.Path(adapter.__file__).parent
        text = "".join(path.read_text() for path in folder.glob("_*.py"))
        used[adapter.__name__] = set(re.findall(r"\bexchange\.(\w+)", text))
    methods = {name: found - {"done"} for name, found in used.items()}  # (done: a property)
    assert methods["tether_starlette"] == methods["tether_aiohttp"] == {"run"}
