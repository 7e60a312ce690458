"""The example servers' HTTP API, with no web framework in sight.

The three example servers (``starlette_app.py``, ``fastapi_app.py``,
``aiohttp_app.py``) read the request body, hand it to a parser here (or in
``openai_api.py``, for the OpenAI-compatible routes) and pass the result to
:class:`Service`, which registers the request with tether and submits it to the
engine; they then answer through their adapter's ``respond()``. Everything that
decides what the API accepts and what its answers look like lives here, once:

* ``POST /generate``: ``{"text": str | [str], "max_tokens": int, "stream": bool,
  "rid": str | [str], "timeout": float, "resume": bool}`` (``rid``: client-chosen
  request ids, ``timeout``: a deadline in seconds, ``resume``: a stream that a
  dropped client continues by sending ``POST /generate`` again with the
  ``Last-Event-ID`` header, all optional; see ``docs/resume.md``);
* ``/v1/...``: the OpenAI-compatible routes, in ``openai_api.py``;
* ``POST /generate/stop``: Stop a resumable stream by the ``Tether-Resume-Token``
  header its response carried (204, or 404 for no such stream): a closed connection
  only parks a resumable stream, so Stop needs its own signal;
* refusals: :class:`BadRequest` (400 malformed JSON, 413 too large, 422 invalid)
  and tether's own errors, mapped by :func:`rejection`. Nothing is registered for
  a refused request: parsing happens before ``Registry.open()``.

Hostile input is refused at the door (:func:`load_object`, every route's), whole:
a body that is not strict JSON (``NaN``, a repeated key, nesting past
:data:`MAX_NESTING`, an integer past Python's digit limit) gets 400, and a body
holding a lone surrogate anywhere (a ``\\udXXX`` escape with no partner: not
Unicode text, and unencodable as UTF-8 further down) gets 422, in a field the API
reads or not. Nothing past the door has to be careful with what a client sent. A
client that leaves while its body is being read is not an error
(:class:`ClientGone`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any, Final

import prometheus_client
from engine import Engine

import tether
import tether.http
import tether.resume
import tether_prometheus

__all__ = [
    "MAX_BATCH",
    "MAX_BODY_BYTES",
    "MAX_ID_CHARS",
    "MAX_NESTING",
    "MAX_TIMEOUT",
    "MAX_TOKENS",
    "METRICS_CONTENT_TYPE",
    "MODEL",
    "REFUSALS",
    "BadRequest",
    "ClientGone",
    "Generation",
    "Service",
    "identifier",
    "load_object",
    "page",
    "parse_generate",
    "read_body",
    "read_flag",
    "read_max_tokens",
    "read_prompts",
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
MAX_ID_CHARS: Final = 128
"""``rid`` and ``model`` values beyond this many characters get 422 (the model is
echoed in every chunk of a stream: a long one would multiply the answer's size)."""
MAX_NESTING: Final = 32
"""JSON nested deeper than this gets 400: the API reads two levels, and a fixed bound
does not depend on how much stack the parser happens to have left."""
DEFAULT_MAX_TOKENS: Final = 16
PAGE: Final = pathlib.Path(__file__).resolve().parent / "static" / "index.html"


class BadRequest(Exception):
    """A request refused before anything was registered.

    :param status: 400 (malformed JSON), 413 (body or batch too large) or 422 (invalid).
    :param message: what is wrong, naming the field.
    :param param: the field at fault, when there is one (OpenAI's error bodies name it).
    :param code: a machine-readable reason for OpenAI's error bodies
        (``"unsupported_parameter"``), or ``None``.
    """

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


@dataclasses.dataclass(frozen=True, slots=True)
class Generation:
    """A validated generation request, whichever endpoint it came from.

    :param prompts: the prompts, one per sub-request.
    :param batched: whether the client sent a list (the answer is then a list too).
    :param max_tokens: tokens to generate per prompt.
    :param stream: answer as a stream of server-sent events.
    :param rids: client-chosen request ids, one per prompt, or ``None``.
    :param timeout: a deadline in seconds for the whole request, or ``None``.
    :param resume: make the stream resumable (``"resume": true``): a client that drops
        reconnects with ``Last-Event-ID`` and continues (see ``docs/resume.md``).
    """

    prompts: tuple[str, ...]
    batched: bool
    max_tokens: int
    stream: bool
    rids: tuple[str, ...] | None = None
    timeout: float | None = None
    resume: bool = False


class ClientGone(Exception):
    """The client closed its connection before its request body was read.

    Not an error: nobody is left to answer, so handlers end the request quietly
    (nothing was registered) instead of letting the framework log a traceback.
    """


_LONE_SURROGATE: Final = re.compile(r"[\ud800-\udfff]")
"""A UTF-16 surrogate left in a ``str``: JSON's ``\\udXXX`` escapes pair up into one
code point when they can; what is left is not text."""
_CONTROL_OR_SURROGATE: Final = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
"""What a client-chosen id may not hold: C0 and C1 controls, DEL, surrogates."""


def _not_json(constant: str) -> Any:
    # json.loads takes NaN and Infinity by default; they are not JSON (RFC 8259).
    raise ValueError(f"{constant} is not a JSON value")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of a repeated key, another parser the first: a body
    # that means two things to two readers is refused, not guessed at.
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:  # (linear: a body may hold a hundred thousand keys)
            if key in seen:
                raise BadRequest(400, f"the request body repeats the key {ascii(key)[:40]}")
            seen.add(key)
    return data


def _check_text(data: Any) -> None:
    """Refuse nesting past :data:`MAX_NESTING` and lone surrogates in any string or key.

    Iterative, so that the check itself cannot run out of stack.
    """
    pending: list[tuple[Any, int, str]] = [(data, 0, "the body")]
    while pending:
        value, depth, where = pending.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                raise BadRequest(
                    422,
                    f"{where} holds a lone surrogate (an unpaired \\ud800-\\udfff escape): "
                    "it is not Unicode text",
                )
        elif isinstance(value, dict | list):
            if depth == MAX_NESTING:
                raise BadRequest(400, f"the request body is nested deeper than {MAX_NESTING}")
            if isinstance(value, list):
                pending.extend((item, depth + 1, where) for item in value)
            else:
                for key, item in value.items():
                    # Only the top-level key names the place: the client's own
                    # strings, escaped (ascii) and cut short, never echoed raw.
                    inner = ascii(key)[:40] if depth == 0 else where
                    pending.append((key, depth + 1, inner))
                    pending.append((item, depth + 1, inner))


def load_object(body: bytes) -> dict[str, Any]:
    """The door every body goes through, on every route of every example server: strict
    JSON (no ``NaN``, no repeated key, nesting within :data:`MAX_NESTING`, integers
    within Python's digit limit), Unicode text only (no lone surrogate anywhere), and
    an object at the top.

    :raises BadRequest: 400 (not strict JSON), 413 (too large), 422 (not text, not an object).
    """
    if len(body) > MAX_BODY_BYTES:
        raise BadRequest(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(body, parse_constant=_not_json, object_pairs_hook=_unique_keys)
    except RecursionError:
        # Thousands of nested brackets exhaust the parser's stack before any check.
        raise BadRequest(400, f"the request body is nested deeper than {MAX_NESTING}") from None
    except json.JSONDecodeError as exc:
        # Where, as a person counts (not a character offset), and what was expected.
        where = f"line {exc.lineno} column {exc.colno}"
        raise BadRequest(400, f"the request body is not valid JSON: {exc.msg} at {where}") from None
    except ValueError as exc:  # UnicodeDecodeError and the int digit limit included
        raise BadRequest(400, f"the request body is not valid JSON: {exc}") from None
    _check_text(data)
    if not isinstance(data, dict):
        raise BadRequest(422, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def identifier(value: str, field: str) -> str:
    """A client-chosen name (``rid``, ``model``): it reaches logs, ids and every chunk."""
    if not value or len(value) > MAX_ID_CHARS:
        raise BadRequest(422, f"{field!r} values are 1 to {MAX_ID_CHARS} characters", param=field)
    if _CONTROL_OR_SURROGATE.search(value):
        raise BadRequest(422, f"{field!r} values may not hold control characters", param=field)
    return value


def read_prompts(data: dict[str, Any], field: str) -> tuple[tuple[str, ...], bool]:
    """``data[field]``: one prompt or a batch of 1 to :data:`MAX_BATCH`; and whether it
    was a list (the answer is then a list too)."""
    if field not in data:
        raise BadRequest(422, f"{field!r} is required: a string or a list of strings", param=field)
    value = data[field]
    if isinstance(value, str):
        return (value,), False
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise BadRequest(422, f"{field!r} must be a string or a list of strings", param=field)
    if not value:
        raise BadRequest(422, f"{field!r} is an empty batch: give at least one prompt", param=field)
    if len(value) > MAX_BATCH:
        raise BadRequest(
            413, f"{field!r} holds {len(value)} prompts; at most {MAX_BATCH}", param=field
        )
    return tuple(value), True


def read_max_tokens(data: dict[str, Any], field: str = "max_tokens") -> int:
    """``data[field]``: tokens to generate, 1 to :data:`MAX_TOKENS` (absent or null: 16)."""
    value = data.get(field)
    if value is None:
        return DEFAULT_MAX_TOKENS
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(422, f"{field!r} must be an integer", param=field)
    if not 1 <= value <= MAX_TOKENS:
        message = f"{field!r} must be between 1 and {MAX_TOKENS}, got {value}"
        raise BadRequest(422, message, param=field)
    return value


def read_flag(data: dict[str, Any], field: str) -> bool:
    """``data[field]``: true or false (absent or null: false)."""
    value = data.get(field, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(422, f"{field!r} must be true or false", param=field)
    return value


def _timeout(data: dict[str, Any]) -> float | None:
    value = data.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(422, "'timeout' must be a number of seconds", param="timeout")
    if not 0 < value <= MAX_TIMEOUT:
        raise BadRequest(
            422,
            f"'timeout' must be above 0 and at most {MAX_TIMEOUT}, got {value}",
            param="timeout",
        )
    return float(value)


def _rids(data: dict[str, Any], prompts: tuple[str, ...], batched: bool) -> tuple[str, ...] | None:
    value = data.get("rid")
    if value is None:
        return None
    rids = [value] if isinstance(value, str) and not batched else value
    if not isinstance(rids, list) or not all(isinstance(rid, str) and rid for rid in rids):
        kind = "a list of non-empty strings" if batched else "a non-empty string"
        raise BadRequest(422, f"'rid' must be {kind}, like 'text'", param="rid")
    if len(rids) != len(prompts) or len(set(rids)) != len(rids):
        raise BadRequest(422, "'rid' must hold one distinct id per prompt", param="rid")
    return tuple(identifier(rid, "rid") for rid in rids)


def parse_generate(body: bytes) -> Generation:
    """Validate a ``POST /generate`` body.

    :raises BadRequest: with the status the client gets.
    """
    data = load_object(body)
    prompts, batched = read_prompts(data, "text")
    stream, resume = read_flag(data, "stream"), read_flag(data, "resume")
    if resume and (batched or not stream):
        raise BadRequest(422, "'resume' needs 'stream': true and a single prompt", param="resume")
    return Generation(
        prompts=prompts,
        batched=batched,
        max_tokens=read_max_tokens(data),
        stream=stream,
        rids=_rids(data, prompts, batched),
        timeout=_timeout(data),
        resume=resume,
    )


def _declared_too_large(declared_length: str | None) -> bool:
    digits = (declared_length or "").strip()
    # ASCII digits only ("²".isdigit() holds), compared by length before int() so
    # that a 5000-digit header cannot hit Python's integer digit limit.
    if not (digits.isascii() and digits.isdigit()):
        return False  # the server's HTTP parser judges it; the read below is bounded anyway
    digits = digits.lstrip("0")
    limit = str(MAX_BODY_BYTES)
    return len(digits) > len(limit) or (len(digits) == len(limit) and digits > limit)


async def read_body(
    chunks: AsyncIterable[bytes],
    declared_length: str | None,
    *,
    gone: tuple[type[Exception], ...],
) -> bytes:
    """Read a request body from the framework's chunk iterator, refusing oversized ones early.

    :param declared_length: the ``Content-Length`` header, if any.
    :param gone: what the framework raises while reading when the client closed its
        connection part-way (Starlette: ``ClientDisconnect``; aiohttp: the ``OSError``
        the connection was lost with, ``ConnectionResetError`` when there was none).
    :raises BadRequest: 413 when the body (declared or read) exceeds :data:`MAX_BODY_BYTES`.
    :raises ClientGone: the client left before the whole body arrived.
    """
    too_large = BadRequest(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    if _declared_too_large(declared_length):
        raise too_large
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in chunks:
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise too_large
            parts.append(chunk)
    except gone as exc:
        raise ClientGone(f"the client left after {size} bytes of its request body") from exc
    return b"".join(parts)


def page() -> bytes:
    """The browser page both servers serve at ``/``."""
    return PAGE.read_bytes()


def rejection(exc: BadRequest | tether.TetherError) -> tether.http.ErrorResponse:
    """The status, JSON body and headers for a refused request.

    :class:`BadRequest` bodies have tether's error shape, so that clients see one
    format; tether's errors (overload, duplicate rid...) go through
    ``tether.http.error_response``.
    """
    if isinstance(exc, BadRequest):
        body = {"error": {"message": exc.message, "type": "BadRequest", "code": exc.status}}
        return tether.http.ErrorResponse(exc.status, body, {})
    return tether.http.error_response(exc)


METRICS_CONTENT_TYPE: Final = prometheus_client.CONTENT_TYPE_LATEST
"""The content type of ``GET /metrics`` (Prometheus text exposition)."""

REFUSALS: Final = (BadRequest, tether.TetherError)
"""What handlers catch around parsing and :meth:`Service.open`; see :func:`rejection`."""


class Service:
    """The engine and the registry behind one example server.

    :param engine: the producer.
    :param registry: the registry whose ``on_abort`` is ``engine.abort``.
    :param redis: the URL of a Redis server that keeps resumable streams, so that a
        reconnect continues on any server sharing it (``--redis``); ``None`` keeps
        them in this process.
    """

    def __init__(
        self, engine: Engine, registry: tether.Registry, *, redis: str | None = None
    ) -> None:
        self.engine = engine
        self.registry = registry
        store: tether.resume.MemoryStore | None = None
        self._redis: Any = None  # (a redis.asyncio.Redis: the store does not close it)
        if redis is not None:
            # (needs tether[redis]: imported only when asked)
            from redis.asyncio import Redis
            from tether_redis import RedisStore

            self._redis = Redis.from_url(redis)
            store = RedisStore(self._redis, block=0.2)
        self.resume = tether.resume.Resume(grace=30.0, store=store)
        """Resumable streams (``"resume": true``); see :meth:`resuming`."""
        # A collector registry of its own: two services in one process (the tests)
        # must not clash in prometheus_client's process-wide default one.
        self.prometheus = prometheus_client.CollectorRegistry()
        collector = tether_prometheus.RegistryCollector()
        collector.add(registry, name="generate")
        self.prometheus.register(collector)

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

    @contextlib.asynccontextmanager
    async def resuming(self) -> AsyncIterator[None]:
        """Resumable streams for as long as the server runs: at the end every one left
        is aborted, its store's tasks end, and the Redis connection (if any) closes."""
        try:
            yield
        finally:
            await self.resume.aclose()
            if self._redis is not None:
                await self._redis.aclose()

    async def stop(self, token: str) -> tether.http.ErrorResponse | None:
        """``POST /generate/stop``: abort the resumable stream of ``token`` at once;
        ``None`` when it was, else the refusal to answer with (404: no such stream; 503
        to retry: the shared store cannot be reached, the stream may live elsewhere)."""
        try:
            stopped = await self.resume.cancel(token)
        except ConnectionError:
            return tether.resume.RESUME_UNAVAILABLE
        return None if stopped else tether.resume.NOT_RESUMABLE

    def metrics(self) -> tuple[bytes, str]:
        """``GET /metrics``: the Prometheus exposition (body, content type), scraped
        from the registry's counters at this moment."""
        return prometheus_client.generate_latest(self.prometheus), METRICS_CONTENT_TYPE

    def stats(self) -> dict[str, Any]:
        """``GET /stats``: the registry's stats as JSON, with the engine's under
        ``"engine"`` (what the demo and the page read)."""
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
