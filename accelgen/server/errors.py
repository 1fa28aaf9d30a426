"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, for ours, for bodies that fail
validation and for bugs."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


def add_error_handlers(app: FastAPI) -> None:
    """Every error answered in OpenAI's shape: ours, a body that fails validation, and a bug."""

    @app.exception_handler(APIError)
    async def api_error(_request, error: APIError):
        return error_response(error.status, error.message, error.kind, error.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, error: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in error.errors())
        return error_response(400, f"invalid request: {problems}")

    @app.exception_handler(HTTPException)
    async def http_error(_request, error: HTTPException):  # routing's own: no such path (404), method (405)
        response = error_response(error.status_code, str(error.detail))
        response.headers.update(error.headers or {})  # e.g. 405's Allow
        return response

    @app.exception_handler(Exception)
    async def bug(_request, error: Exception):  # still a bug, logged with its traceback; the client gets JSON
        return error_response(500, f"internal error: {type(error).__name__}", "server_error")
