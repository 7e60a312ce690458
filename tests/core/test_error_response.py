"""The one shared mapping from an exception to an HTTP status, JSON body and headers."""

from __future__ import annotations

import pytest

import tether


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
            tether.CLIENT_CLOSED_REQUEST,
            {},
            id="aborted-client",
        ),
        pytest.param(
            tether.Aborted("r", tether.AbortReason.CANCELLED),
            tether.CLIENT_CLOSED_REQUEST,
            {},
            id="aborted-cancelled",
        ),
        pytest.param(tether.DuplicateRequest("r"), 409, {}, id="duplicate"),
        pytest.param(tether.UnknownRequest("r"), 404, {}, id="unknown"),
        pytest.param(tether.ProducerError("r", RuntimeError("x")), 500, {}, id="producer"),
        pytest.param(tether.ProducerError("r", _Rejected("too long")), 422, {}, id="producer-4xx"),
    ],
)
def test_every_tether_error_maps_to_its_status_and_json_body(
    exc: tether.TetherError, status: int, headers: dict[str, str]
) -> None:
    response = tether.error_response(exc)
    assert response.status == status
    assert response.headers == headers
    assert response.body == {
        "error": {"message": str(exc), "type": type(exc).__name__, "code": status}
    }


def test_a_foreign_exception_is_an_internal_error_without_its_message() -> None:
    response = tether.error_response(ValueError("password=hunter2"))
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
