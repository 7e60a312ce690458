"""The example page in headless Chromium: generate, watch the outputs grow, press Stop,
and see the server's work aborted (its in-flight count back to 0).

Chromium is driven over the DevTools protocol with aiohttp's websocket client. The
test needs a ``chromium`` binary (Debian's package; ``.ci/run`` installs it) and
skips, saying so, only when there is none.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import pathlib
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import pytest
from engine import expected_text
from launch import launched

from tests._support.processes import stop

from .conftest import eventually

CHROMIUM = next(
    filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None
)

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium binary on PATH (apt-get install chromium): the page test needs one",
)

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
)


class Page:
    """One browser tab over the DevTools protocol: evaluate JavaScript, get its value."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self.socket = socket
        self.ids = itertools.count(1)
        self.events: list[str] = []  # methods of the events seen while awaiting replies

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self.ids)
        await self.socket.send_json({"id": ident, "method": method, "params": params})
        async for message in self.socket:
            reply = json.loads(message.data)
            if "method" in reply:
                self.events.append(reply["method"])
            elif reply.get("id") == ident:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply["result"]
                return result
        raise RuntimeError("the DevTools connection closed")

    async def open(self, url: str) -> None:
        """Navigate to ``url`` and wait for its load event (so scripts have run)."""
        await self.call("Page.enable")
        self.events.clear()
        await self.call("Page.navigate", url=url)
        if "Page.loadEventFired" in self.events:
            return
        async for message in self.socket:
            if json.loads(message.data).get("method") == "Page.loadEventFired":
                return
        raise RuntimeError("the DevTools connection closed")

    async def js(self, expression: str) -> Any:
        reply = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Page]:
    """A headless Chromium with a fresh profile; yields its first tab; stopped on exit."""
    assert CHROMIUM is not None  # the module is skipped otherwise
    # Chromium's helper processes may still write to the profile as it is removed.
    with tempfile.TemporaryDirectory(
        prefix="tether-chromium-", ignore_cleanup_errors=True
    ) as profile:
        process = await asyncio.create_subprocess_exec(
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={profile}",
            "about:blank",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,  # its own process group, helpers included
        )
        try:
            port = await devtools_port(process, pathlib.Path(profile))
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
                    targets = await response.json()
                tab = next(target for target in targets if target["type"] == "page")
                async with session.ws_connect(tab["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    yield Page(ws)
        finally:
            await stop(process)
            with contextlib.suppress(ProcessLookupError):  # helpers left behind, if any
                os.killpg(process.pid, signal.SIGKILL)


async def devtools_port(process: asyncio.subprocess.Process, profile: pathlib.Path) -> str:
    """Chromium writes its DevTools port to ``DevToolsActivePort`` in the profile once
    it listens (port on the first line, browser path on the second)."""
    active = profile / "DevToolsActivePort"

    def listening() -> bool:
        if process.returncode is not None:
            raise RuntimeError(f"Chromium exited with {process.returncode} before listening")
        return active.exists() and len(active.read_text().splitlines()) >= 2

    await eventually(listening, timeout=30)
    return active.read_text().splitlines()[0]


PANES = """JSON.stringify([...document.querySelectorAll('.pane')].map(pane => ({
    prompt: pane.dataset.prompt,
    tokens: Number(pane.dataset.tokens),
    text: pane.querySelector('.text').textContent,
})))"""


@contextlib.asynccontextmanager
async def page_of(server: str) -> AsyncIterator[tuple[httpx.AsyncClient, Page]]:
    """The example ``server`` running, a client of its API, and Chromium on its page."""
    async with (
        launched(server) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as http,
        chromium() as page,
    ):
        await page.open(url + "/")
        yield http, page


@pytest.mark.parametrize("server", ["starlette", "aiohttp"])
async def test_page_generates_side_by_side_and_stop_aborts_the_work(server: str) -> None:
    async with asyncio.timeout(60), page_of(server) as (http, page):
        await eventually(
            lambda: page.js("document.getElementById('inflight')?.textContent === '0'")
        )
        await page.js("""
            document.getElementById('prompt').value = 'stream to me';
            document.getElementById('batch').value = '2';
            document.getElementById('max-tokens').value = '4000';
            document.getElementById('stream').checked = true;
            document.getElementById('generate').click();
        """)

        panes: list[dict[str, Any]] = []

        async def both_growing() -> bool:
            panes[:] = json.loads(await page.js(PANES))
            return len(panes) == 2 and all(pane["tokens"] >= 5 for pane in panes)

        await eventually(both_growing)
        for pane in panes:  # every token so far, in order
            assert pane["text"] == expected_text(pane["prompt"], pane["tokens"])
        await eventually(
            lambda: page.js("document.getElementById('inflight')?.textContent === '2'")
        )

        await page.js("document.getElementById('stop').click()")

        async def server_idle() -> bool:
            metrics = (await http.get("/stats")).json()
            return bool(metrics["in_flight"] == 0 and metrics["engine"]["running"] == 0)

        await eventually(server_idle)
        metrics = (await http.get("/stats")).json()
        assert metrics["aborted"] == {"client_disconnected": 2}
        assert metrics["finished"] == 0
        assert await page.js("document.getElementById('status').textContent") == "stopped"
        await eventually(
            lambda: page.js("document.getElementById('inflight')?.textContent === '0'")
        )


class CuttingProxy:
    """A TCP relay on 127.0.0.1 in front of a server, whose open connections the test
    can cut at once, both sides, as a network drop does (no HTTP-level goodbye)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = httpx.URL(upstream)
        self.pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.relays: set[asyncio.Task[None]] = set()

    async def relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.relays.add(task)
        host, port = self.upstream.host, self.upstream.port
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self.pairs.add(pair)
        pipes = [
            asyncio.create_task(_pipe(reader, up_writer)),
            asyncio.create_task(_pipe(up_reader, writer)),
        ]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
            await asyncio.wait(pipes)
            self.pairs.discard(pair)
            for side in pair:
                side.transport.abort()
            self.relays.discard(task)

    def cut(self) -> int:
        """Drop every open connection, both sides; how many there were."""
        pairs = list(self.pairs)
        for pair in pairs:
            for side in pair:
                side.transport.abort()
        return len(pairs)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()


@contextlib.asynccontextmanager
async def cutting_proxy(upstream: str) -> AsyncIterator[tuple[str, CuttingProxy]]:
    """A :class:`CuttingProxy` to ``upstream``; its URL. Its relays end with it."""
    proxy = CuttingProxy(upstream)
    server = await asyncio.start_server(proxy.relay, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", proxy
    finally:
        server.close()
        proxy.cut()
        relays = set(proxy.relays)
        for relay in relays:
            relay.cancel()
        if relays:
            await asyncio.wait(relays)
        await server.wait_closed()


async def generate(page: Page, prompt: str, tokens: int) -> None:
    """Fill the page's form for one streamed prompt (resumable) and press Generate."""
    await page.js(f"""
        document.getElementById('prompt').value = {json.dumps(prompt)};
        document.getElementById('batch').value = '1';
        document.getElementById('max-tokens').value = '{tokens}';
        document.getElementById('stream').checked = true;
        document.getElementById('generate').click();
    """)


async def settled(http: httpx.AsyncClient) -> dict[str, Any]:
    """The server's stats once nothing is in flight, in the registry or the engine."""

    async def idle() -> bool:
        metrics = (await http.get("/stats")).json()
        return bool(metrics["in_flight"] == 0 and metrics["engine"]["running"] == 0)

    await eventually(idle)
    stats: dict[str, Any] = (await http.get("/stats")).json()
    return stats


@pytest.mark.parametrize("server", ["starlette", "aiohttp"])
async def test_page_resumes_a_dropped_stream_and_shows_the_whole_answer_once(server: str) -> None:
    prompt, tokens = "resume me in the browser", 800
    async with (
        asyncio.timeout(60),
        launched(server) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as http,
        cutting_proxy(url) as (proxied, proxy),
        chromium() as page,
    ):
        await page.open(proxied + "/")
        await generate(page, prompt, tokens)

        panes: list[dict[str, Any]] = []

        async def growing() -> bool:
            panes[:] = json.loads(await page.js(PANES))
            return len(panes) == 1 and panes[0]["tokens"] >= 20

        await eventually(growing)
        assert proxy.cut() >= 1  # the stream's connection, mid-stream
        assert panes[0]["tokens"] < tokens

        await eventually(
            lambda: page.js("document.getElementById('status').textContent === 'done'"),
            timeout=30,
        )
        panes[:] = json.loads(await page.js(PANES))
        whole = expected_text(prompt, tokens)
        assert panes == [{"prompt": prompt, "tokens": tokens, "text": whole}]  # once, in order
        resumes = await page.js("document.getElementById('status').dataset.resumes")
        assert int(resumes) >= 1

        metrics = await settled(http)
        assert (metrics["finished"], metrics["aborted"]) == (1, {})  # never aborted


@pytest.mark.parametrize("server", ["starlette", "aiohttp"])
async def test_stop_on_a_resumable_stream_aborts_the_work_at_once(server: str) -> None:
    # A closed connection only parks a resumable stream (for 30 s in the examples):
    # the work stops within the bound only because Stop posts the stream's token.
    async with asyncio.timeout(60), page_of(server) as (http, page):
        await generate(page, "stop me", 4000)
        tokens = "Number(document.querySelector('.pane')?.dataset.tokens)"
        await eventually(lambda: page.js(f"{tokens} >= 5"))
        await page.js("document.getElementById('stop').click()")
        metrics = await settled(http)
        assert (metrics["aborted"], metrics["finished"]) == ({"cancelled": 1}, 0)
        assert await page.js("document.getElementById('status').textContent") == "stopped"


@pytest.mark.parametrize(
    ("batch", "stream"),
    [(3, True), (3, False), (1, True)],
    ids=["batch-streamed", "batch-json", "resumable-stream"],
)
async def test_page_counts_nothing_in_flight_once_it_says_done(batch: int, stream: bool) -> None:
    """The counter is read again as the status turns to done: never "done" beside a
    stale "server in flight: 3"."""
    async with asyncio.timeout(60), page_of("starlette") as (http, page):
        await eventually(
            lambda: page.js("document.getElementById('inflight')?.textContent === '0'")
        )
        # Whatever the status and the counter say at each change of the status.
        await page.js("""
            window.seen = [];
            new MutationObserver(() => window.seen.push([
                document.getElementById('status').textContent,
                document.getElementById('inflight').textContent,
            ])).observe(document.getElementById('status'), { childList: true, subtree: true });
        """)
        await page.js(f"""
            document.getElementById('prompt').value = 'count me';
            document.getElementById('batch').value = '{batch}';
            document.getElementById('max-tokens').value = '200';
            document.getElementById('stream').checked = {json.dumps(stream)};
            document.getElementById('generate').click();
        """)
        await eventually(
            lambda: page.js("document.getElementById('status').textContent === 'done'"),
            timeout=30,
        )
        seen = await page.js("window.seen")
        assert seen[-1] == ["done", "0"], seen
        assert (await http.get("/stats")).json()["in_flight"] == 0
