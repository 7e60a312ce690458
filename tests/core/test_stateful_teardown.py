"""The stateful machine's model follows a doomed consumer (dropped in a reference cycle)
that a collection inside the teardown's own deliveries frees: found by running
tests/core/test_stateful.py with random seeds; it fails on main as well."""

from __future__ import annotations

from tests.core.test_stateful import RegistryMachine


def test_the_model_follows_a_consumer_freed_by_a_collection_during_the_final_deliveries() -> None:
    state = RegistryMachine()
    state.start(
        eager=False,
        merge=False,
        max_in_flight=None,
        max_pending=1,
        streams=0,
        batch=None,
        keep_going=False,
        gc_points=frozenset(["merge", "on_abort", "observer"]),
    )
    state.open_batch(keep_going=False, names=None, size=1, timeout=None)
    state.open_batch(keep_going=False, names=None, size=1, timeout=None)
    state.read(idle=None, mode="iter", n=1, pick=0)
    state.drop_consumer(cycle=True, now=True, pick=0)
    state.open_batch(keep_going=False, names=None, size=1, timeout=None)
    state.teardown()
