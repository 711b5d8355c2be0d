"""What the service refuses, as exceptions that know nothing of HTTP.

The service layer, the scheduling loop and the tenants' functions raise these; the API maps
each to one answer at its edge (``server/api/errors.py``): NotFound 404, Conflict 409,
Invalid 422, Unavailable 503, Forbidden 403, TooLarge 413. This module imports nothing of the server, so every module
may raise them without an import cycle.
"""

from __future__ import annotations

__all__ = ["Conflict", "Forbidden", "Invalid", "NotFound", "TooLarge", "Unavailable"]


class NotFound(LookupError):
    """The named resource does not exist (or is another tenant's: the same message, so ids leak nothing)."""


class Conflict(ValueError):
    """The request clashes with existing state; ``field`` names the clashing field.

    ``where`` is the first part of the error's ``loc``: ``body`` for a field of the request,
    ``tenant`` for a quota of the caller's tenant.
    """

    def __init__(self, field: str, message: str, *, where: str = "body") -> None:
        super().__init__(message)
        self.field = field
        self.where = where


class Unavailable(RuntimeError):
    """The service cannot do this now (a 503): its scheduling loop is not running, or is busy."""


class Invalid(ValueError):
    """Bad input that only the service can tell (it takes the database or the settings): a 422
    whose ``loc`` is ``[where, field]``, or ``[where, *field]`` for a tuple (a field inside a
    field: ``("fusetune.json", "workload", "metrics", 0)``)."""

    def __init__(self, field: str | tuple[str | int, ...], message: str, *, where: str = "body") -> None:
        super().__init__(message)
        self.field = field
        self.where = where

    @property
    def loc(self) -> list[str | int]:
        return [self.where, *self.field] if isinstance(self.field, tuple) else [self.where, self.field]


class Forbidden(PermissionError):
    """The caller's tenant lacks a permission the admin grants (a 403 naming ``permission``)."""

    def __init__(self, permission: str, message: str) -> None:
        super().__init__(message)
        self.permission = permission


class TooLarge(ValueError):
    """Input over a limit the operator sets (a 413 naming ``setting``, e.g. ``FUSETUNE_PACKAGE_MAX_FILES``)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting
