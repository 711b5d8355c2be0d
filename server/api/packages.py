"""REST routes of code packages, ``/api/v1/packages/{digest}``: upload, look up, download.

A package is a zip named by the SHA-256 of its bytes (``server/packages.py``). Uploading
one takes the admin's grant of ``code_upload`` to the tenant (403 naming it otherwise); a
tenant sees and downloads only the packages it uploaded itself (another tenant's answer 404,
as missing ones do), the admin every tenant's. ``HEAD`` says whether the tenant has one
already, so that a client uploads the same code once.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool

from fusetune.server import packages
from fusetune.server.api.deps import PrincipalDep, SessionDep, SessionRoute, SettingsDep, authenticate
from fusetune.server.api.errors import CODE_FORBIDDEN, _error
from fusetune.server.api.limits import ZIP
from fusetune.server.api.links import answers, links
from fusetune.server.packages import DIGEST_PATTERN, PackageOut

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)], route_class=SessionRoute)

Digest = Annotated[str, Path(pattern=DIGEST_PATTERN, description="The SHA-256 of the package's zip, in lower-case hex.")]
TenantQuery = Annotated[str | None, Query(
    min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
    description="The admin: the tenant it acts for (default `default`). A tenant's token: its own (the default).",
)]
PACKAGE_LINKS = {"links": links(package="$response.body#/digest")}
_ZIP = {"application/zip": {"schema": {"type": "string", "format": "binary"}}}
UPLOAD_ANSWERS = answers(CODE_FORBIDDEN, {
    200: {"model": PackageOut, "description": "The tenant had uploaded these bytes already: nothing is stored again.",
          **PACKAGE_LINKS},
    201: {"description": "Stored (once for every tenant that uploads the same bytes).", **PACKAGE_LINKS},
    413: _error("The package is over FUSETUNE_PACKAGE_MAX_BYTES, _MAX_FILES or _MAX_UNPACKED_BYTES (the detail names it)."),
    415: _error("The body is not a zip (Content-Type: application/zip)."),
})


@router.put(
    "/packages/{digest}", status_code=status.HTTP_201_CREATED, response_model=PackageOut, tags=["packages"],
    responses=UPLOAD_ANSWERS,
    openapi_extra={"requestBody": {"required": True, "content": _ZIP, "description": "The package's zip."}},
)
async def upload_package(
    request: Request,
    response: Response,
    principal: PrincipalDep,
    settings: SettingsDep,
    session: SessionDep,
    digest: Digest,
    tenant: TenantQuery = None,
) -> PackageOut:
    """Upload a code package: a zip whose SHA-256 is `digest`, with its manifest `fusetune.json` at its root.

    The tenant needs the admin's `code_upload` (403). Nothing of the package runs here: its
    entries and manifest are checked as data (422 naming the field or entry, 413 naming the
    limit) and it is kept in the artifact store for the workers."""
    # After authenticate (a missing token is a 401, whatever the body): only a known tenant's
    # zip is read.
    content_type = request.headers.get("content-type")
    if content_type is None or content_type.split(";", 1)[0].strip().lower() != ZIP:
        got = f"Content-Type {content_type!r}" if content_type is not None else "a body with no Content-Type"
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, f"a package is a zip (Content-Type: {ZIP}), not {got}")
    owner = tenant or principal.tenant or "default"
    # The permission before the body: a tenant without code_upload cannot have the server hold
    # up to FUSETUNE_MAX_PACKAGE_BYTES of its body for each of its connections.
    await run_in_threadpool(packages.tenant_with_code, session, owner, principal.tenant)
    data = await request.body()
    out, created = await run_in_threadpool(packages.upload, session, settings, digest, data, tenant=owner, as_tenant=principal.tenant)
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return out


@router.head(
    "/packages/{digest}", status_code=status.HTTP_200_OK, response_class=Response, tags=["packages"],
    responses={200: {"description": "The tenant (the admin: any tenant, or `tenant`) has uploaded this package."}},
)
def has_package(principal: PrincipalDep, session: SessionDep, digest: Digest, tenant: TenantQuery = None) -> Response:
    """Whether the package was uploaded by this tenant, so that a client uploads it once (404: not yet)."""
    packages.owned(session, digest, tenant=tenant, as_tenant=principal.tenant)
    return Response(status_code=status.HTTP_200_OK)


@router.get(
    "/packages/{digest}", response_class=Response, tags=["packages"],
    responses={200: {"content": _ZIP, "description": "The package's zip, as it was uploaded."}},
)
def download_package(principal: PrincipalDep, settings: SettingsDep, session: SessionDep, digest: Digest) -> Response:
    """The zip of a package this tenant uploaded (the admin: any tenant's); 404 otherwise."""
    data = packages.download(session, settings, digest, as_tenant=principal.tenant)
    return Response(data, media_type="application/zip", headers={"Content-Disposition": f'attachment; filename="{digest}.zip"'})
