"""The throttle every peer-triggered log line goes through: a burst at once, then one
line per period, each line after a held-back spell saying how many went unsaid; and
a peer's text shown escaped."""

from __future__ import annotations

import logging

import pytest

from tether_zmq._throttle import BURST, PERIOD, Throttle, quoted

from .conftest import LogClock

_LOGGER = logging.getLogger("tether.zmq.test")


def _said(throttle: Throttle, times: int) -> list[bool]:
    return [throttle.log(_LOGGER, logging.WARNING, "line") for _ in range(times)]


def test_a_burst_goes_out_at_once_then_nothing_until_a_period_passes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = LogClock()
    throttle = Throttle(clock=clock)
    assert _said(throttle, 1000).count(True) == BURST
    clock.advance(PERIOD / 2)
    assert _said(throttle, 1000).count(True) == 0
    clock.advance(PERIOD / 2)
    assert _said(throttle, 1000).count(True) == 1
    assert len(caplog.records) == BURST + 1


def test_lines_per_second_are_bounded_by_the_period_whatever_the_rate_of_calls() -> None:
    clock = LogClock()
    throttle = Throttle(clock=clock)
    said = 0
    for _ in range(100_000):  # (a call every millisecond for 100 s)
        clock.advance(0.001)
        said += throttle.allow() is not None
    assert said <= BURST + 100 / PERIOD + 1


def test_the_first_line_after_a_held_back_spell_says_how_many_went_unsaid(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = LogClock()
    throttle = Throttle(burst=1, period=60.0, clock=clock)
    _said(throttle, 8)
    clock.advance(60.0)
    _said(throttle, 1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["line", "line (and 7 more like it unsaid)"]


def test_a_quiet_spell_refills_no_more_than_the_burst() -> None:
    clock = LogClock()
    throttle = Throttle(clock=clock)
    clock.advance(PERIOD * 1000)
    assert [throttle.allow() for _ in range(BURST + 1)].count(None) == 1


def test_a_line_at_a_level_that_is_off_costs_no_token(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=_LOGGER.name)
    throttle = Throttle(burst=1, clock=LogClock())
    assert not throttle.log(_LOGGER, logging.DEBUG, "unseen")
    assert throttle.log(_LOGGER, logging.WARNING, "seen")


@pytest.mark.parametrize(
    "text",
    ["a\nb", "a\rb", "\x1b[31mred", "a\u2028b", "a\x85b", "\ud800", "x" * 10_000],
    ids=["newline", "return", "escape", "line-separator", "next-line", "surrogate", "long"],
)
def test_a_peers_text_is_shown_on_one_line_escaped_and_cut(text: str) -> None:
    shown = quoted(text, 64)
    assert shown.isprintable(), shown
    assert len(shown) <= 64 + 2 + 3 * 64  # (quotes; an escape is up to 4 characters)
