"""The service layer of tenants and their tokens, independent of HTTP.

Creating tenants and changing their weights and quotas is the admin's (the routes check);
a tenant's tokens are the admin's and the tenant's own. Functions that touch one tenant's
tokens take ``as_tenant`` like those in :mod:`fusetune.server.service`: another tenant's are
NotFound, as if they did not exist.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fusetune.server.auth import hash_token, new_token
from fusetune.server.db import Study, StudyState, Tenant, Token, utcnow
from fusetune.server.schemas import TenantCreate, TenantCreated, TenantOut, TenantUpdate, TokenCreated, TokenOut
from fusetune.server.pagination import Page, PageParams, decode_cursor, encode_cursor
from fusetune.server.reads import id_page, keyset_page
from fusetune.server.service import Conflict, NotFound


def list_tenants(session: Session, *, page: PageParams = PageParams(), as_tenant: str | None = None) -> Page[TenantOut]:
    """A page of tenants by name: every tenant for the admin; a tenant sees itself only."""
    query = select(Tenant)
    if as_tenant is not None:
        query = query.where(Tenant.name == as_tenant)
    after = decode_cursor(page.after, "name", (str,)) if page.after else None
    rows, more = keyset_page(session, query, (Tenant.name,), False, after, page.limit)
    return Page([TenantOut.model_validate(t) for t in rows], encode_cursor("name", [rows[-1].name]) if more else None)


def create_tenant(session: Session, request: TenantCreate) -> TenantCreated:
    """A new tenant and its first token (the only time the token is shown)."""
    if session.get(Tenant, request.name) is not None:
        raise Conflict("name", f"a tenant named {request.name!r} already exists")
    tenant = Tenant(
        name=request.name,
        weight=request.weight,
        max_running_studies=request.max_running_studies,
        max_trials_per_study=request.max_trials_per_study,
    )
    session.add(tenant)
    try:
        session.flush()  # a concurrent create of the same name fails here, not at the token
    except IntegrityError as exc:
        session.rollback()
        raise Conflict("name", f"a tenant named {request.name!r} already exists") from exc
    token = _issue(session, tenant.name, request.token_label)
    return TenantCreated(tenant=TenantOut.model_validate(tenant), token=token)


def update_tenant(session: Session, name: str, update: TenantUpdate) -> TenantOut:
    """Change a tenant's weight or quotas; the scheduler uses the weight from its next round.

    A quota may not be set below what the tenant runs now: Conflict naming the quota.
    """
    tenant = session.get(Tenant, name, with_for_update=True)  # study creation checks quotas under this lock
    if tenant is None:
        raise NotFound(f"tenant {name!r} does not exist")
    changes = update.changes()
    running = select(Study).where(Study.tenant == name, Study.state == StudyState.RUNNING)
    limit = changes.get("max_running_studies")
    if limit is not None:
        count = session.scalar(select(func.count()).select_from(running.subquery()))
        if count > limit:
            raise Conflict(
                "max_running_studies",
                f"tenant {name!r} runs {count} studies now; max_running_studies={limit} is below that",
            )
    limit = changes.get("max_trials_per_study")
    if limit is not None:
        largest = session.scalar(select(func.max(Study.n_trials)).where(running.whereclause))
        if largest is not None and largest > limit:
            raise Conflict(
                "max_trials_per_study",
                f"tenant {name!r} runs a study of {largest} trials now; max_trials_per_study={limit} is below that",
            )
    for field, value in changes.items():
        setattr(tenant, field, value)
    session.commit()
    return TenantOut.model_validate(tenant)


def create_token(session: Session, tenant: str, label: str | None = None, *, as_tenant: str | None = None) -> TokenCreated:
    """Another token for ``tenant``; the tenant's other tokens stay valid."""
    _tenant(session, tenant, as_tenant)
    return _issue(session, tenant, label)


def list_tokens(
    session: Session, tenant: str, *, page: PageParams = PageParams(), as_tenant: str | None = None
) -> Page[TokenOut]:
    """A page of a tenant's tokens by id, revoked ones too (never the tokens themselves: only their hashes are kept)."""
    _tenant(session, tenant, as_tenant)
    found = id_page(session, select(Token).where(Token.tenant == tenant), Token.id, "id", page)
    return Page([TokenOut.model_validate(t) for t in found.items], found.next)


def revoke_token(session: Session, token_id: int, *, as_tenant: str | None = None) -> TokenOut:
    """Revoke a token: it authenticates nothing from now on. Revoking it again changes nothing."""
    token = session.get(Token, token_id)
    if token is None or (as_tenant is not None and token.tenant != as_tenant):
        raise NotFound(f"token {token_id} does not exist")
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        session.commit()
    return TokenOut.model_validate(token)


def _tenant(session: Session, name: str, as_tenant: str | None) -> Tenant:
    tenant = session.get(Tenant, name) if as_tenant is None or name == as_tenant else None
    if tenant is None:
        raise NotFound(f"tenant {name!r} does not exist")
    return tenant


def _issue(session: Session, tenant: str, label: str | None) -> TokenCreated:
    token = new_token()
    row = Token(tenant=tenant, token_hash=hash_token(token), label=label)
    session.add(row)
    session.commit()
    return TokenCreated(**TokenOut.model_validate(row).model_dump(), token=token)
