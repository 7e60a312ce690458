"""A token no store could have written reaches no store, whichever door it comes in by:
a reconnect (resume_point) or a Stop (Resume.cancel)."""

from __future__ import annotations

import pytest

import tether.resume


class _Recording(tether.resume.MemoryStore):
    """The default store, noting every token it is asked to look up."""

    __slots__ = ("asked",)

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    async def follow(self, token: str, after: int) -> tether.resume.Follower | None:
        self.asked.append(len(token))
        return await super().follow(token, after)

    async def cancel(self, token: str) -> bool:
        self.asked.append(len(token))
        return await super().cancel(token)


@pytest.mark.parametrize(
    "token", ["t" * 60_000, "tökén", "a\x00b"], ids=["60KB", "non-ascii", "nul"]
)
async def test_a_stop_with_a_token_no_store_could_have_written_reaches_no_store(
    token: str,
) -> None:
    store = _Recording()
    resume = tether.resume.Resume(store=store)
    try:
        assert await resume.cancel(token) is False
    finally:
        await resume.aclose()
    assert store.asked == []
