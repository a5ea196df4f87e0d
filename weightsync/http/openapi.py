"""The OpenAPI schema as the app really behaves: OpenAI's error body on every error status, no 422
(validation errors are 400), the bearer scheme on the routes the auth middleware protects, and the
401 / 413 / 408 the middleware answers before a route runs (FastAPI cannot see those)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from weightsync.http.errors import ErrorBody

_ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
_METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_REF}}}


def _fix_operation(op: dict, protected: bool) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    if "requestBody" in op:
        responses.setdefault("400", _error("invalid request: the message names the field"))
        responses.setdefault("413", _error("request body over the size limit (refused before it is read)"))
        responses.setdefault("408", _error("the request body did not arrive within the body deadline"))
    if protected:
        responses.setdefault("401", _error("missing or wrong bearer token"))
        op["security"] = [{"bearer": []}]
    for code, resp in responses.items():
        if code.isdigit() and int(code) >= 400:
            resp.setdefault("content", {})["application/json"] = {"schema": _ERROR_REF}


def install_openapi(app: FastAPI, protected: Callable[[str], bool], token_required: bool) -> None:
    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        err = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in err.pop("$defs", {}).items():
            schemas.setdefault(name, sub)
        schemas["ErrorBody"] = err
        if token_required:
            schema["components"]["securitySchemes"] = {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the service's token (auth_token / auth_token_file); openai clients: api_key",
                }
            }
        for path, item in schema.get("paths", {}).items():
            for method in _METHODS:
                if method in item:
                    _fix_operation(item[method], token_required and protected(path))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
