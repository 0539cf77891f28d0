"""The server's errors: OpenAI's error body, with the HTTP status and headers to send it with."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 invalid_request_error."""
    return ApiError(400, message, param=param, code=code)


def cancelled_error() -> ApiError:
    # 499: nginx's "client closed request"; nobody reads it, but it ends the request's handler.
    return ApiError(499, "the client went away", type="cancelled", code="client_closed")


def timeout_error() -> ApiError:
    return ApiError(
        504, "the request timed out (--request-timeout)", type="timeout", code="timeout"
    )


#: A 503 says when to come back: a router retries another replica now, a client in a second.
UNAVAILABLE_RETRY_AFTER_S = 1


def unavailable_error(message: str, code: str) -> ApiError:
    return ApiError(
        503,
        message,
        type="server_error",
        code=code,
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
    )
