"""The example servers' HTTP API, with no web framework in sight.

Both example servers (``starlette_app.py``, ``aiohttp_app.py``) read the request
body, hand it to a parser here and pass the result to :class:`Service`, which
registers the request with tether and submits it to the engine; they then answer
through their adapter's ``respond()``. Everything that decides what the API
accepts and what its answers look like lives here, once:

* ``POST /generate``: ``{"text": str | [str], "max_tokens": int, "stream": bool,
  "rid": str | [str], "timeout": float}`` (``rid``: client-chosen request ids, and
  ``timeout``: a deadline in seconds, both optional);
* ``POST /v1/completions``: the OpenAI completions shape (``prompt``, ``max_tokens``,
  ``stream``, ``model``), with :class:`CompletionChunks` framing its stream and
  :func:`completion` building its JSON body;
* refusals: :class:`BadRequest` (400 malformed JSON, 413 too large, 422 invalid)
  and tether's own errors, mapped by :func:`rejection`. Nothing is registered for
  a refused request: parsing happens before ``Registry.open()``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import AsyncIterable, Iterable
from typing import Any, Final

from engine import Engine

import tether

__all__ = [
    "MAX_BATCH",
    "MAX_BODY_BYTES",
    "MAX_TIMEOUT",
    "MAX_TOKENS",
    "MODEL",
    "REFUSALS",
    "BadRequest",
    "CompletionChunks",
    "Generation",
    "Service",
    "completion",
    "completion_id",
    "http_error",
    "page",
    "parse_completions",
    "parse_generate",
    "read_body",
    "rejection",
]

MAX_BODY_BYTES: Final = 1 << 20
"""Request bodies beyond this many bytes get 413."""
MAX_BATCH: Final = 64
"""Batches beyond this many prompts get 413."""
MAX_TOKENS: Final = 4096
"""``max_tokens`` beyond this gets 422."""
MODEL: Final = "tether-sim"
"""The model name the completions API reports."""
MAX_TIMEOUT: Final = 3600.0
"""``timeout`` beyond this many seconds gets 422."""
DEFAULT_MAX_TOKENS: Final = 16
PAGE: Final = pathlib.Path(__file__).resolve().parent / "static" / "index.html"


class BadRequest(Exception):
    """A request refused before anything was registered.

    :param status: 400 (malformed JSON), 413 (body or batch too large) or 422 (invalid).
    :param message: what is wrong, naming the field.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclasses.dataclass(frozen=True, slots=True)
class Generation:
    """A validated generation request, whichever endpoint it came from.

    :param prompts: the prompts, one per sub-request.
    :param batched: whether the client sent a list (the answer is then a list too).
    :param max_tokens: tokens to generate per prompt.
    :param stream: answer as a stream of server-sent events.
    :param rids: client-chosen request ids, one per prompt, or ``None``.
    :param model: the model named by a completions request.
    :param timeout: a deadline in seconds for the whole request, or ``None``.
    """

    prompts: tuple[str, ...]
    batched: bool
    max_tokens: int
    stream: bool
    rids: tuple[str, ...] | None = None
    model: str = MODEL
    timeout: float | None = None


def _load_object(body: bytes) -> dict[str, Any]:
    if len(body) > MAX_BODY_BYTES:
        raise BadRequest(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest(422, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def _prompts(data: dict[str, Any], field: str) -> tuple[tuple[str, ...], bool]:
    if field not in data:
        raise BadRequest(422, f"{field!r} is required: a string or a list of strings")
    value = data[field]
    if isinstance(value, str):
        return (value,), False
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise BadRequest(422, f"{field!r} must be a string or a list of strings")
    if not value:
        raise BadRequest(422, f"{field!r} is an empty batch: give at least one prompt")
    if len(value) > MAX_BATCH:
        raise BadRequest(413, f"{field!r} holds {len(value)} prompts; at most {MAX_BATCH}")
    return tuple(value), True


def _max_tokens(data: dict[str, Any]) -> int:
    value = data.get("max_tokens")
    if value is None:
        return DEFAULT_MAX_TOKENS
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(422, "'max_tokens' must be an integer")
    if not 1 <= value <= MAX_TOKENS:
        raise BadRequest(422, f"'max_tokens' must be between 1 and {MAX_TOKENS}, got {value}")
    return value


def _flag(data: dict[str, Any], field: str) -> bool:
    value = data.get(field, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(422, f"{field!r} must be true or false")
    return value


def _timeout(data: dict[str, Any]) -> float | None:
    value = data.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(422, "'timeout' must be a number of seconds")
    if not 0 < value <= MAX_TIMEOUT:
        raise BadRequest(422, f"'timeout' must be above 0 and at most {MAX_TIMEOUT}, got {value}")
    return float(value)


def _rids(data: dict[str, Any], prompts: tuple[str, ...], batched: bool) -> tuple[str, ...] | None:
    value = data.get("rid")
    if value is None:
        return None
    rids = [value] if isinstance(value, str) and not batched else value
    if not isinstance(rids, list) or not all(isinstance(rid, str) and rid for rid in rids):
        kind = "a list of non-empty strings" if batched else "a non-empty string"
        raise BadRequest(422, f"'rid' must be {kind}, like 'text'")
    if len(rids) != len(prompts) or len(set(rids)) != len(rids):
        raise BadRequest(422, "'rid' must hold one distinct id per prompt")
    if any(len(rid) > 128 for rid in rids):
        raise BadRequest(422, "'rid' values are at most 128 characters")
    return tuple(rids)


def parse_generate(body: bytes) -> Generation:
    """Validate a ``POST /generate`` body.

    :raises BadRequest: with the status the client gets.
    """
    data = _load_object(body)
    prompts, batched = _prompts(data, "text")
    return Generation(
        prompts=prompts,
        batched=batched,
        max_tokens=_max_tokens(data),
        stream=_flag(data, "stream"),
        rids=_rids(data, prompts, batched),
        timeout=_timeout(data),
    )


def parse_completions(body: bytes) -> Generation:
    """Validate a ``POST /v1/completions`` body (the OpenAI completions shape).

    Sampling options (``temperature``, ``top_p``...) are accepted and ignored: the
    engine is deterministic. Token-id prompts and ``n`` other than 1 are refused.

    :raises BadRequest: with the status the client gets.
    """
    data = _load_object(body)
    prompts, batched = _prompts(data, "prompt")
    model = data.get("model", MODEL)
    if not isinstance(model, str):
        raise BadRequest(422, "'model' must be a string")
    if data.get("n", 1) not in (1, None):
        raise BadRequest(422, "'n' must be 1: one completion per prompt")
    return Generation(
        prompts=prompts,
        batched=batched,
        max_tokens=_max_tokens(data),
        stream=_flag(data, "stream"),
        model=model,
    )


async def read_body(chunks: AsyncIterable[bytes], declared_length: str | None) -> bytes:
    """Read a request body from the framework's chunk iterator, refusing oversized ones early.

    :param declared_length: the ``Content-Length`` header, if any.
    :raises BadRequest: 413 when the body (declared or read) exceeds :data:`MAX_BODY_BYTES`.
    """
    too_large = BadRequest(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    declared = declared_length or ""
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        parts.append(chunk)
    return b"".join(parts)


def page() -> bytes:
    """The browser page both servers serve at ``/``."""
    return PAGE.read_bytes()


def rejection(exc: BadRequest | tether.TetherError) -> tether.ErrorResponse:
    """The status, JSON body and headers for a refused request.

    :class:`BadRequest` bodies have tether's error shape, so that clients see one
    format; tether's errors (overload, duplicate rid...) go through
    ``tether.error_response``.
    """
    if isinstance(exc, BadRequest):
        return http_error(exc.status, exc.message, kind="BadRequest")
    return tether.error_response(exc)


def http_error(
    status: int, message: str, *, kind: str = "HTTPError", headers: dict[str, str] | None = None
) -> tether.ErrorResponse:
    """An error in tether's JSON shape, for the framework's own errors too (404, 405):
    every error a client of the example servers gets is ``{"error": {...}}``."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return tether.ErrorResponse(status, body, headers or {})


REFUSALS: Final = (BadRequest, tether.TetherError)
"""What handlers catch around parsing and :meth:`Service.open`; see :func:`rejection`."""


class Service:
    """The engine and the registry behind one example server.

    :param engine: the producer.
    :param registry: the registry whose ``on_abort`` is ``engine.abort``.
    """

    def __init__(self, engine: Engine, registry: tether.Registry) -> None:
        self.engine = engine
        self.registry = registry

    def open(self, request: Generation) -> tether.Stream | tether.Batch:
        """Register ``request`` (a stream, or a batch for a list) and submit it.

        :raises tether.TetherError: not admitted (overload, duplicate rid, closing).
        """
        source: tether.Stream | tether.Batch
        if request.batched:
            rids_or_n = request.rids or len(request.prompts)
            source = self.registry.open_batch(rids_or_n, timeout=request.timeout)
            rids: Iterable[str] = source.rids
        else:
            rid = request.rids[0] if request.rids else None
            source = self.registry.open(rid, timeout=request.timeout)
            rids = (source.rid,)
        for rid, prompt in zip(rids, request.prompts, strict=True):
            self.engine.submit(rid, prompt, request.max_tokens)
        return source

    def metrics(self) -> dict[str, Any]:
        """``GET /metrics``: the registry's stats, with the engine's under ``"engine"``."""
        return {**self.registry.stats().as_dict(), "engine": self.engine.stats().as_dict()}

    def aborts(self) -> dict[str, Any]:
        """``GET /metrics/aborts``: when ``on_abort`` ran for the recent aborts, as
        ``time.monotonic()`` (one clock for every process on the machine)."""
        return {"clock": "monotonic", "aborts": self.engine.recent_aborts()}

    def health(self) -> tuple[int, dict[str, Any]]:
        """``GET /health``: 200 when requests are admitted, 503 otherwise."""
        if self.engine.crashed:
            return 503, {"status": "unavailable", "reason": "the engine crashed"}
        if self.registry.closed:
            return 503, {"status": "unavailable", "reason": "shutting down"}
        return 200, {"status": "ok", "in_flight": self.registry.in_flight}


def _choice(index: int, output: dict[str, Any]) -> dict[str, Any]:
    meta = output["meta_info"]
    return {
        "index": index,
        "text": output["text"],
        "logprobs": None,
        "finish_reason": meta["finish_reason"],
    }


class CompletionChunks(tether.SSE):
    """SSE framing for ``/v1/completions``: each engine output becomes an OpenAI
    ``text_completion`` chunk; errors, pings and ``data: [DONE]`` are tether's.

    :param completion_id: the ``id`` every chunk carries.
    :param model: the ``model`` every chunk carries.
    """

    __slots__ = ("completion_id", "created", "model")

    def __init__(self, completion_id: str, model: str) -> None:
        super().__init__()
        self.completion_id = completion_id
        self.model = model
        self.created = int(time.time())

    def _chunk(self, index: int, output: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [_choice(index, output)],
        }

    def encode_many(self, outputs: Iterable[Any]) -> bytes:
        return super().encode_many(self._chunk(0, output) for output in outputs)

    def encode_indexed(self, pairs: Iterable[tuple[int, Any]]) -> bytes:
        return super().encode_many(self._chunk(index, output) for index, output in pairs)


def completion_id(source: tether.Stream | tether.Batch) -> str:
    """The OpenAI ``id`` of a completion: its first rid, prefixed."""
    rid = source.rids[0] if isinstance(source, tether.Batch) else source.rid
    return f"cmpl-{rid}"


def completion(
    request: Generation, results: dict[str, Any] | list[dict[str, Any]], cid: str
) -> dict[str, Any]:
    """The non-streaming ``/v1/completions`` body from the ``/generate``-shaped result(s)."""
    outputs = results if isinstance(results, list) else [results]
    generated = sum(output["meta_info"]["completion_tokens"] for output in outputs)
    prompt_tokens = sum(len(prompt.split()) for prompt in request.prompts)
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [_choice(index, output) for index, output in enumerate(outputs)],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
        },
    }
