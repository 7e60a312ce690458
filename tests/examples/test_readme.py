"""Every code sample in README.md, docs/batches.md and docs/sse.md is exercised here.

The README's Python samples are excerpts of the quick-start files under
``examples/`` (checked to be verbatim, then served on 127.0.0.1 and queried); the
shell samples name Makefile targets and install extras that exist; the error table
is checked against ``tether.http.error_response``; the links point at files of the
repository. The guides' scripts are run and their output compared with what the
guide says they print; their apps are served and what they write is compared, byte
for byte, with the wire the guide shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import sys
import tomllib
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from aiohttp import web

import tether
import tether.http

from .conftest import EXAMPLES, eventually

ROOT = EXAMPLES.parent
README = (ROOT / "README.md").read_text()
QUICKSTARTS = ["quickstart_starlette.py", "quickstart_aiohttp.py"]
GUIDES = [ROOT / "docs" / "batches.md", ROOT / "docs" / "sse.md"]
GUIDE_TEXTS = {guide: guide.read_text() for guide in GUIDES}


def blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.DOTALL | re.MULTILINE)


def test_every_python_sample_is_a_tested_quickstart_file() -> None:
    samples = blocks("python")
    sources = {name: (EXAMPLES / name).read_text() for name in QUICKSTARTS}
    assert len(samples) == len(QUICKSTARTS)
    for sample, name in zip(samples, QUICKSTARTS, strict=True):
        assert sample.strip() in sources[name], f"the README's sample differs from {name}"


def test_shell_samples_name_real_make_targets_and_install_extras() -> None:
    makefile = (ROOT / "Makefile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    commands = [line.split("#")[0].strip() for block in blocks("sh") for line in block.splitlines()]
    targets = [command.split()[1] for command in commands if command.startswith("make ")]
    installs = re.findall(r"pip install -e '\.\[(\w+)\]'", "\n".join(commands))
    assert targets == ["demo", "test"]
    assert installs == ["starlette", "aiohttp"]
    for target in targets:
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), target
    for extra in installs:
        assert extra in extras


ERRORS = {
    "`Overloaded`": tether.Overloaded(4),
    "`RegistryClosed`": tether.RegistryClosed(),
    "`RequestTimeout`": tether.RequestTimeout("r", 1.0),
    "`ConsumerTooSlow`": tether.ConsumerTooSlow("r", 8),
    "`Aborted` by the server": tether.Aborted("r", tether.AbortReason.SERVER),
    "`Aborted`, client gone": tether.Aborted("r", tether.AbortReason.CLIENT_DISCONNECTED),
    "`DuplicateRequest`": tether.DuplicateRequest("r"),
    "`UnknownRequest`": tether.UnknownRequest("r"),
    "`BatchTooLarge`": tether.BatchTooLarge(9, 4),
    "`InvalidRequest`": tether.InvalidRequestId("", "empty"),
    "`ProducerError`": tether.ProducerError("r", RuntimeError("boom")),
    "any other exception": RuntimeError("secret"),
}


def test_error_table_says_what_error_response_does() -> None:
    rows = re.findall(r"^\| (`?\w.*?) \| (\d{3})(.*?) \|$", README, re.MULTILINE)
    assert len(rows) == len(ERRORS)
    for label, status, note in rows:
        key = next(key for key in ERRORS if label.startswith(key))
        response = tether.http.error_response(ERRORS[key])
        assert response.status == int(status), label
        assert ("Retry-After" in note) == ("retry-after" in response.headers), label


PAGES = [
    ROOT / "README.md",
    *GUIDES,
    ROOT / "docs" / "architecture.md",
    ROOT / "docs" / "monitoring.md",
    EXAMPLES / "README.md",
]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_links_point_at_files_of_the_repository(page: Path) -> None:
    links = re.findall(r"\]\(([^)#]+)\)", page.read_text())
    assert links
    for link in links:
        if "://" not in link:
            assert (page.parent / link).exists(), link


async def generate_both_ways(url: str) -> None:
    """What the README's curl line does, streamed, then the same as one JSON body
    (which holds every output, joined by the quick start's ``merge``)."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        body = {"text": "hello tether world", "stream": True}
        async with client.stream("POST", "/generate", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        texts = [json.loads(line.removeprefix("data: "))["text"] for line in lines[:-1]]
        assert "".join(texts) == " hello tether world"
        result = (await client.post("/generate", json={"text": "hello tether world"})).json()
        assert result == {"text": " hello tether world"}


def test_the_quickstarts_import_nothing_from_the_examples() -> None:
    """Self-contained: pasted into a file anywhere, they run with tether installed."""
    siblings = {path.stem for path in EXAMPLES.glob("*.py")}
    for name in QUICKSTARTS:
        source = (EXAMPLES / name).read_text()
        imported = set(re.findall(r"^(?:from|import) (\w+)", source, re.MULTILINE))
        assert not imported & siblings, name


def test_the_readme_samples_say_the_same_thing_line_for_line() -> None:
    """The two quick starts differ only where the frameworks do."""
    starlette, aiohttp = blocks("python")
    assert abs(starlette.count("\n") - aiohttp.count("\n")) < 4
    for sample in (starlette, aiohttp):
        assert sample.count("\n") <= 20  # a quick start a reader takes in at a glance
    files = [(EXAMPLES / name).read_text() for name in QUICKSTARTS]
    producers = [text[text.index("class Producer") : text.index("def join")] for text in files]
    assert producers[0] == producers[1]  # the README's "the same stand-in producer"


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """``app`` under a real uvicorn on 127.0.0.1 (an ephemeral port); yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await eventually(lambda: server.started or task.done())
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        async with asyncio.timeout(10):
            await task


async def test_starlette_quickstart_serves_generate() -> None:
    import quickstart_starlette

    async with serving(quickstart_starlette.app) as url:
        await generate_both_ways(url)
    assert quickstart_starlette.registry.in_flight == 0


@pytest.fixture
async def aiohttp_quickstart() -> AsyncIterator[str]:
    import quickstart_aiohttp

    runner = web.AppRunner(quickstart_aiohttp.app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_aiohttp_quickstart_serves_generate(aiohttp_quickstart: str) -> None:
    import quickstart_aiohttp

    await generate_both_ways(aiohttp_quickstart)
    assert quickstart_aiohttp.registry.in_flight == 0


def test_the_batch_guide_script_prints_what_the_guide_says() -> None:
    guide = GUIDE_TEXTS[GUIDES[0]]
    script, printed = blocks("python", guide)[0], blocks("text", guide)[0]
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == printed


def wires(guide: str) -> list[str]:
    """The wire samples of a guide: the text blocks under a ``<!-- the ... wire -->`` mark."""
    return re.findall(r"^<!-- the .*? wire.*?-->\n```text\n(.*?)^```", guide, re.DOTALL | re.M)


def same_but_rids(body: str) -> str:
    """``body`` with its request ids (fresh, random) replaced by one placeholder."""
    return re.sub(r"request '[^']+'", "request 'RID'", body)


# For each guide: the requests whose answers its wire samples show (the curl lines).
GUIDE_REQUESTS = {
    "batches.md": [{"texts": ["a", "b"], "stream": True}],
    "sse.md": [{"text": "hello sse"}, {"text": "hello sse", "fail": True}],
}


@pytest.mark.parametrize("guide", GUIDES, ids=lambda page: page.name)
async def test_a_guide_app_writes_the_wire_the_guide_shows(guide: Path) -> None:
    """Byte for byte, through a real uvicorn. When the framing changes on purpose, this
    fails with the new bytes: paste them into the guide."""
    text = GUIDE_TEXTS[guide]
    source = blocks("python", text)[-1]  # the guide's app
    module = types.ModuleType(f"guide_{guide.stem}")
    exec(compile(source, str(guide), "exec"), vars(module))
    samples, requests = wires(text), GUIDE_REQUESTS[guide.name]
    assert len(samples) == len(requests)
    async with serving(module.app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        for sample, body in zip(samples, requests, strict=True):
            answer = await client.post("/generate", json=body)
            assert same_but_rids(answer.text) == same_but_rids(sample), answer.text
        if guide.name == "batches.md":  # and the one JSON body the guide quotes
            answer = await client.post("/generate", json={"texts": ["a", "b"]})
            assert f"`{answer.text}`" in " ".join(text.split())
    assert module.registry.in_flight == 0
