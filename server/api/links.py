"""The OpenAPI links of the API's answers: which field of an answer names which operation's
parameter, stated exactly (a study's ``id`` is every study route's ``study_id``, a trial row's
``id`` every trial route's ``trial_id``, ...).

A client, and Schemathesis' stateful phase, follow these from one call to the next. Only
fields that always hold an id are linked: a list's first row (``/0/id``, absent on an empty
page, where a follower picks its own value), never a nullable field such as an idle device's
``study_id``, which a link would turn into ``/studies/None``.

A route states them in its ``responses`` (``{201: {"links": links(study="$response.body#/id")}}``),
merged with its others by :func:`answers`.
"""

from __future__ import annotations

from typing import Any

_STUDY = "/api/v1/studies/{study_id}"
_TRIAL = "/api/v1/trials/{trial_id}"
_TENANT = "/api/v1/tenants/{name}"

#: Each kind of id, the operations it is a parameter of: (link name, method, path, parameter).
TARGETS: dict[str, list[tuple[str, str, str, str]]] = {
    "study": [
        ("GetStudy", "get", _STUDY, "path.study_id"),
        ("UpdateStudy", "patch", _STUDY, "path.study_id"),
        ("DeleteStudy", "delete", _STUDY, "path.study_id"),
        ("ListTrials", "get", f"{_STUDY}/trials", "path.study_id"),
        ("EnqueueTrial", "post", f"{_STUDY}/trials", "path.study_id"),
        ("SetUserAttr", "put", f"{_STUDY}/user_attrs/{{key}}", "path.study_id"),
        ("PauseStudy", "post", f"{_STUDY}/pause", "path.study_id"),
        ("ResumeStudy", "post", f"{_STUDY}/resume", "path.study_id"),
        ("CancelStudy", "post", f"{_STUDY}/cancel", "path.study_id"),
        ("StudyEvents", "get", f"{_STUDY}/events", "path.study_id"),
        ("Importances", "get", f"{_STUDY}/importances", "path.study_id"),
        ("Timeline", "get", f"{_STUDY}/timeline", "path.study_id"),
        ("ListArrays", "get", "/api/v1/arrays", "query.study_id"),
    ],
    "trial": [
        ("GetTrial", "get", _TRIAL, "path.trial_id"),
        ("DownloadStateDict", "get", f"{_TRIAL}/state_dict", "path.trial_id"),
        ("DecidePruning", "post", f"{_TRIAL}/pruning", "path.trial_id"),
    ],
    "tenant": [
        ("UpdateTenant", "patch", _TENANT, "path.name"),
        ("ListTokens", "get", f"{_TENANT}/tokens", "path.name"),
        ("CreateToken", "post", f"{_TENANT}/tokens", "path.name"),
    ],
    "token": [("RevokeToken", "delete", "/api/v1/tokens/{token_id}", "path.token_id")],
    "package": [
        ("HasPackage", "head", "/api/v1/packages/{digest}", "path.digest"),
        ("DownloadPackage", "get", "/api/v1/packages/{digest}", "path.digest"),
    ],
}


def _operation_ref(method: str, path: str) -> str:
    """A JSON pointer to the operation in this document (RFC 6901 escapes ``~`` and ``/``)."""
    return "#/paths/" + path.replace("~", "~0").replace("/", "~1") + "/" + method


def links(**expressions: str) -> dict[str, Any]:
    """The links from an answer whose ids are at these runtime expressions, by kind:
    ``links(study="$response.body#/id")`` links every study operation."""
    out: dict[str, Any] = {}
    for kind, expression in expressions.items():
        for name, method, path, parameter in TARGETS[kind]:
            out[name] = {"operationRef": _operation_ref(method, path), "parameters": {parameter: expression}}
    return out


def answers(*responses: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """A route's ``responses`` from several, merged status by status (``{201: {"links": ...}}``
    beside ``CONFLICT``'s 409, a list's 200 headers beside its 200 links)."""
    out: dict[Any, dict[str, Any]] = {}
    for given in responses:
        for status, answer in given.items():
            out[status] = {**out.get(status, {}), **answer}
    return out
