"""One producer behind two registries on one loop (one per endpoint family) is one
producer: the loop's ``Steps`` are shared so that neither registry's ``on_abort``
runs inside its step. Its ``on_abort`` keeps the queue's other promises too: the
requests an ``on_abort`` ends are told after it returns, never from inside it, and
calls come in the order the requests ended."""

from __future__ import annotations

import tether


class Engine:
    """One ``on_abort`` for both registries; records nesting and order."""

    def __init__(self) -> None:
        self.depth = 0
        self.order: list[str] = []
        self.nested: list[str] = []
        self.then: dict[str, tuple[tether.Registry, str]] = {}

    def on_abort(self, rid: str) -> None:
        if self.depth:
            self.nested.append(rid)
        self.depth += 1
        try:
            self.order.append(rid)
            if rid in self.then:
                registry, other = self.then[rid]
                registry.abort(other)
        finally:
            self.depth -= 1


async def test_an_on_abort_that_ends_a_request_of_the_other_registry_is_not_reentered() -> None:
    engine = Engine()
    chat = tether.Registry(engine.on_abort)
    embed = tether.Registry(engine.on_abort)
    chat_stream = chat.open("chat-1")
    embed_stream = embed.open("embed-1")
    engine.then["chat-1"] = (embed, "embed-1")  # (the engine cancels a linked request)

    chat.abort("chat-1")
    await chat.close(drain_timeout=0)
    await embed.close(drain_timeout=0)

    assert engine.order == ["chat-1", "embed-1"]
    assert engine.nested == []
    assert chat_stream.rid == "chat-1"
    assert embed_stream.rid == "embed-1"


async def test_requests_of_two_registries_are_told_in_the_order_they_ended() -> None:
    engine = Engine()
    chat = tether.Registry(engine.on_abort)
    embed = tether.Registry(engine.on_abort)
    first = chat.open("chat-1")
    second = chat.open("chat-2")
    other = embed.open("embed-1")
    first.set_sink(lambda outputs: chat.abort("chat-2") or True)

    chat.deliver("chat-1", 1)  # "chat-2" ends inside the producer's step
    embed.abort("embed-1")  # "embed-1" ends after it
    await chat.close(drain_timeout=0)
    await embed.close(drain_timeout=0)

    assert engine.order == ["chat-2", "embed-1", "chat-1"]
    assert second.rid == "chat-2"
    assert other.rid == "embed-1"
