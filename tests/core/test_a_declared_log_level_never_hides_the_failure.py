"""A producer's 5xx cause may lower its line's level, never hide it (Invariant 10,
"nothing escapes silently"): a declared ``log_level`` below DEBUG still leaves a line
an operator can see by turning DEBUG on, and a ``log_level`` that misbehaves when
compared is ERROR, never an exception out of ``error_response``."""

from __future__ import annotations

import logging

import pytest

import tether
from tether.http import error_response


class Quiet(Exception):
    log_level = -(10**9)


class Odd(int):
    def __lt__(self, other: object) -> bool:
        raise RuntimeError("no order")

    __gt__ = __le__ = __ge__ = __lt__


class Hostile(Exception):
    log_level = Odd(5)


def test_a_level_below_debug_is_still_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tether")
    answer = error_response(tether.ProducerError("r1", Quiet("engine lost")))
    assert answer.status == 500
    assert [r for r in caplog.records if r.exc_info and r.exc_info[1].__class__ is Quiet]


def test_a_level_that_cannot_be_compared_logs_at_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="tether")
    answer = error_response(tether.ProducerError("r2", Hostile("boom")))
    assert answer.status == 500
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
