"""The client's calls on code packages: look one up, upload it once, download it."""

from __future__ import annotations

from typing import Any

from ._http import Connection, _failure
from ._package import Package

_NOT_FOUND = 404


class PackageCalls(Connection):
    """Code packages: ``/api/v1/packages/{digest}``."""

    def has_package(self, digest: str, *, tenant: str | None = None) -> bool:
        """Whether this token's tenant (the admin: ``tenant``, else any) has uploaded the package."""
        response = self._http.head(f"/api/v1/packages/{digest}", params=_tenant(tenant))
        if response.status_code == _NOT_FOUND:
            return False
        if response.is_error:
            raise _failure(response)
        return True

    def upload_package(self, package: Package, *, tenant: str | None = None) -> dict[str, Any]:
        """Upload the package (its record; the same bytes again store nothing new)."""
        return self._call(
            "PUT", f"/api/v1/packages/{package.digest}", content=package.data,
            headers={"Content-Type": "application/zip"}, params=_tenant(tenant),
        )

    def ensure_package(self, package: Package, *, tenant: str | None = None) -> bool:
        """Upload the package unless the tenant has it already (one ``HEAD``); True if it uploaded."""
        if self.has_package(package.digest, tenant=tenant):
            return False
        self.upload_package(package, tenant=tenant)
        return True

    def download_package(self, digest: str) -> bytes:
        """The zip of a package this tenant uploaded (the admin: any tenant's)."""
        response = self._http.get(f"/api/v1/packages/{digest}")
        if response.is_error:
            raise _failure(response)
        return response.content


def _tenant(tenant: str | None) -> dict[str, str]:
    return {"tenant": tenant} if tenant is not None else {}
