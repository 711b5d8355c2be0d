"""The service layer of tenants and their tokens, independent of HTTP.

Creating tenants and changing their weights, quotas and ``code_upload`` (whether the tenant may
upload code packages, ``server/packages.py``) is the admin's (the routes check);
a tenant's tokens are the admin's and the tenant's own. Functions that touch one tenant's
tokens take ``as_tenant`` like those in :mod:`fusetune.server.service`: another tenant's are
NotFound, as if they did not exist.

A token a tenant's bearer mints records the token that minted it (``ft_tokens.minted_by``),
and revoking a token revokes every token minted from it, transitively: whoever holds a
leaked token cannot keep access by minting spares before it is revoked. A tenant holds at
most ``FUSETUNE_MAX_TOKENS_PER_TENANT`` live tokens. Mints and revocations of one tenant run
one at a time (:func:`fusetune.server.quotas.lock_tenant`), so a token revoked while it
mints either mints before (and its spare is revoked with it) or is refused after.
"""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fusetune.server.auth import TokenRevoked, hash_token, new_token
from fusetune.server.db import Study, StudyState, Tenant, Token, utcnow
from fusetune.server.errors import Conflict, NotFound
from fusetune.server.pagination import NAME_CURSOR, Page, PageParams
from fusetune.server.quotas import lock_tenant
from fusetune.server.reads import id_page, keyset_page
from fusetune.server.schemas import TenantCreate, TenantCreated, TenantOut, TenantUpdate, TokenCreated, TokenOut


def list_tenants(session: Session, *, page: PageParams = PageParams(), as_tenant: str | None = None) -> Page[TenantOut]:
    """A page of tenants by name: every tenant for the admin; a tenant sees itself only."""
    query = select(Tenant)
    if as_tenant is not None:
        query = query.where(Tenant.name == as_tenant)
    after = (NAME_CURSOR.decode(page.after),) if page.after else None
    rows, more = keyset_page(session, query, (Tenant.name,), False, after, page.limit)
    return Page([TenantOut.model_validate(t) for t in rows], NAME_CURSOR.encode(rows[-1].name) if more else None)


def create_tenant(session: Session, request: TenantCreate) -> TenantCreated:
    """A new tenant and its first token (the only time the token is shown)."""
    if session.get(Tenant, request.name) is not None:
        raise Conflict("name", f"a tenant named {request.name!r} already exists")
    tenant = Tenant(
        name=request.name,
        weight=request.weight,
        max_running_studies=request.max_running_studies,
        max_trials_per_study=request.max_trials_per_study,
        code_upload=request.code_upload,
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
    """Change a tenant's weight, quotas or ``code_upload``; the scheduler uses the weight from its next round.

    A quota may not be set below what the tenant runs now: Conflict naming the quota.
    """
    tenant = lock_tenant(session, name)  # study creation checks quotas under this lock
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
        largest = session.scalar(select(func.max(Study.n_trials)).where(Study.tenant == name, Study.state == StudyState.RUNNING))
        if largest is not None and largest > limit:
            raise Conflict(
                "max_trials_per_study",
                f"tenant {name!r} runs a study of {largest} trials now; max_trials_per_study={limit} is below that",
            )
    for field, value in changes.items():
        setattr(tenant, field, value)
    session.commit()
    return TenantOut.model_validate(tenant)


def create_token(
    session: Session,
    tenant: str,
    label: str | None = None,
    *,
    as_tenant: str | None = None,
    minted_by: int | None = None,
    max_live: int | None = None,
) -> TokenCreated:
    """Another token for ``tenant``; the tenant's other tokens stay valid.

    ``minted_by``: the id of the token whose bearer asks (None: the admin's or the operator's
    request); the new token records it, and dies with it. ``max_live``: most live tokens the
    tenant may hold (``FUSETUNE_MAX_TOKENS_PER_TENANT``; None: no cap, the operator's CLI).

    Raises:
        NotFound: no such tenant, or another tenant's.
        TokenRevoked: the token ``minted_by`` was revoked since the request was authenticated.
        Conflict: naming ``max_tokens_per_tenant`` when the tenant holds ``max_live`` live tokens.
    """
    _tenant(session, tenant, as_tenant)
    lock_tenant(session, tenant)  # a revocation of the minting token runs before this or after
    if minted_by is not None and session.scalar(select(Token.revoked_at).where(Token.id == minted_by)) is not None:
        raise TokenRevoked(f"token {minted_by} was revoked")
    if max_live is not None:
        live = session.scalar(select(func.count()).where(Token.tenant == tenant, Token.revoked_at.is_(None)))
        if (live or 0) >= max_live:
            raise Conflict(
                "max_tokens_per_tenant",
                f"tenant {tenant!r} holds {live} live tokens, the most FUSETUNE_MAX_TOKENS_PER_TENANT={max_live} "
                "allows; revoke one first",
                where="tenant",
            )
    return _issue(session, tenant, label, minted_by)


def list_tokens(
    session: Session, tenant: str, *, page: PageParams = PageParams(), as_tenant: str | None = None
) -> Page[TokenOut]:
    """A page of a tenant's tokens by id, revoked ones too (never the tokens themselves: only their hashes are kept)."""
    _tenant(session, tenant, as_tenant)
    found = id_page(session, select(Token).where(Token.tenant == tenant), Token.id, "id", page)
    return Page([TokenOut.model_validate(t) for t in found.items], found.next)


def revoke_token(session: Session, token_id: int, *, as_tenant: str | None = None) -> TokenOut:
    """Revoke a token and every token minted from it, transitively: none of them authenticates
    anything from now on. Revoking it again changes nothing (its spares are revoked already)."""
    token = session.get(Token, token_id)
    if token is None or (as_tenant is not None and token.tenant != as_tenant):
        raise NotFound(f"token {token_id} does not exist")
    lock_tenant(session, token.tenant)  # no mint of the tenant runs meanwhile (create_token)
    # Read after the lock, in a statement of its own: every token minted before it is in it.
    lineage = select(Token.id).where(Token.id == token.id).cte("lineage", recursive=True)
    lineage = lineage.union(select(Token.id).where(Token.minted_by == lineage.c.id))
    session.execute(
        update(Token).where(Token.id.in_(select(lineage.c.id)), Token.revoked_at.is_(None)).values(revoked_at=utcnow()),
        execution_options={"synchronize_session": False},
    )
    session.commit()
    session.refresh(token)
    return TokenOut.model_validate(token)


def _tenant(session: Session, name: str, as_tenant: str | None) -> Tenant:
    tenant = session.get(Tenant, name) if as_tenant is None or name == as_tenant else None
    if tenant is None:
        raise NotFound(f"tenant {name!r} does not exist")
    return tenant


def _issue(session: Session, tenant: str, label: str | None, minted_by: int | None = None) -> TokenCreated:
    token = new_token()
    row = Token(tenant=tenant, token_hash=hash_token(token), label=label, minted_by=minted_by)
    session.add(row)
    session.commit()
    return TokenCreated(**TokenOut.model_validate(row).model_dump(), token=token)
