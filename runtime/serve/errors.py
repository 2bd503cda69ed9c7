"""Request errors and their one wire shape (OpenAI's), shared by every HTTP route (and usable by gRPC for messages).

A refused request raises ``RequestError(message, param=..., status=...)``; the HTTP layer answers ``status`` with::

    {"error": {"message": "max_tokens: 5000 > the limit 1024", "type": "invalid_request_error",
               "param": "max_tokens", "code": null}}

Statuses (see openai_api.py for which input gets which): 400 bad or unsupported input, 401 no/bad bearer token,
404 unknown route or model, 405 wrong method, 408 request_timeout_s passed, 413 body too large, 503 over capacity
(admission) or the verifier not running, 500 the target failed.
"""

from __future__ import annotations

from http import HTTPStatus

# OpenAI's error "type" by status; anything else is a server error
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


class RequestError(ValueError):
    """A request the ingress refuses; the message names the field or limit.

    Args:
        message: what is wrong, starting with the field when there is one ("messages[0].content: ...").
        param: the field (OpenAI's ``param``), dotted with [i] indices, or None.
        status: the HTTP status (400 unless said otherwise).
        code: OpenAI's machine-readable ``code`` ("model_not_found", "invalid_api_key", ...), or None.
    """

    status = 400

    def __init__(self, message: str, param: str | None = None, status: int | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code
        if status is not None:
            self.status = status


def error_body(message: str, status: int, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` (OpenAI's error object)."""
    if type_ is None:
        type_ = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": str(message)[:2000], "type": type_, "param": param, "code": code}}


def error_record(exc: BaseException, status: int | None = None) -> dict:
    """The error body of an exception: a RequestError keeps its status/param/code; anything else is a server error
    whose message says what failed (e.g. the verifier's "target failed: ...")."""
    if isinstance(exc, RequestError):
        return error_body(str(exc), status or exc.status, exc.param, exc.code)
    status = status or 500
    text = str(exc) or type(exc).__name__
    return error_body(text, status, code=HTTPStatus(status).phrase.lower().replace(" ", "_"))
