"""REST routes of tenants and their tokens, ``/api/v1``.

Creating a tenant and changing its weight or quotas are admin routes (403 for a tenant's
token). A tenant's tokens are its own and the admin's: another tenant's answer 404. A token
minted with a tenant's token dies with it (``server/tenants.py``); a tenant holds at most
``FUSETUNE_MAX_TOKENS_PER_TENANT`` live tokens.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Path, Request, Response, status

from fusetune.server import tenants
from fusetune.server.api.deps import PrincipalDep, SessionDep, SessionRoute, SettingsDep, authenticate, require_admin
from fusetune.server.api.errors import CONFLICT, TokenId
from fusetune.server.api.links import answers, links
from fusetune.server.auth import TokenRevoked
from fusetune.server.pagination import ID_CURSOR, LINK_HEADER, NAME_CURSOR, PageParams, page_params, paged
from fusetune.server.schemas import TenantCreate, TenantCreated, TenantOut, TenantUpdate, TokenCreate, TokenCreated, TokenOut

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)], route_class=SessionRoute)

TenantName = Path(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # as TenantCreate.name


@router.get(
    "/tenants", response_model=list[TenantOut], tags=["tenants"],
    responses={200: {"headers": LINK_HEADER, "links": links(tenant="$response.body#/0/name")}},
)
def list_tenants(
    principal: PrincipalDep,
    session: SessionDep,
    request: Request,
    response: Response,
    page: PageParams = Depends(page_params(NAME_CURSOR)),
) -> list[TenantOut]:
    """A page of tenants by name: every tenant for the admin; a tenant's token lists its own tenant only."""
    return paged(tenants.list_tenants(session, page=page, as_tenant=principal.tenant), request, response)


@router.post(
    "/tenants", status_code=status.HTTP_201_CREATED, response_model=TenantCreated, tags=["tenants"],
    dependencies=[Depends(require_admin)],
    responses=answers(CONFLICT, {201: {"links": links(tenant="$response.body#/tenant/name", token="$response.body#/token/id")}}),
)
def create_tenant(body: TenantCreate, session: SessionDep) -> TenantCreated:
    """Create a tenant (admin only). The answer holds its first token, shown this once."""
    return tenants.create_tenant(session, body)


@router.patch(
    "/tenants/{name}", response_model=TenantOut, tags=["tenants"], dependencies=[Depends(require_admin)],
    responses=answers(CONFLICT, {200: {"links": links(tenant="$response.body#/name")}}),
)
def update_tenant(body: TenantUpdate, session: SessionDep, name: str = TenantName) -> TenantOut:
    """Change a tenant's weight (its share of the devices when tenants compete), quotas, or `code_upload`
    (whether it may upload code packages and run studies of them) (admin only)."""
    return tenants.update_tenant(session, name, body)


@router.get(
    "/tenants/{name}/tokens", response_model=list[TokenOut], tags=["tenants"],
    responses={200: {"headers": LINK_HEADER, "links": links(token="$response.body#/0/id")}},
)
def list_tokens(
    principal: PrincipalDep,
    session: SessionDep,
    request: Request,
    response: Response,
    name: str = TenantName,
    page: PageParams = Depends(page_params(ID_CURSOR)),
) -> list[TokenOut]:
    """A page of a tenant's tokens (their ids, labels and dates; never the tokens)."""
    return paged(tenants.list_tokens(session, name, page=page, as_tenant=principal.tenant), request, response)


@router.post(
    "/tenants/{name}/tokens", status_code=status.HTTP_201_CREATED, response_model=TokenCreated, tags=["tenants"],
    responses=answers(CONFLICT, {201: {"links": links(token="$response.body#/id")}}),
)
def create_token(
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
    body: TokenCreate | None = None,
    name: str = TenantName,
) -> TokenCreated:
    """Another token for the tenant, shown this once (the admin, or the tenant for itself).

    A token minted with a tenant's token is revoked with it. 409 naming
    ``max_tokens_per_tenant`` when the tenant holds ``FUSETUNE_MAX_TOKENS_PER_TENANT`` live
    tokens: a limit on what the tenant holds, which waiting does not lift (not a 429).
    """
    try:
        return tenants.create_token(
            session, name, body.label if body else None, as_tenant=principal.tenant,
            minted_by=principal.token_id, max_live=settings.max_tokens_per_tenant,
        )
    except TokenRevoked as exc:  # revoked between the authentication and the mint
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "the bearer token is not valid (unknown or revoked)",
            headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
        ) from exc


@router.delete("/tokens/{token_id}", response_model=TokenOut, tags=["tenants"])
def revoke_token(
    token_id: TokenId, principal: PrincipalDep, session: SessionDep
) -> TokenOut:
    """Revoke a token (the admin, or the tenant for its own), and every token minted from it,
    transitively; none of them authenticates anything after."""
    return tenants.revoke_token(session, token_id, as_tenant=principal.tenant)
