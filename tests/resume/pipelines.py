"""A Redis client for tests that must see a store's pipelines land, or hold back
what Redis answered to one: its caller then waits as it would on a slow Redis."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis

__all__ = ["AfterPipelines"]


class AfterPipelines:
    """Stands for ``client``, and awaits ``after(commands)`` once each pipeline it made
    has run, before its caller hears the answers (``commands``: the arguments of each
    command the pipeline held, in order)."""

    def __init__(
        self, client: Redis, after: Callable[[list[tuple[Any, ...]]], Awaitable[None]]
    ) -> None:
        self._client = client
        self._after = after

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = self._client.pipeline(*args, **kwargs)
        execute = pipe.execute

        async def spied(*more: Any, **options: Any) -> Any:
            commands = [command for command, _ in pipe.command_stack]
            answers = await execute(*more, **options)
            await self._after(commands)
            return answers

        pipe.execute = spied  # type: ignore[method-assign]
        return pipe
