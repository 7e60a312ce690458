"""The example servers' OpenAI-compatible routes, with no web framework in sight.

``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed or not, ``n``
choices per prompt run as one tether Batch, ``stream_options.include_usage`` ending a
stream with the usage chunk vLLM and SGLang send (and ``usage`` in every JSON
answer); ``GET /v1/models``. A server parses the body with :func:`parse_completions`
or :func:`parse_chat`, opens the :class:`Call`'s ``generation`` with
``api.Service.open``, and answers with :class:`Chunks` (the stream) or :func:`body`
(one JSON body).

Departures from tether's own ``/generate``, on purpose, so that OpenAI's clients
behave as they do against OpenAI: every error on these routes is OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (:func:`rejection`,
:func:`reshaped`), and a refusal that names a field is a 400 where ``/generate``
says 422, so that the SDK raises ``BadRequestError``. A parameter the engine cannot
honour (``logprobs``, ``echo``, ``stop``, ``suffix``, ``best_of``, tools, or any name
this module does not know) is refused with a 400 naming it, never accepted and
ignored; given as null, false or empty it asks for nothing and passes. Sampling
options (:data:`SAMPLING`) are accepted: the engine is deterministic, as a model is
at temperature 0.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable
from typing import Any, Final

import api
from engine import chat_prompt, prompt_tokens

import tether
import tether.http
from tether.http import ErrorResponse

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "MAX_MESSAGES",
    "MAX_N",
    "SAMPLING",
    "Call",
    "Chunks",
    "body",
    "completion_id",
    "for_path",
    "models",
    "parse_chat",
    "parse_completions",
    "rejection",
    "reshaped",
    "reshaped_answer",
]

MAX_N: Final = 16
"""``n`` (choices per prompt) beyond this gets 400; so do more than ``api.MAX_BATCH``
choices in all."""
MAX_MESSAGES: Final = 256
"""A chat of more messages than this gets 400."""
SAMPLING: Final = frozenset(
    {"temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "user"}
)
"""Parameters accepted on both routes and ignored: they shape a sampling the
deterministic engine does not do (or, ``user``, only label the request)."""
COMPLETIONS: Final = frozenset(
    {"model", "prompt", "max_tokens", "stream", "stream_options", "n", "resume"}
)
"""What ``/v1/completions`` honours (``resume``: tether's resumable streams)."""
CHAT: Final = frozenset(
    {
        "model", "messages", "max_tokens", "max_completion_tokens", "stream",
        "stream_options", "n", "resume",
    }
)  # fmt: skip
"""What ``/v1/chat/completions`` honours."""
_ROLES: Final = ("system", "developer", "user", "assistant")
_DEFAULTS: Final[dict[str, Any]] = {
    "best_of": 1,
    "response_format": {"type": "text"},
    "tool_choice": "none",
    "parallel_tool_calls": True,
}
"""Unsupported parameters whose value here asks for nothing more than the default."""
_STARTED: Final = int(time.time())


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """A validated OpenAI request.

    :param chat: a chat completion (else a text completion).
    :param model: the model named, echoed in every answer.
    :param prompts: the prompts as the client gave them, once each (for the usage).
    :param n: choices per prompt.
    :param include_usage: end the stream with a usage chunk.
    :param generation: what the engine runs: each prompt ``n`` times, so that choice
        ``i * n + j`` is sub-request ``i * n + j`` of the batch.
    """

    chat: bool
    model: str
    prompts: tuple[str, ...]
    n: int
    include_usage: bool
    generation: api.Generation

    @property
    def object(self) -> str:
        """The ``object`` of a JSON answer."""
        return "chat.completion" if self.chat else "text_completion"

    @property
    def prefix(self) -> str:
        """What answer ids start with."""
        return "chatcmpl-" if self.chat else "cmpl-"


def _refused(status: int, message: str, param: str, code: str | None = None) -> api.BadRequest:
    return api.BadRequest(status, message, param=param, code=code)


def _asks_nothing(name: str, value: Any) -> bool:
    if value is None or value is False:
        return True
    if isinstance(value, str | list | dict) and not value:
        return True
    default = _DEFAULTS.get(name)
    return default is not None and type(value) is type(default) and value == default


def _refuse_unsupported(data: dict[str, Any], honoured: frozenset[str], where: str = "") -> None:
    for name, value in data.items():
        if name in honoured or (not where and name in SAMPLING) or _asks_nothing(name, value):
            continue
        # (the client's own key: escaped and cut short, never echoed raw)
        param = where + ascii(name)[1:-1][:40]
        message = f"'{param}' is not supported by this server"
        raise _refused(400, message, param, "unsupported_parameter")


def _model(data: dict[str, Any]) -> str:
    model = data.get("model", api.MODEL)
    if not isinstance(model, str):
        raise _refused(400, "'model' must be a string", "model")
    return api.identifier(model, "model")


def _n(data: dict[str, Any], prompts: int) -> int:
    value = data.get("n")
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_N:
        raise _refused(400, f"'n' must be an integer from 1 to {MAX_N}", "n")
    if prompts * value > api.MAX_BATCH:
        message = f"{prompts} prompts times 'n' {value} is more than {api.MAX_BATCH} choices"
        raise _refused(400, message, "n")
    return value


def _include_usage(data: dict[str, Any], stream: bool) -> bool:
    options = data.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise _refused(
            400, "'stream_options' is allowed only with 'stream': true", "stream_options"
        )
    if not isinstance(options, dict):
        raise _refused(400, "'stream_options' must be an object", "stream_options")
    _refuse_unsupported(options, frozenset({"include_usage"}), "stream_options.")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        param = "stream_options.include_usage"
        raise _refused(400, f"'{param}' must be true or false", param)
    return include is True


def _call(
    data: dict[str, Any], prompts: tuple[str, ...], batched: bool, *, chat: bool, max_tokens: int
) -> Call:
    model = _model(data)
    n = _n(data, len(prompts))
    stream, resume = api.read_flag(data, "stream"), api.read_flag(data, "resume")
    include_usage = _include_usage(data, stream)
    runs = tuple(prompt for prompt in prompts for _ in range(n))
    if resume and (len(runs) > 1 or not stream):
        raise _refused(400, "'resume' needs 'stream': true and one choice", "resume")
    generation = api.Generation(
        prompts=runs, batched=batched or n > 1, max_tokens=max_tokens, stream=stream, resume=resume
    )
    return Call(chat, model, prompts, n, include_usage, generation)


def parse_completions(body: bytes) -> Call:
    """Validate a ``POST /v1/completions`` body (a prompt or a list of them).

    :raises api.BadRequest: with the status the client gets (see :func:`rejection`).
    """
    data = api.load_object(body)
    _refuse_unsupported(data, COMPLETIONS)
    prompts, batched = api.read_prompts(data, "prompt")
    return _call(data, prompts, batched, chat=False, max_tokens=api.read_max_tokens(data))


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise _refused(400, f"'{where}' must be a string or a list of text parts", where)
    texts = []
    for part in value:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise _refused(400, f"'{where}' may hold text parts only", where)
        text = part.get("text")
        if not isinstance(text, str):
            raise _refused(400, f"'{where}' has a text part without a string 'text'", where)
        texts.append(text)
    return "\n".join(texts)


def _messages(data: dict[str, Any]) -> list[tuple[str, str]]:
    value = data.get("messages")
    if not isinstance(value, list) or not value:
        raise _refused(400, "'messages' is required: a non-empty list of messages", "messages")
    if len(value) > MAX_MESSAGES:
        raise _refused(400, f"'messages' holds {len(value)}; at most {MAX_MESSAGES}", "messages")
    messages = []
    for number, message in enumerate(value):
        where = f"messages[{number}]"
        if not isinstance(message, dict):
            raise _refused(400, f"'{where}' must be an object with a role and content", where)
        _refuse_unsupported(message, frozenset({"role", "content", "name"}), where + ".")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            roles = ", ".join(_ROLES)
            raise _refused(400, f"'{where}.role' must be one of {roles}", f"{where}.role")
        if not isinstance(message.get("name", ""), str):
            raise _refused(400, f"'{where}.name' must be a string", f"{where}.name")
        messages.append((role, _content(message.get("content"), f"{where}.content")))
    return messages


def parse_chat(body: bytes) -> Call:
    """Validate a ``POST /v1/chat/completions`` body (text messages).

    :raises api.BadRequest: with the status the client gets (see :func:`rejection`).
    """
    data = api.load_object(body)
    _refuse_unsupported(data, CHAT)
    prompt = chat_prompt(_messages(data))
    field = "max_tokens"
    if data.get("max_completion_tokens") is not None:
        if data.get("max_tokens") is not None:
            message = "give 'max_completion_tokens' or 'max_tokens', not both"
            raise _refused(400, message, "max_tokens")
        field = "max_completion_tokens"
    return _call(data, (prompt,), False, chat=True, max_tokens=api.read_max_tokens(data, field))


def usage(call: Call, completion_tokens: Iterable[int]) -> dict[str, int]:
    """The ``usage`` of an answer: the prompts count once, however many choices."""
    prompt = sum(prompt_tokens(text) for text in call.prompts)
    completion = sum(completion_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class Chunks(tether.SSE):
    """SSE framing for the OpenAI routes: each engine output becomes a
    ``text_completion`` or ``chat.completion.chunk`` chunk (a choice's first delta
    carries its role); with ``include_usage``, every chunk has ``"usage": null`` and
    the stream ends with one whose ``choices`` are empty and whose ``usage`` counts
    the whole request; an error event is in OpenAI's shape (no usage chunk after it).

    :param call: the request.
    :param completion_id: the ``id`` every chunk carries; ``None`` (a reconnect to a
        resumable stream, whose request is known only once it is followed): each
        chunk's own, prefix and rid from the output, which is what the first response
        carried (:func:`completion_id`).
    """

    __slots__ = ("_failed", "_id", "_started", "_tokens", "call", "completion_id", "created")

    def __init__(self, call: Call, completion_id: str | None) -> None:
        super().__init__()
        self.call = call
        self.completion_id = completion_id
        self.created = int(time.time())
        self._id = completion_id or call.prefix
        self._started: set[int] = set()
        self._tokens: dict[int, int] = {}  # completion tokens so far, by choice
        self._failed = False

    def _chunk(self, index: int, output: dict[str, Any]) -> dict[str, Any]:
        meta = output["meta_info"]
        self._tokens[index] = meta["completion_tokens"]
        if self.completion_id is None:
            self._id = self.call.prefix + meta["id"]
        choice: dict[str, Any] = {"index": index}
        if self.call.chat:
            delta = {"content": output["text"]}
            if index not in self._started:
                self._started.add(index)
                delta = {"role": "assistant", **delta}
            choice["delta"] = delta
        else:
            choice["text"] = output["text"]
        choice["logprobs"] = None
        choice["finish_reason"] = meta["finish_reason"]
        chunk = self._envelope([choice])
        if self.call.include_usage:
            chunk["usage"] = None
        return chunk

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.call.chat else "text_completion"
        model = self.call.model
        return {
            "id": self._id,
            "object": kind,
            "created": self.created,
            "model": model,
            "choices": choices,
        }

    def encode_many(self, outputs: Iterable[Any]) -> bytes:
        return super().encode_many(self._chunk(0, output) for output in outputs)

    def encode_indexed(self, pairs: Iterable[tuple[int, Any]]) -> bytes:
        return super().encode_many(self._chunk(index, output) for index, output in pairs)

    def error(self, body: dict[str, Any], *, event: str | None = None) -> bytes:
        self._failed = True
        error = body.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) else 500
        return super().error(reshaped(ErrorResponse(status, body, {})).body, event=event)

    def terminal(self) -> bytes:
        if not self.call.include_usage or self._failed:
            return super().terminal()
        last = self._envelope([])
        last["usage"] = usage(self.call, self._tokens.values())
        return self.frame(self.dumps(last)) + super().terminal()


def completion_id(call: Call, source: tether.Stream | tether.Batch) -> str:
    """The OpenAI ``id`` of an answer: its first rid, prefixed."""
    rid = source.rids[0] if isinstance(source, tether.Batch) else source.rid
    return call.prefix + rid


def body(call: Call, results: dict[str, Any] | list[dict[str, Any]], cid: str) -> dict[str, Any]:
    """The JSON answer from the engine's result(s), one choice per sub-request."""
    outputs = results if isinstance(results, list) else [results]
    choices = []
    for index, output in enumerate(outputs):
        choice: dict[str, Any] = {"index": index}
        if call.chat:
            choice["message"] = {"role": "assistant", "content": output["text"]}
        else:
            choice["text"] = output["text"]
        choice["logprobs"] = None
        choice["finish_reason"] = output["meta_info"]["finish_reason"]
        choices.append(choice)
    return {
        "id": cid,
        "object": call.object,
        "created": int(time.time()),
        "model": call.model,
        "choices": choices,
        "usage": usage(call, (output["meta_info"]["completion_tokens"] for output in outputs)),
    }


def models() -> dict[str, Any]:
    """``GET /v1/models``: the one model the engine simulates."""
    model = {"id": api.MODEL, "object": "model", "created": _STARTED, "owned_by": "tether"}
    return {"object": "list", "data": [model]}


def _error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> ErrorResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    error = {"message": message, "type": kind, "param": param, "code": code}
    return ErrorResponse(status, {"error": error}, headers or {})


def rejection(exc: api.BadRequest | tether.TetherError) -> ErrorResponse:
    """A refused OpenAI request in OpenAI's shape: a refusal that names a field is a
    400 (``/generate`` would say 422 or 413); a body too large stays 413; tether's
    errors keep their status (503 with ``Retry-After``, 409...)."""
    if isinstance(exc, api.BadRequest):
        status = 400 if exc.status == 422 or exc.param is not None else exc.status
        return _error(status, exc.message, param=exc.param, code=exc.code)
    return reshaped(tether.http.error_response(exc))


def reshaped(refusal: ErrorResponse) -> ErrorResponse:
    """An error in tether's shape (``respond()``'s, the framework's 404 or 405) in
    OpenAI's, with its headers (``Retry-After``, ``Allow``); a 422 becomes a 400."""
    error = refusal.body.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    status = 400 if refusal.status == 422 else refusal.status
    text = message if isinstance(message, str) else "the request failed"
    return _error(status, text, headers=refusal.headers)


def reshaped_answer(status: int, body: bytes, headers: Iterable[tuple[str, str]]) -> ErrorResponse:
    """``respond()``'s error answer (a status and JSON body known before anything was
    streamed: a timeout, an overload, a producer's failure) in OpenAI's shape."""
    own = ("content-length", "content-type")
    kept = {name: value for name, value in headers if name.lower() not in own}
    return reshaped(ErrorResponse(status, json.loads(body), kept))


def for_path(path: str, refusal: ErrorResponse) -> ErrorResponse:
    """``refusal`` as the route at ``path`` words its errors: OpenAI's shape under
    ``/v1/``, tether's elsewhere."""
    return reshaped(refusal) if path.startswith("/v1/") else refusal
