"""setup(): the plugin's registration, its clear errors, sub-applications, the
watcher's lifetime and the graceful shutdown drain."""

from __future__ import annotations

import asyncio
import functools

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from aiohttp.typedefs import Handler
from pytest_aiohttp import AiohttpClient

import tether
import tether.http
import tether_aiohttp

from .conftest import Env, build_app, sse_events, start_default_server

BOUND = 10.0
NOT_SET_UP = r"call tether_aiohttp\.setup\(app, \.\.\.\) first"


def test_exports_only_the_entry_points_in_a_sorted_all() -> None:
    assert tether_aiohttp.__all__ == [
        "REGISTRY_KEY",
        "get_registry",
        "json_errors",
        "respond",
        "resume",
        "setup",
    ]


@pytest.mark.parametrize("same_registry", [True, False], ids=["same-registry", "two-registries"])
async def test_set_up_on_an_app_and_its_sub_app_one_installation_serves_each_request(
    aiohttp_client: AiohttpClient, same_registry: bool
) -> None:
    registry = tether.Registry()
    scopes: list[object] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        scopes.append(tether.http.current_scope())
        stream = registry.open()
        registry.deliver(stream.rid, {"ok": True}, finished=True)
        return await tether_aiohttp.respond(request, stream, streaming=False)

    sub = web.Application()
    sub.router.add_get("/", handle)
    tether_aiohttp.setup(sub, registry if same_registry else tether.Registry())
    app = web.Application()
    tether_aiohttp.setup(app, registry)
    app.add_subapp("/sub", sub)
    client = await aiohttp_client(app)
    async with asyncio.timeout(BOUND):
        response = await client.get("/sub/")
    if same_registry:
        assert await response.json() == {"ok": True}
        assert len(scopes) == 1  # one scope: the outer installation's
        assert isinstance(scopes[0], tether.RequestScope)
    else:  # handlers would see only one of the two registries: refused
        assert response.status == 500
        assert scopes == []
    assert registry.in_flight == 0


def test_setup_stores_the_registry_under_the_app_key() -> None:
    app, registry = web.Application(), tether.Registry()
    tether_aiohttp.setup(app, registry)
    assert app[tether_aiohttp.REGISTRY_KEY] is registry
    assert tether_aiohttp.get_registry(app) is registry


def test_setup_twice_is_a_clear_error() -> None:
    app, registry = web.Application(), tether.Registry()
    tether_aiohttp.setup(app, registry)
    with pytest.raises(RuntimeError, match=r"setup\(\) was already called on this app"):
        tether_aiohttp.setup(app, registry)
    assert len(app.middlewares) == 1


@pytest.mark.parametrize(
    ("option", "value"), [("drain_timeout", -1.0), ("poll_interval", 0.0)], ids=str
)
def test_setup_rejects_bad_options(option: str, value: float) -> None:
    with pytest.raises(ValueError, match=option):
        tether_aiohttp.setup(web.Application(), tether.Registry(), **{option: value})


def test_get_registry_without_setup_names_the_missing_call() -> None:
    with pytest.raises(RuntimeError, match=NOT_SET_UP):
        tether_aiohttp.get_registry(web.Application())


async def test_respond_without_setup_names_the_missing_call_and_closes_the_stream() -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    stream = registry.open()
    with pytest.raises(RuntimeError, match=NOT_SET_UP):
        await tether_aiohttp.respond(make_mocked_request("GET", "/"), stream, streaming=True)
    assert registry.in_flight == 0
    assert aborted == [stream.rid]


async def test_sub_app_handlers_find_the_registry_and_get_a_scope(
    aiohttp_client: AiohttpClient,
) -> None:
    registry = tether.Registry()
    seen: list[object] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append(tether_aiohttp.get_registry(request))
        seen.append(tether.http.current_scope())
        stream = registry.open()
        registry.deliver(stream.rid, {"ok": True}, finished=True)
        return await tether_aiohttp.respond(request, stream, streaming=False)

    sub = web.Application()
    sub.router.add_get("/", handle)
    app = web.Application()
    tether_aiohttp.setup(app, registry)
    app.add_subapp("/sub", sub)
    client = await aiohttp_client(app)
    async with asyncio.timeout(BOUND):
        response = await client.get("/sub/")
        body = await response.json()
    assert body == {"ok": True}
    assert seen[0] is registry
    assert isinstance(seen[1], tether.RequestScope)


def watchers() -> list[asyncio.Task[object]]:
    return [
        task
        for task in asyncio.all_tasks()
        if task.get_name() == "tether-aiohttp-disconnect-watcher"
    ]


async def test_disconnect_watcher_runs_with_the_app_and_is_gone_after_cleanup() -> None:
    runner, _ = await start_default_server(build_app_without_routes())
    started = watchers()
    await runner.cleanup()
    assert len(started) == 1
    assert started[0].cancelled()
    assert watchers() == []


def build_app_without_routes() -> web.Application:
    app = web.Application()
    tether_aiohttp.setup(app, tether.Registry())
    return app


async def test_shutdown_lets_requests_finish_within_the_grace_and_ends_the_rest_with_an_error(
    env: Env,
) -> None:
    tracker = env.tracker
    app = build_app(env, drain_timeout=0.2)

    async def finish_first_during_the_drain(app: web.Application) -> None:
        # runs just before the drain (on_shutdown order); the delivery lands inside it
        rid = tracker.opened[0]
        finish = functools.partial(env.registry.deliver, rid, {"text": "end"}, finished=True)
        asyncio.get_running_loop().call_soon(finish)

    app.on_shutdown.insert(0, finish_first_during_the_drain)
    runner, port = await start_default_server(app)
    async with asyncio.timeout(BOUND), aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{port}/?n=1&end=hold"
        responses = [await session.get(url) for _ in range(2)]
        firsts = [await response.content.readuntil(b"\n\n") for response in responses]
        started = asyncio.get_running_loop().time()
        await runner.cleanup()
        elapsed = asyncio.get_running_loop().time() - started
        bodies = [
            first + await response.read() for first, response in zip(firsts, responses, strict=True)
        ]
    finished, drained = (sse_events(body) for body in bodies)
    assert finished == [{"text": "0.0"}, {"text": "end"}, "[DONE]"]
    assert drained[0] == {"text": "0.0"}
    assert drained[1]["error"] == {
        "message": "the server is shutting down",
        "type": "Aborted",
        "code": 503,
    }
    assert drained[2:] == ["[DONE]"]
    assert elapsed < 2.0
    assert env.registry.in_flight == 0
    assert tracker.aborted.keys() == {tracker.opened[1]}


async def crashes(request: web.Request) -> web.StreamResponse:
    raise ValueError("a bug in the handler")


async def times_out(request: web.Request) -> web.StreamResponse:
    raise TimeoutError


async def returns_nothing(request: web.Request) -> web.StreamResponse:
    return None  # type: ignore[return-value]


@web.middleware
async def error_page(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An app's own outer error page, around tether's middleware."""
    try:
        return await handler(request)
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=500)


async def test_the_request_id_is_echoed_on_every_answer(aiohttp_client: AiohttpClient) -> None:
    """Whoever builds the answer (the handler, tether's middleware, aiohttp's router or
    error handling, an outer middleware) and whenever it is prepared, it carries the
    client's request id: only a hook on aiohttp's prepare sees all of them (a version
    that labelled from the middleware and respond() lost the error answers)."""
    registry = tether.Registry()

    async def plain(request: web.Request) -> web.StreamResponse:
        return web.Response(text="plain")

    async def refused(request: web.Request) -> web.StreamResponse:
        raise web.HTTPForbidden(text="no")

    async def overloaded(request: web.Request) -> web.StreamResponse:
        raise tether.Overloaded(1)

    async def stream(request: web.Request) -> web.StreamResponse:
        source = registry.open()
        registry.deliver(source.rid, {"n": 1}, finished=True)
        return await tether_aiohttp.respond(request, source, streaming=True)

    async def prepared_early(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"early")
        return response

    app = web.Application(middlewares=[error_page])
    tether_aiohttp.setup(app, registry)
    routes = {
        "/plain": (plain, 200),
        "/refused": (refused, 403),
        "/overloaded": (overloaded, 503),
        "/stream": (stream, 200),
        "/early": (prepared_early, 200),
        "/crash": (crashes, 500),  # answered by the outer error page
        "/timeout": (times_out, 504),  # answered by aiohttp
        "/none": (returns_nothing, 500),  # answered by aiohttp
    }
    for path, (handler, _) in routes.items():
        app.router.add_get(path, handler)
    client = await aiohttp_client(app)
    header = tether.http.REQUEST_ID_HEADER
    expected = {path: status for path, (_, status) in routes.items()} | {"/missing": 404}
    for path, status in expected.items():
        async with asyncio.timeout(BOUND):
            response = await client.get(path, headers={header: f"id{path}"})
            await response.read()
        assert (response.status, response.headers.get(header)) == (status, f"id{path}")
        async with asyncio.timeout(BOUND):
            response = await client.get(path)  # none given: none invented
            await response.read()
        assert header not in response.headers, path
    assert registry.in_flight == 0
