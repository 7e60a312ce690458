"""The three example servers against hostile input, as subprocesses on 127.0.0.1.

Every string field of every route may carry any code point, lone surrogates
included (sent as JSON ``\\udXXX`` escapes, or as their raw UTF-8-style bytes);
bodies may be nested thousands deep or hold numbers past every limit; fields may
have the wrong type; GET routes get odd query strings. The promise: never a 5xx,
never a hang, a JSON error body for every 4xx, an ordinary request answered
correctly right after, ``/health`` 200 with nothing in flight, and nothing in the
server's output that reports a failure (no traceback, no error log). The same body
gets the same status and body shape on all three servers, whatever its content type
says: tether's error shape on ``/generate``, OpenAI's on ``/v1/...`` (where a 422 of
``/generate`` is a 400).

One server of each kind serves the module (its output is checked once it has
stopped); the aborted-upload test runs its own, to read its output after stopping it,
on every uvicorn stack for the Starlette and FastAPI servers.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import socket
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import api
import httpx
import openai_api
import pytest
import pytest_asyncio
from engine import expected_text
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from .conftest import SERVER_STACKS, Served, Stack, eventually, served

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVERS: Final = ("starlette", "fastapi", "aiohttp")
JSON: Final = {"content-type": "application/json"}
BOUND: Final = 10.0
"""A generous bound on any one exchange with a server."""
LONE: Final = "\\ud800"
"""A lone surrogate as a client sends it in JSON: an escape (it has no UTF-8 form)."""


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=SERVERS)
async def server(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    async with served(request.param, "--step-ms", "2") as running:
        yield running
    # Stopped: the output is complete. Whatever the module threw at it, the server
    # never reported a failure.
    assert running.failure_lines() == [], "\n".join(running.output)


@pytest_asyncio.fixture(loop_scope="module")
async def http(server: Served) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=BOUND) as client:
        yield client


def openai_status(path: str, status: int) -> int:
    """The status an OpenAI route answers where ``/generate`` answers ``status``."""
    return 400 if path.startswith("/v1/") and status == 422 else status


def assert_json_error(response: httpx.Response, status: int | None = None) -> None:
    """A 4xx in the route's error shape (see :func:`assert_error_shape`)."""
    if status is not None:
        assert response.status_code == openai_status(response.url.path, status), response.text
    assert 400 <= response.status_code < 500, response.text
    assert_error_shape(response)


def assert_error_shape(response: httpx.Response) -> None:
    """tether's ``{"error": {"message", "type", "code": <status>}}`` on its own routes;
    OpenAI's ``{"error": {"message", "type", "param", "code"}}`` on ``/v1/...``."""
    assert response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str)
    assert error["message"]
    if response.url.path.startswith("/v1/"):
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] in ("invalid_request_error", "server_error"), error
        assert error["param"] is None or isinstance(error["param"], str), error
        assert error["code"] is None or isinstance(error["code"], str), error
    else:
        assert error["code"] == response.status_code
        assert isinstance(error["type"], str)


async def assert_whole(http: httpx.AsyncClient, *, in_flight: int = 0) -> None:
    """The server answers an ordinary request correctly, is healthy, and holds no
    request but the ``in_flight`` ones the test keeps open."""
    response = await http.post("/generate", json={"text": "ordinary", "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["text"] == expected_text("ordinary", 3)

    async def settled() -> bool:
        health = await http.get("/health")
        assert health.status_code == 200, health.text
        return bool(health.json()["in_flight"] == in_flight)

    await eventually(settled)


SURROGATE_BODIES: Final = {
    "generate-text": ("/generate", '{"text": "aLONEb"}'),
    "generate-rid": ("/generate", '{"text": "a", "stream": true, "rid": "LONE"}'),
    "generate-batch": ("/generate", '{"text": ["ok", "LONE"], "stream": true}'),
    "generate-rids": ("/generate", '{"text": ["a", "b"], "rid": ["x", "LONE"]}'),
    "generate-unknown-key": ("/generate", '{"text": "ok", "LONE": 1}'),
    "completions-prompt": ("/v1/completions", '{"prompt": "LONE"}'),
    "completions-batch": ("/v1/completions", '{"prompt": ["ok", "LONE"]}'),
    "completions-model": ("/v1/completions", '{"prompt": "ok", "model": "LONE"}'),
    "completions-model-stream": (
        "/v1/completions",
        '{"prompt": "ok", "model": "LONE", "stream": true}',
    ),
    "chat-content": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "LONE"}]}'),
    "chat-role": ("/v1/chat/completions", '{"messages": [{"role": "LONE", "content": "x"}]}'),
    "chat-text-part": (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "LONE"}]}]}',
    ),
    "chat-model-stream": (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x"}], "model": "LONE", "stream": true}',
    ),
}
"""A lone surrogate (``LONE``) in each string field of each route, by case id."""

# -- the same hostile body, the same answer, on every route of every server ----------

FIELDS: Final = {
    "/generate": '"text": "x"',
    "/v1/completions": '"prompt": "x"',
    "/v1/chat/completions": '"messages": [{"role": "user", "content": "x"}]',
}
"""Each POST route's required field, written into a body as ``F``."""
HOSTILE_BODIES: Final[dict[str, tuple[bytes, int]]] = {
    "nan": (b'{F, "max_tokens": NaN}', 400),
    "infinity": (b'{F, "max_tokens": Infinity}', 400),
    "minus-infinity-anywhere": (b'{F, "x": [-Infinity]}', 400),
    "minus-zero": (b'{F, "max_tokens": -0}', 422),
    "minus-zero-float": (b'{F, "max_tokens": -0.0}', 422),
    "float-for-int": (b'{F, "max_tokens": 2.0}', 422),
    "float-overflow": (b'{F, "max_tokens": 1e400}', 422),
    "int-past-64-bits": (b'{F, "max_tokens": 18446744073709551616}', 422),
    "int-past-digit-limit": (b'{F, "max_tokens": ' + b"9" * 5000 + b"}", 400),
    "lone-surrogate-value": (b'{F, "x": "\\ud800"}', 422),
    "lone-surrogate-key": (b'{F, "\\udfff": 1}', 422),
    "lone-surrogate-deep": (b'{F, "x": [{"y": ["a\\udbff"]}]}', 422),
    "lone-surrogate-raw-bytes": (b'{F, "x": "\xed\xa0\x80"}', 422),
    "lone-surrogate-top-level-string": (b'"\\ud800 and more"', 422),
    "deep-nesting": (b'{F, "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400),
    "deep-top-level": (b"[" * 50_000, 400),
    "wrong-type-max-tokens": (b'{F, "max_tokens": "5"}', 422),
    "wrong-type-stream": (b'{F, "stream": "yes"}', 422),
    "boolean-for-int": (b'{F, "max_tokens": true}', 422),
    "top-level-array": (b"[1, 2]", 422),
    "top-level-null": (b"null", 422),
    "top-level-number": (b"12", 422),
    "huge-body": (b'{F, "x": "' + b"a" * api.MAX_BODY_BYTES + b'"}', 413),
    "non-utf8": (b'{F, "x": "\xff\xfe"}', 400),
    "empty": (b"", 400),
    "whitespace-only": (b"  \n ", 400),
    "truncated": (b"{F, ", 400),
    "duplicate-key": (b'{F, "max_tokens": 1, "max_tokens": 2}', 400),
    "duplicate-inner-key": (b'{F, "x": {"k": 1, "k": 2}}', 400),
}
"""A hostile body (``F``: the route's required field) and the status ``/generate``
answers it with; an OpenAI route says 400 where ``/generate`` says 422."""
CONTENT_TYPES: Final = {
    "json": {"content-type": "application/json"},
    "form": {"content-type": "application/x-www-form-urlencoded"},  # curl -d's
    "none": {},
}


@pytest.mark.parametrize("path", FIELDS)
@pytest.mark.parametrize(("template", "status"), HOSTILE_BODIES.values(), ids=HOSTILE_BODIES.keys())
async def test_a_hostile_body_gets_the_same_json_4xx_on_every_server_and_route(
    http: httpx.AsyncClient, path: str, template: bytes, status: int
) -> None:
    body = template.replace(b"F", FIELDS[path].encode(), 1) if b"{F" in template else template
    before = (await http.get("/stats")).json()["opened"]
    for headers in CONTENT_TYPES.values():
        response = await http.post(path, content=body, headers=headers)
        assert_json_error(response, status)
    assert (await http.get("/stats")).json()["opened"] == before  # refused at the door


@pytest.mark.parametrize(
    ("path", "template"), SURROGATE_BODIES.values(), ids=SURROGATE_BODIES.keys()
)
async def test_a_lone_surrogate_in_any_string_field_gets_422_and_the_server_stays_whole(
    http: httpx.AsyncClient, path: str, template: str
) -> None:
    before = (await http.get("/stats")).json()["opened"]
    body = template.replace("LONE", LONE).encode()
    assert_json_error(await http.post(path, content=body, headers=JSON), 422)
    assert (await http.get("/stats")).json()["opened"] == before  # refused at the door
    await assert_whole(http)


async def test_a_lone_surrogate_as_raw_bytes_gets_422(http: httpx.AsyncClient) -> None:
    # The UTF-8-style encoding of U+D800: Python's json module decodes it
    # ("surrogatepass") into the same lone surrogate as the escape.
    body = b'{"text": "\xed\xa0\x80"}'
    assert_json_error(await http.post("/generate", content=body, headers=JSON), 422)
    await assert_whole(http)


async def test_a_lone_surrogate_never_reaches_a_bystander(http: httpx.AsyncClient) -> None:
    bystander = {"text": "bystander", "max_tokens": 3000, "stream": True}
    async with http.stream("POST", "/generate", json=bystander) as response:
        assert response.status_code == 200
        lines = response.aiter_lines()
        text = ""

        tokens = 0

        async def read_until(count: int) -> None:
            nonlocal text, tokens
            while tokens < count:
                line = await anext(lines)
                if line.startswith("data: "):
                    event = json.loads(line.removeprefix("data: "))
                    assert "error" not in event, event
                    text += event["text"]
                    tokens = event["meta_info"]["completion_tokens"]

        await read_until(1)  # the bystander is in the engine's running batch
        for path, template in SURROGATE_BODIES.values():
            body = template.replace("LONE", LONE).encode()
            assert_json_error(await http.post(path, content=body, headers=JSON), 422)
        await assert_whole(http, in_flight=1)  # an ordinary request ran beside it too
        await read_until(tokens + 20)  # and the bystander goes on, every token right
        assert text == expected_text("bystander", tokens)
        await lines.aclose()


DEEP: Final = 50_000


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"[" * DEEP + b"]" * DEEP, id="top-level-array"),
        pytest.param(b'{"text": ' + b"[" * DEEP + b"]" * DEEP + b"}", id="in-a-field"),
        pytest.param(b'{"a": ' * DEEP + b"1" + b"}" * DEEP, id="objects"),
        pytest.param(b'{"text": "x", "prompt": "x", "e": ' + b"[" * 2000 + b"}", id="unclosed"),
    ],
)
async def test_deeply_nested_json_gets_a_json_400(
    http: httpx.AsyncClient, path: str, body: bytes
) -> None:
    assert_json_error(await http.post(path, content=body, headers=JSON), 400)
    await assert_whole(http)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
@pytest.mark.parametrize(
    ("field", "number", "status"),
    [
        pytest.param("max_tokens", "1e400", 422, id="max-tokens-1e400"),
        pytest.param("max_tokens", "9" * 5000, 400, id="max-tokens-5000-digits"),
        pytest.param("max_tokens", "-" + "9" * 4300, 422, id="max-tokens-4300-digits"),
        pytest.param("max_tokens", "NaN", 400, id="max-tokens-nan"),
        pytest.param("stream", "1e400", 422, id="stream-1e400"),
        pytest.param("n", "Infinity", 400, id="n-infinity"),
    ],
)
async def test_huge_numbers_get_a_json_4xx(
    http: httpx.AsyncClient, path: str, field: str, number: str, status: int
) -> None:
    prompt = "text" if path == "/generate" else "prompt"
    body = f'{{"{prompt}": "x", "{field}": {number}}}'.encode()
    assert_json_error(await http.post(path, content=body, headers=JSON), status)
    await assert_whole(http)


# -- every field of every route, given the wrong type ----------------------------------

NOT_A_STRING: Final = {
    "list": '["x"]',
    "dict": '{"x": "y"}',
    "number": "7",
    "float": "0.5",
    "bool": "true",
}
"""JSON values that are not a string, for a field that must be one."""
CHAT: Final = "/v1/chat/completions"


def wrong_types() -> dict[str, tuple[str, str]]:
    """Each route's body with one field of the wrong type, by case id (``"X"``: where
    each of :data:`NOT_A_STRING`, and ``null`` for a required string, goes)."""
    templates = {
        "generate-text": ("/generate", '{"text": X}'),
        "generate-text-item": ("/generate", '{"text": ["a", X]}'),
        "generate-rid": ("/generate", '{"text": "a", "rid": X}'),
        "generate-rid-item": ("/generate", '{"text": ["a", "b"], "rid": ["r", X]}'),
        "completions-prompt": ("/v1/completions", '{"prompt": X}'),
        "completions-prompt-item": ("/v1/completions", '{"prompt": ["a", X]}'),
        "completions-model": ("/v1/completions", '{"prompt": "a", "model": X}'),
        "chat-model": (CHAT, '{"messages": [{"role": "user", "content": "a"}], "model": X}'),
        "chat-content": (CHAT, '{"messages": [{"role": "user", "content": X}]}'),
        "chat-role": (CHAT, '{"messages": [{"role": X, "content": "a"}]}'),
        "chat-name": (CHAT, '{"messages": [{"role": "user", "content": "a", "name": X}]}'),
        "chat-part-text": (
            CHAT,
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": X}]}]}',
        ),
        "chat-part-type": (
            CHAT,
            '{"messages": [{"role": "user", "content": [{"type": X, "text": "a"}]}]}',
        ),
    }
    cases = {
        f"{name}-{kind}": (path, body.replace("X", value))
        for name, (path, body) in templates.items()
        for kind, value in NOT_A_STRING.items()
        # (a list of strings is a batch where a batch is allowed, and ids go with it)
        # (a one-id list for one prompt is accepted too: the ids go with the prompts)
        if not (kind == "list" and name in ("generate-text", "completions-prompt", "generate-rid"))
    }
    required = ("generate-text", "generate-text-item", "completions-prompt", "chat-content")
    for name in (*required, "completions-prompt-item", "chat-role", "chat-part-text"):
        path, body = templates[name]
        cases[f"{name}-null"] = (path, body.replace("X", "null"))
    cases |= {
        "generate-text-list-of-lists": ("/generate", '{"text": [["a"], ["b"]]}'),
        "generate-text-missing": ("/generate", '{"max_tokens": 2}'),
        "generate-timeout-string": ("/generate", '{"text": "a", "timeout": "5"}'),
        "generate-timeout-list": ("/generate", '{"text": "a", "timeout": [5]}'),
        "generate-max-tokens-dict": ("/generate", '{"text": "a", "max_tokens": {"n": 2}}'),
        "generate-resume-number": ("/generate", '{"text": "a", "stream": true, "resume": 1}'),
        "completions-prompt-list-of-lists": ("/v1/completions", '{"prompt": [["a"], ["b"]]}'),
        "completions-prompt-tokens": ("/v1/completions", '{"prompt": [1, 2, 3]}'),
        "completions-prompt-missing": ("/v1/completions", '{"model": "m"}'),
        "completions-n-string": ("/v1/completions", '{"prompt": "a", "n": "2"}'),
        "completions-stream-options-list": (
            "/v1/completions",
            '{"prompt": "a", "stream": true, "stream_options": [true]}',
        ),
        "chat-messages-string": (CHAT, '{"messages": "hi"}'),
        "chat-messages-dict": (CHAT, '{"messages": {"role": "user", "content": "a"}}'),
        "chat-messages-missing": (CHAT, '{"model": "m"}'),
        "chat-message-string": (CHAT, '{"messages": ["hi"]}'),
        "chat-message-list": (CHAT, '{"messages": [["user", "hi"]]}'),
        "chat-role-missing": (CHAT, '{"messages": [{"content": "a"}]}'),
        "chat-content-missing": (CHAT, '{"messages": [{"role": "user"}]}'),
        "chat-content-empty-list": (CHAT, '{"messages": [{"role": "user", "content": []}]}'),
        "chat-part-string": (CHAT, '{"messages": [{"role": "user", "content": ["a"]}]}'),
        "chat-part-no-text": (
            CHAT,
            '{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
        ),
        "chat-max-completion-tokens-string": (
            CHAT,
            '{"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": "2"}',
        ),
    }
    return cases


WRONG_TYPES: Final = wrong_types()


@pytest.mark.parametrize(("path", "body"), WRONG_TYPES.values(), ids=WRONG_TYPES.keys())
async def test_a_field_of_the_wrong_type_gets_the_parsers_json_4xx_on_every_server(
    http: httpx.AsyncClient, path: str, body: str
) -> None:
    with pytest.raises(api.BadRequest) as refused:
        PARSERS[path](body.encode())
    before = (await http.get("/stats")).json()["opened"]
    response = await http.post(path, content=body.encode(), headers=JSON)
    # The status and message the parser gives, whichever server answers.
    assert_json_error(response, refused.value.status)
    assert response.json()["error"]["message"] == refused.value.message
    # Byte for byte: every server writes its JSON compact (as Starlette does).
    rejection = openai_api.rejection if path.startswith("/v1/") else api.rejection
    compact = json.dumps(rejection(refused.value).body, ensure_ascii=False, separators=(",", ":"))
    assert response.content == compact.encode(), response.text
    assert (await http.get("/stats")).json()["opened"] == before  # refused at the door
    await assert_whole(http)


# -- an upload the client abandons ---------------------------------------------------


def abandon_upload(url: str, path: str, sent: bytes) -> None:
    """Send a request whose Content-Length promises more than ``sent``, then close."""
    host, port = urllib.parse.urlsplit(url).netloc.split(":")
    with socket.create_connection((host, int(port)), timeout=BOUND) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            "content-length: 4096\r\n\r\n"
        )
        sock.sendall(head.encode() + sent)


@pytest.mark.parametrize(("name", "stack"), SERVER_STACKS)
async def test_an_abandoned_upload_ends_quietly_and_the_server_answers_next(
    name: str, stack: Stack
) -> None:
    async with (
        served(name, "--step-ms", "2", stack=stack) as own,
        httpx.AsyncClient(base_url=own.url, timeout=BOUND) as http,
    ):
        for path in ("/generate", "/v1/completions"):
            for sent in (b"", b'{"text": "half a bo'):
                await asyncio.to_thread(abandon_upload, own.url, path, sent)
        await assert_whole(http)
        metrics = (await http.get("/stats")).json()
        assert metrics["opened"] == 1  # only the ordinary request was registered
    # The server has stopped: its output is complete.
    assert own.failure_lines() == [], "\n".join(own.output)


# -- the hostile-input pass -----------------------------------------------------------

ANY_CHARACTER: Final = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
"""Every code point, surrogates included (Hypothesis leaves them out by default)."""
SURROGATES: Final = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
ANY_TEXT: Final = st.text(ANY_CHARACTER, max_size=10)
HOSTILE_TEXT: Final = st.one_of(
    ANY_TEXT,
    # Lone surrogates are rare among all code points: put one in on purpose, half the time.
    st.tuples(ANY_TEXT, SURROGATES, ANY_TEXT).map("".join),
)
DEEP_NESTING: Final = st.sampled_from([32, 33, 1000, 50_000]).flatmap(
    lambda depth: st.sampled_from(
        ["[" * depth + "]" * depth, '{"a": ' * depth + "1" + "}" * depth, "[" * depth]
    )
)
HUGE_NUMBERS: Final = st.sampled_from(
    [
        "1e400", "-1e400", "1e-400", "1E999999999", "9" * 4300, "9" * 4301, "-" + "9" * 5000,
        "NaN", "Infinity", "-Infinity", "18446744073709551616", "-0", "0.5", "2.0",
    ]
)  # fmt: skip
JSON_VALUES: Final = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | HOSTILE_TEXT,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(ANY_TEXT, children, max_size=3)
    ),
    max_leaves=8,
)


def has_lone_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(character) <= 0xDFFF for character in text)


@dataclasses.dataclass(frozen=True)
class Case:
    """One hostile request, and what went into it (so the pass can prove its reach)."""

    method: str
    target: str
    body: bytes | None
    kinds: frozenset[str]


LONE_TEXT: Final = st.tuples(ANY_TEXT, SURROGATES, ANY_TEXT).map("".join)
"""Text with at least one lone surrogate in it."""


@st.composite
def fragments(
    draw: st.DrawFn, field: str, valid: st.SearchStrategy[Any], *, lone: bool = False
) -> tuple[str, frozenset[str]]:
    """A value for ``field`` as JSON text, valid or hostile, and what made it hostile.

    :param lone: make it a string, or a list of strings, holding a lone surrogate.
    """
    if lone:
        value = draw(LONE_TEXT | st.lists(LONE_TEXT, min_size=1, max_size=3))
    else:
        # "valid" thrice: bodies the server accepts must be answered right, too
        kinds = ["valid"] * 3 + ["string", "strings", "wrong-type", "deep", "huge"]
        kind = draw(st.sampled_from(kinds))
        if kind == "deep":
            return draw(DEEP_NESTING), frozenset({"deep"})
        if kind == "huge":
            return draw(HUGE_NUMBERS), frozenset({"huge"})
        value = draw(
            {
                "valid": valid,
                "string": HOSTILE_TEXT,
                "strings": st.lists(HOSTILE_TEXT, min_size=1, max_size=3),
                "wrong-type": JSON_VALUES,
            }[kind]
        )
    # Escaped (\\udXXX, what a JSON encoder sends) or raw: the body is encoded with
    # "surrogatepass", so a raw lone surrogate travels as its three UTF-8-style bytes.
    escape = draw(st.booleans())
    text = json.dumps(value, ensure_ascii=escape)
    if not has_lone_surrogate(json.dumps(value, ensure_ascii=False)):
        return text, frozenset()
    return text, frozenset({f"surrogate:{field}", "surrogate:" + ("escaped" if escape else "raw")})


PROMPTS: Final = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=6)
"""Valid prompts: any code point but the surrogates (controls, NUL, astral planes)."""
ROUTES: Final[dict[str, dict[str, st.SearchStrategy[Any]]]] = {
    "/generate": {
        "text": PROMPTS | st.lists(PROMPTS, min_size=1, max_size=3),
        "max_tokens": st.integers(1, 3),
        "stream": st.booleans(),
        "rid": st.text("abcdef", min_size=1, max_size=6),
        "timeout": st.floats(5, 60),
    },
    "/v1/completions": {
        "prompt": PROMPTS | st.lists(PROMPTS, min_size=1, max_size=3),
        "model": st.text(max_size=6),
        "max_tokens": st.integers(1, 3),
        "stream": st.booleans(),
        "n": st.integers(1, 2),
        "temperature": st.floats(0, 2),
    },
    "/v1/chat/completions": {
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["system", "user", "assistant"]), "content": PROMPTS}
            ),
            min_size=1,
            max_size=2,
        ),
        "model": st.text(max_size=6),
        "max_completion_tokens": st.integers(1, 3),
        "stream": st.booleans(),
        "n": st.integers(1, 2),
        "top_p": st.floats(0, 1),
    },
}
"""Each POST route's fields, with the valid values the pass mixes with hostile ones
(short requests: the engine answers each in a few steps)."""


@st.composite
def posts(draw: st.DrawFn) -> Case:
    path = draw(st.sampled_from(sorted(ROUTES)))
    fields = ROUTES[path]
    if draw(st.integers(0, 9)) == 0:  # now and then, the whole body is one hostile value
        text, kinds = draw(fragments("body", JSON_VALUES))
        return Case("POST", path, text.encode("utf-8", "surrogatepass"), kinds)
    # Half the bodies carry a lone surrogate in one chosen place, so that every field
    # (and a key no route reads) gets its share; the other places get anything.
    lone = draw(st.none() | st.sampled_from([*fields, "key", "extra"]))
    members = []
    kinds = frozenset[str]()
    for field, valid in fields.items():
        if field in ("text", "prompt", "messages") or field == lone or draw(st.booleans()):
            value, made = draw(fragments(field, valid, lone=field == lone))
            members.append(f"{json.dumps(field)}: {value}")
            kinds |= made
    if lone in ("key", "extra") or draw(st.booleans()):  # a field no route reads
        key = draw(LONE_TEXT if lone == "key" else HOSTILE_TEXT)
        escape = draw(st.booleans())
        value, made = draw(fragments("extra", JSON_VALUES, lone=lone == "extra"))
        members.append(f"{json.dumps(key, ensure_ascii=escape)}: {value}")
        kinds |= made | ({"surrogate:key"} if has_lone_surrogate(key) else set())
    text = "{" + ", ".join(members) + "}"
    return Case("POST", path, text.encode("utf-8", "surrogatepass"), kinds)


@st.composite
def gets(draw: st.DrawFn) -> Case:
    path = draw(st.sampled_from(["/health", "/metrics", "/stats", "/metrics/aborts", "/"]))
    if draw(st.booleans()):
        raw = draw(st.binary(max_size=24))
    else:
        raw = draw(HOSTILE_TEXT).encode("utf-8", "surrogatepass")
    # Percent-encoded bytes (invalid UTF-8 and encoded surrogates included) with the
    # query's own separators left raw, so that odd keys and empty pairs reach the server.
    query = urllib.parse.quote_from_bytes(raw, safe="=&;")
    return Case("GET", f"{path}?{query}", None, frozenset({"query"}))


CASES: Final = st.integers(0, 3).flatmap(lambda pick: gets() if pick == 0 else posts())
"""A GET now and then, POSTs mostly: they are where the input goes."""


def texts(response: httpx.Response, path: str, generation: api.Generation) -> dict[int, str]:
    """The text each prompt got, by index, from a 200 answer of any route: a batch's
    ``/generate`` events come in tether's envelope, ``{"index": i, "output": ...}``."""
    streaming = generation.stream
    if not streaming:
        body = response.json()
        if path == "/v1/completions":
            return {choice["index"]: choice["text"] for choice in body["choices"]}
        if path == "/v1/chat/completions":
            return {choice["index"]: choice["message"]["content"] for choice in body["choices"]}
        results = body if generation.batched else [body]
        return {index: result["text"] for index, result in enumerate(results)}
    got: dict[int, str] = collections.defaultdict(str)
    events = [
        line.removeprefix("data: ")
        for line in response.text.splitlines()
        if line.startswith("data: ")
    ]
    assert events[-1] == "[DONE]", events
    for event in map(json.loads, events[:-1]):
        assert "error" not in event, event
        if path == "/v1/completions":
            for choice in event["choices"]:
                got[choice["index"]] += choice["text"]
        elif path == "/v1/chat/completions":
            for choice in event["choices"]:
                got[choice["index"]] += choice["delta"]["content"]
        elif generation.batched:
            got[event["index"]] += event["output"]["text"]
        else:
            got[0] += event["text"]
    return dict(got)


PARSERS: Final[dict[str, Callable[[bytes], api.Generation | openai_api.Call]]] = {
    "/generate": api.parse_generate,
    "/v1/completions": openai_api.parse_completions,
    "/v1/chat/completions": openai_api.parse_chat,
}


def check(client: httpx.Client, case: Case) -> None:
    """Send ``case``; the answer must be right or a 4xx JSON error; then the server
    must be whole (ordinary request right, healthy, nothing in flight)."""
    response = client.request(case.method, case.target, content=case.body, headers=JSON)
    status = response.status_code
    path = case.target.partition("?")[0]
    if case.method == "GET":
        assert status == 200, (case, status, response.text)
    elif status == 200:
        assert case.body is not None
        accepted = PARSERS[path](case.body)  # the server accepted it: so must its parser
        generation = accepted if isinstance(accepted, api.Generation) else accepted.generation
        expected = {
            index: expected_text(prompt, generation.max_tokens)
            for index, prompt in enumerate(generation.prompts)
        }
        assert texts(response, path, generation) == expected
    elif status == 504 and case.target == "/generate":
        # A body may ask for a deadline of a few milliseconds (a "wrong" float that
        # is a valid timeout): a 504 is then the right answer, not a failure.
        assert case.body is not None
        timeout = api.parse_generate(case.body).timeout
        assert timeout is not None, (case, response.text)
        assert timeout < 5, (case, response.text)
        assert_error_shape(response)
    else:
        assert status < 500, (case, status, response.text)
        assert_json_error(response)
    ordinary = client.post("/generate", json={"text": "ordinary", "max_tokens": 2})
    assert ordinary.status_code == 200, ordinary.text
    assert ordinary.json()["text"] == expected_text("ordinary", 2)
    health = client.get("/health")
    assert health.status_code == 200, health.text
    # Every request above has ended (its answer is complete), so nothing may be held.
    assert health.json()["in_flight"] == 0, health.text


EXAMPLES: Final = 600
"""Sized for about 10-20 s per server on a loaded 2-core machine."""


def hostile_pass(url: str, seen: collections.Counter[str]) -> None:
    """Run the property against the server at ``url`` (blocking: run it in a thread)."""
    with httpx.Client(base_url=url, timeout=BOUND) as client:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(case=CASES)
        # A batch streamed from /generate: the reader once took its events for a
        # single stream's, which only some runs' draws reached.
        @example(
            case=Case("POST", "/generate", b'{"text": ["a", "b"], "stream": true}', frozenset())
        )
        def every_answer_is_right_or_a_json_4xx(case: Case) -> None:
            seen.update(case.kinds)
            check(client, case)

        every_answer_is_right_or_a_json_4xx()


async def test_hostile_input_on_every_route_never_gets_a_5xx_and_leaves_the_server_whole(
    server: Served, http: httpx.AsyncClient
) -> None:
    seen: collections.Counter[str] = collections.Counter()
    # In a thread: Hypothesis drives a blocking client while this loop keeps reading
    # the server's output. Every exchange is bounded by the client's timeout.
    await asyncio.to_thread(hostile_pass, server.url, seen)
    fields = {"text", "rid", "timeout", "prompt", "model", "max_tokens", "stream", "extra", "key"}
    fields.add("messages")
    missing = {f"surrogate:{field}" for field in fields} - seen.keys()
    missing |= {"surrogate:escaped", "surrogate:raw", "deep", "huge", "query"} - seen.keys()
    assert not missing, f"the pass never sent {sorted(missing)}: {seen}"
    await assert_whole(http)
