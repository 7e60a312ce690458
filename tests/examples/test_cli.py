"""The example servers' command line: ``--http`` and ``--loop`` choose the stack a
server runs on, a wrong choice is refused before anything starts, and the server's
first line names the stack it resolved (what the connection and shutdown tests rely
on to know that each stack they ask for is the one they test; ``auto`` is checked
here)."""

from __future__ import annotations

import importlib.util
from importlib.machinery import ModuleSpec
from typing import Final

import cli
import httpx
import pytest

from .conftest import Stack, served

UVICORN_DEFAULT: Final = Stack("httptools", "uvloop")
"""What uvicorn's ``auto`` picks with httptools and uvloop installed (the dev extras)."""


def test_http_and_loop_choices_reach_the_options() -> None:
    options = cli.parse(["--http", "h11", "--loop", "asyncio"], "test")
    assert (options.http, options.loop) == ("h11", "asyncio")
    assert (cli.parse([], "test").http, cli.parse([], "test").loop) == ("auto", "auto")


def test_the_uvicorn_config_runs_the_chosen_stack_with_a_grace_period_past_the_drain() -> None:
    options = cli.parse(["--http", "h11", "--loop", "uvloop", "--drain-timeout", "6"], "test")
    config = cli.uvicorn_config(lambda: None, options)
    assert (config.http, config.loop) == ("h11", "uvloop")
    assert config.timeout_graceful_shutdown == 9  # 6 s of drain + the 3 s margin


@pytest.mark.parametrize(
    ("argv", "uvicorn", "complaint"),
    [
        pytest.param(["--http", "h2"], True, "invalid choice: 'h2'", id="unknown-http"),
        pytest.param(["--loop", "trio"], True, "invalid choice: 'trio'", id="unknown-loop"),
        pytest.param(["--http", "h11"], False, "unrecognized arguments", id="http-on-aiohttp"),
    ],
)
def test_a_wrong_stack_choice_is_refused_with_usage(
    argv: list[str], uvicorn: bool, complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.parse(argv, "test", uvicorn=uvicorn)
    assert exited.value.code == 2
    assert complaint in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--loop", "uvloop"], ["--http", "httptools"]])
def test_a_stack_whose_package_is_missing_is_refused_with_the_install_line(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = argv[1]
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == missing else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(SystemExit) as exited:
        cli.parse(argv, "test")
    assert exited.value.code == 2
    assert f"pip install {missing}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "args", "stack"),
    [
        pytest.param("starlette", (), UVICORN_DEFAULT, id="starlette-auto"),
        pytest.param("fastapi", (), UVICORN_DEFAULT, id="fastapi-auto"),
        pytest.param("aiohttp", (), Stack(None, "asyncio"), id="aiohttp-auto"),
    ],
)
async def test_a_server_announces_the_stack_it_resolved_and_serves_on_it(
    name: str, args: tuple[str, ...], stack: Stack
) -> None:
    async with (
        served(name, *args) as server,
        httpx.AsyncClient(base_url=server.url, timeout=10) as client,
    ):
        stack.check(name, server.output[0])
        response = await client.post("/generate", json={"text": "hi", "max_tokens": 3})
        assert response.status_code == 200, response.text
    assert server.failure_lines() == [], "\n".join(server.output)
