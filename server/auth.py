"""Who a request acts for: bearer tokens, their hashes, and the admin.

Every tenant has bearer tokens. A token is ``secrets.token_urlsafe(32)`` (256 random bits)
with an ``ft_`` prefix; the database keeps only its SHA-256 (``ft_tokens.token_hash``), and
the token itself is shown once, in the answer that creates it. A request's token is hashed
and looked up by that hash, so no stored secret is ever compared byte by byte. The admin's
token is the ``FUSETUNE_ADMIN_TOKEN`` setting; it is compared with
``secrets.compare_digest``.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from fusetune.server.db import Token

#: Every token fusetune issues starts with this, so a leaked one is easy to recognise.
TOKEN_PREFIX = "ft_"


class TokenRevoked(PermissionError):
    """The token a request was authenticated with has been revoked since (a 401)."""


@dataclass(frozen=True)
class Principal:
    """Who a request acts for: one tenant, or the admin (``tenant`` None)."""

    tenant: str | None
    token_id: int | None = None

    @property
    def is_admin(self) -> bool:
        return self.tenant is None


ADMIN = Principal(tenant=None)


def new_token() -> str:
    """A fresh bearer token (256 random bits, URL-safe)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """The SHA-256 of ``token``, hex: what ``ft_tokens`` stores and looks tokens up by."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def principal_for(session: Session, token: str, admin_token: str | None) -> Principal | None:
    """The principal ``token`` authenticates, or None if it is unknown or revoked."""
    digest = hash_token(token)
    if admin_token is not None and secrets.compare_digest(digest, hash_token(admin_token)):
        return ADMIN
    row = session.execute(
        select(Token.id, Token.tenant).where(Token.token_hash == digest, Token.revoked_at.is_(None))
    ).first()
    if row is None:
        return None
    return Principal(tenant=row.tenant, token_id=row.id)
