"""``asyncio.eager_task_factory`` on every Python tether supports.

Python 3.12 has it; on 3.11 this module provides the same behaviour for the test
suite: ``create_task`` runs the coroutine's first step at once, in the new task,
before returning. It builds on the pure-Python ``Task`` (whose first step can be
taken by hand) and swaps the current task around that step exactly as 3.12 does.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from typing import Any

_Factory = Callable[..., "asyncio.Future[Any]"]


def _backported_factory() -> _Factory:
    from asyncio import tasks

    py_task: Any = tasks._PyTask  # type: ignore[attr-defined]

    class EagerTask(py_task):  # type: ignore[misc, valid-type]
        def __init__(
            self,
            coro: Coroutine[Any, Any, Any],
            *,
            loop: asyncio.AbstractEventLoop,
            name: str | None = None,
            context: contextvars.Context | None = None,
        ) -> None:
            if not loop.is_running():  # as in 3.12: eager only inside a running loop
                super().__init__(coro, loop=loop, name=name)
                return
            # _PyTask.__init__ schedules its first step with call_soon: catch it.
            first: list[tuple[Callable[..., object], contextvars.Context | None]] = []

            def capture(
                callback: Callable[..., object], *args: object, context: Any = None
            ) -> None:
                first.append((callback, context))

            loop.call_soon = capture  # type: ignore[method-assign]
            try:
                super().__init__(coro, loop=loop, name=name)
            finally:
                del loop.call_soon
            step, step_context = first[0]
            current = tasks.current_task(loop)
            if current is not None:
                tasks._leave_task(loop, current)
            try:
                (step_context or contextvars.copy_context()).run(step)
            finally:
                if current is not None:
                    tasks._enter_task(loop, current)

    def factory(
        loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Future[Any]:
        task: asyncio.Future[Any] = EagerTask(coro, loop=loop, **kwargs)
        return task

    return factory


eager_task_factory: _Factory = getattr(asyncio, "eager_task_factory", None) or _backported_factory()


def new_eager_loop() -> asyncio.AbstractEventLoop:
    """A fresh event loop whose tasks start eagerly."""
    loop = asyncio.new_event_loop()
    loop.set_task_factory(eager_task_factory)  # type: ignore[arg-type]
    return loop
