"""The one shared mapping from an exception to an HTTP status, JSON body and headers."""

from __future__ import annotations

import json
import logging

import pytest

import tether
import tether.http


class _Rejected(Exception):
    status_code = 422


@pytest.mark.parametrize(
    ("exc", "status", "headers"),
    [
        pytest.param(
            tether.Overloaded(8, retry_after=2.5), 503, {"retry-after": "3"}, id="overloaded"
        ),
        pytest.param(tether.RegistryClosed(), 503, {"retry-after": "1"}, id="registry-closed"),
        pytest.param(tether.RequestTimeout("r", 1.0), 504, {}, id="request-timeout"),
        pytest.param(tether.ConsumerTooSlow("r", 4), 503, {}, id="consumer-too-slow"),
        pytest.param(tether.Aborted("r", tether.AbortReason.SERVER), 503, {}, id="aborted-server"),
        pytest.param(
            tether.Aborted("r", tether.AbortReason.FAILED_SIBLING), 503, {}, id="aborted-sibling"
        ),
        pytest.param(
            tether.Aborted("r", tether.AbortReason.CLIENT_DISCONNECTED),
            tether.http.CLIENT_CLOSED_REQUEST,
            {},
            id="aborted-client",
        ),
        pytest.param(
            tether.Aborted("r", tether.AbortReason.CANCELLED),
            tether.http.CLIENT_CLOSED_REQUEST,
            {},
            id="aborted-cancelled",
        ),
        pytest.param(tether.DuplicateRequest("r"), 409, {}, id="duplicate"),
        pytest.param(tether.UnknownRequest("r"), 404, {}, id="unknown"),
        pytest.param(tether.ProducerError("r", RuntimeError("x")), 500, {}, id="producer"),
        pytest.param(tether.ProducerError("r", _Rejected("too long")), 422, {}, id="producer-4xx"),
        pytest.param(tether.BatchTooLarge(9, 4), 413, {}, id="batch-too-large"),
        pytest.param(tether.InvalidRequestId("\ud800", "bad"), 422, {}, id="invalid-rid"),
    ],
)
def test_every_tether_error_maps_to_its_status_and_json_body(
    exc: tether.TetherError, status: int, headers: dict[str, str]
) -> None:
    response = tether.http.error_response(exc)
    assert response.status == status
    assert response.headers == headers
    assert response.body == {
        "error": {"message": str(exc), "type": type(exc).__name__, "code": status}
    }


def test_a_foreign_exception_is_an_internal_error_without_its_message() -> None:
    response = tether.http.error_response(ValueError("password=hunter2"))
    assert response.status == 500
    assert response.body == {
        "error": {"message": "internal server error", "type": "InternalError", "code": 500}
    }


def test_every_error_is_a_tether_error_with_a_message_naming_the_rid() -> None:
    errors = [
        tether.DuplicateRequest("rid-7"),
        tether.UnknownRequest("rid-7"),
        tether.Aborted("rid-7", tether.AbortReason.TIMEOUT),
        tether.RequestTimeout("rid-7", 2),
        tether.ConsumerTooSlow("rid-7", 3),
        tether.ProducerError("rid-7", RuntimeError("x")),
    ]
    for error in errors:
        assert isinstance(error, tether.TetherError)
        assert "rid-7" in str(error)


class _Unavailable(RuntimeError):
    status_code = 503


@pytest.mark.parametrize(
    "cause",
    [
        pytest.param(RuntimeError("postgres://admin:hunter2@db/prod"), id="plain"),
        pytest.param(_Unavailable("/srv/models/secret.bin missing"), id="5xx-status"),
    ],
)
async def test_a_producer_exception_text_reaches_the_log_never_the_client(
    cause: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    registry = tether.Registry()
    stream = registry.open()
    registry.fail(stream.rid, cause)
    with pytest.raises(tether.ProducerError) as caught:
        await stream.result()
    with caplog.at_level(logging.ERROR, logger="tether"):
        response = tether.http.error_response(caught.value)
    wire = json.dumps(response.body)
    assert str(cause) not in wire
    assert stream.rid in response.body["error"]["message"]
    assert response.status == getattr(cause, "status_code", 500)
    exchange = tether.http.Exchange(registry.open_batch(1), streaming=True, ping_interval=5)
    registry.fail(exchange.source.rids[0], cause)  # type: ignore[union-attr]
    head = await exchange.start()
    assert str(cause).encode() not in head.body
    # ... and the operator still has the detail, with its traceback.
    assert any(record.exc_info and record.exc_info[1] is cause for record in caplog.records)


async def test_a_client_facing_producer_refusal_keeps_its_message() -> None:
    registry = tether.Registry()
    stream = registry.open()
    registry.fail(stream.rid, _Rejected("the prompt is longer than 4096 tokens"))
    with pytest.raises(tether.ProducerError) as caught:
        await stream.result()
    response = tether.http.error_response(caught.value)
    assert response.status == 422
    assert "longer than 4096 tokens" in response.body["error"]["message"]


class _Expected(Exception):
    """A failure its producer expects and logs itself (a lost link's)."""

    status_code = 503
    log_level = logging.DEBUG


class _Loud(Exception):
    log_level = logging.CRITICAL


class _Odd(Exception):
    log_level = "DEBUG"


class _Broken(Exception):
    @property
    def log_level(self) -> int:
        raise RuntimeError("no level")


@pytest.mark.parametrize(
    ("cause", "level"),
    [
        pytest.param(RuntimeError("a producer bug"), logging.ERROR, id="undeclared"),
        pytest.param(_Expected("link lost"), logging.DEBUG, id="declared-lower"),
        pytest.param(_Loud("loud"), logging.ERROR, id="never-above-error"),
        pytest.param(_Odd("odd"), logging.ERROR, id="not-an-int"),
        pytest.param(_Broken("broken"), logging.ERROR, id="raises"),
    ],
)
async def test_a_producer_failure_is_logged_at_error_unless_it_declares_a_lower_level(
    cause: Exception, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    failed = tether.ProducerError("r", cause)  # (what the consumer of a failed request gets)
    with caplog.at_level(logging.DEBUG, logger="tether"):
        response = tether.http.error_response(failed)
    assert response.status >= 500
    [record] = [r for r in caplog.records if r.exc_info and r.exc_info[1] is cause]
    assert record.levelno == level
