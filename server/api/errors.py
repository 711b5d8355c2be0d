"""What the API answers besides success, and how the OpenAPI document says so.

* Ids in paths and queries are bounded to the database's integer range (``MAX_ID``, a
  32-bit ``INTEGER`` on PostgreSQL): a larger one is a 422 naming it, never a database
  error. Event ids are 64-bit (``MAX_EVENT_ID``).
* :func:`document_errors` adds each route's error answers to the OpenAPI document, with
  their bodies' schemas, from what the route is: 401 when it authenticates, 403 when only
  the admin may call it, 404 when it names a resource by id or name, 400 when it reads a
  body, 413 and 415 when it takes one (``server/api/limits.py``), 503 when it reads the database (any route may
  find it down). 409 and the other route-specific answers are in the routes' own
  ``responses``; 422 is FastAPI's, for routes with parameters.
* :func:`method_not_allowed`: a 405's ``Allow`` lists every method of the path, not only
  those of the first route that matched it.
* :func:`answer_refusals`: the one mapping of the service's refusals (``server/errors.py``)
  to HTTP: NotFound 404, Conflict 409, Invalid 422 (``loc`` names the field), Unavailable 503,
  Forbidden 403 and TooLarge 413 (their messages name the permission or the setting).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import FastAPI, Path, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import compile_path

from fusetune.server.errors import Conflict, Forbidden, Invalid, NotFound, TooLarge, Unavailable
from fusetune.server.params import DECIMAL

#: A route's documented answers by status, as FastAPI's ``responses`` takes them.
Answers = dict[int | str, dict[str, Any]]

#: Largest id of fusetune's tables (PostgreSQL's INTEGER; SQLite's are wider).
MAX_ID = 2**31 - 1
#: Largest event id (ft_events.id is a BIGINT).
MAX_EVENT_ID = 2**63 - 1

StudyId = Annotated[int, Path(ge=1, le=MAX_ID, description="A study's id."), DECIMAL]
TrialId = Annotated[int, Path(ge=1, le=MAX_ID, description="A trial's id (fusetune's, not Optuna's)."), DECIMAL]
TokenId = Annotated[int, Path(ge=1, le=MAX_ID, description="A token's id."), DECIMAL]


class ErrorMessage(BaseModel):
    """An error that names no field."""

    detail: str


class FieldError(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class FieldErrors(BaseModel):
    """An error naming the field it is about (``loc``): ``["body", "name"]``, ``["tenant", "max_running_studies"]``."""

    detail: list[FieldError]


def _error(description: str, model: type[BaseModel] = ErrorMessage, **extra: Any) -> dict[str, Any]:
    return {"model": model, "description": description, **extra}


UNAUTHORIZED: Answers = {
    401: _error(
        "No bearer token, or one that is unknown or revoked.",
        headers={"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer"}},
    )
}
FORBIDDEN: Answers = {403: _error("Only the admin may do this.")}
#: A tenant without the admin's grant of code upload (``code_upload``), on the routes of code.
CODE_FORBIDDEN: Answers = {403: _error("The tenant may not upload or run code: the admin grants `code_upload`.")}
NOT_FOUND: Answers = {404: _error("No such resource, or another tenant's.")}
CONFLICT: Answers = {409: _error("The request clashes with the state of the service; `loc` names the field.", FieldErrors)}
MALFORMED: Answers = {400: _error("The body cannot be read (not UTF-8, a broken chunked encoding).")}
TOO_LARGE: Answers = {413: _error("The body is larger than FUSETUNE_MAX_BODY_BYTES.")}
NOT_JSON: Answers = {415: _error("The body is not JSON (Content-Type: application/json).")}
UNAVAILABLE: Answers = {503: _error("The database is unreachable, or the scheduling loop does not run.")}

_WRITES = {"POST", "PUT", "PATCH", "DELETE"}
#: A path parameter's Starlette convertor (``{key:text}``), which the OpenAPI document leaves out.
_CONVERTOR = re.compile(r"\{(\w+):\w+\}")


def route_table(app: FastAPI) -> Iterator[tuple[str, set[str], Any]]:
    """(path, methods, route) of every route with methods, routers included."""
    try:  # FastAPI >= 0.16x keeps included routers nested in app.routes
        from fastapi.routing import iter_route_contexts

        for context in iter_route_contexts(app.routes):
            methods = getattr(context.original_route, "methods", None)
            if context.path is not None and methods:
                yield context.path, set(methods), context.original_route
    except ImportError:
        for route in app.routes:
            methods = getattr(route, "methods", None)
            path = getattr(route, "path", None)
            if path is not None and methods:
                yield path, set(methods), route


def _depends_on(route: APIRoute, names: set[str]) -> set[str]:
    found: set[str] = set()
    stack = [route.dependant]
    while stack:
        dependant = stack.pop()
        name = getattr(getattr(dependant, "call", None), "__name__", None)
        if name in names:
            found.add(name)
        stack.extend(dependant.dependencies)
    return found


def _responses_of(route: APIRoute, methods: set[str]) -> dict[int | str, Any]:
    out: dict[int | str, Any] = {}
    deps = _depends_on(route, {"authenticate", "require_admin", "get_session"})
    if "authenticate" in deps:
        out.update(UNAUTHORIZED)
    if "require_admin" in deps:
        out.update(FORBIDDEN)
    named = {p.name for p in route.dependant.path_params} | {p.name for p in route.dependant.query_params if p.name == "study_id"}
    if named:
        out.update(NOT_FOUND)
    if route.body_field is not None:
        out.update(MALFORMED)
    if methods & _WRITES:
        out.update(TOO_LARGE)
        out.update(NOT_JSON)
    if deps & {"get_session", "authenticate"}:  # both read the database
        out.update(UNAVAILABLE)
    return out


def document_errors(app: FastAPI) -> None:
    """Make ``app.openapi()`` list every answer of every route (see the module's docstring)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = generate()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (ErrorMessage, FieldErrors):
            found = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(found.pop("$defs", {}))
            schemas[model.__name__] = found
        for template, methods, route in route_table(app):
            path = _CONVERTOR.sub(r"{\1}", template)  # the document's path: `{key:text}` is `{key}` there
            if not isinstance(route, APIRoute) or not route.include_in_schema or path not in doc["paths"]:
                continue
            for method in methods:
                operation = doc["paths"][path].get(method.lower())
                if operation is None:
                    continue
                answers = operation.setdefault("responses", {})
                for code, spec in _responses_of(route, methods).items():
                    if str(code) in answers:
                        continue  # the route's own description wins
                    answer = {
                        "description": spec["description"],
                        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{spec['model'].__name__}"}}},
                    }
                    if "headers" in spec:
                        answer["headers"] = spec["headers"]
                    answers[str(code)] = answer
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


_compiled: dict[str, re.Pattern[str]] = {}


def allowed_methods(app: FastAPI, path: str) -> set[str]:
    """Every method some route serves at ``path``."""
    allowed: set[str] = set()
    for template, methods, _ in route_table(app):
        pattern = _compiled.get(template)
        if pattern is None:
            pattern = _compiled[template] = compile_path(template)[0]
        if pattern.match(path):
            allowed |= methods
    return allowed


async def method_not_allowed(request: Request, exc: StarletteHTTPException) -> Response:
    """405 with an ``Allow`` of every method of the path; other HTTP errors as FastAPI answers them."""
    if exc.status_code != 405:
        return await http_exception_handler(request, exc)
    allowed = allowed_methods(request.app, request.url.path)
    return JSONResponse({"detail": "Method Not Allowed"}, status_code=405, headers={"Allow": ", ".join(sorted(allowed))})


def answer_refusals(app: FastAPI) -> None:
    """Map the service's refusals to their answers on ``app``: the one place they become HTTP."""

    async def not_found(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": str(exc)})

    async def conflict(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, Conflict)
        detail = [{"loc": [exc.where, exc.field], "msg": str(exc), "type": "conflict"}]
        return JSONResponse(status_code=409, content={"detail": detail})

    async def unavailable(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=503, content={"detail": str(exc)}, headers={"Retry-After": "1"})

    async def invalid(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, Invalid)
        detail = [{"loc": exc.loc, "msg": str(exc), "type": "value_error"}]
        return JSONResponse(status_code=422, content={"detail": detail})

    async def forbidden(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=403, content={"detail": str(exc)})

    async def too_large(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=413, content={"detail": str(exc)})

    for refusal, answer in (
        (NotFound, not_found), (Conflict, conflict), (Unavailable, unavailable), (Invalid, invalid),
        (Forbidden, forbidden), (TooLarge, too_large),
    ):
        app.add_exception_handler(refusal, answer)
