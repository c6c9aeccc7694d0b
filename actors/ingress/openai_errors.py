"""OpenAI's errors in terms of the client API's (no I/O): an HTTP status and
`{"error": {"message", "type", "param", "code"}}`, from the client API's `ApiError` or the error
body of its reply, and the API key a request's `Authorization` header carries."""

from __future__ import annotations

from typing import Any

from pensieve.actors.wire.schemas import ApiError

# OpenAI's status and error type for each error code of the client API
_ERRORS = {
    "invalid_request": (400, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "conflict": (409, "invalid_request_error"),
    "too_long": (400, "invalid_request_error"),
    "overloaded": (429, "rate_limit_error"),
    "cancelled": (499, "invalid_request_error"),
    "unavailable": (503, "server_error"),
    "internal": (500, "server_error"),
}


class OpenAIError(Exception):
    """An error as OpenAI answers it: an HTTP status and `{"error": {...}}`."""

    def __init__(
        self, status: int, message: str, kind: str, code: str | None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", "invalid_request", param)


def from_api_error(error: ApiError) -> OpenAIError:
    status, kind = _ERRORS[error.code]
    code = "context_length_exceeded" if error.code == "too_long" else error.code
    return OpenAIError(status, error.message, kind, code, error.param)


def from_reply_error(body: dict[str, Any]) -> OpenAIError:
    """The `{"error": {"code", "message"}}` of a client API reply, as OpenAI's."""
    error = body.get("error") or {}
    code = error.get("code")
    if code not in _ERRORS:
        return OpenAIError(500, str(error.get("message", body)), "server_error", "internal")
    param = error.get("param")
    return from_api_error(
        ApiError(code, str(error.get("message", "")), param if isinstance(param, str) else None)
    )


def unauthorized(message: str) -> OpenAIError:
    return OpenAIError(401, message, "invalid_request_error", "invalid_api_key")


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (None: no header)."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthorized("the Authorization header must be 'Bearer <API key>'")
    return token.strip()
