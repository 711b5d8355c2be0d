"""The client's calls on tenants and their tokens. Creating tenants and changing weights or
quotas takes the admin's token; a tenant may list and mint its own tokens."""

from __future__ import annotations

from typing import Any

from ._http import Connection, segment


class TenantCalls(Connection):
    """Tenants (``/api/v1/tenants``) and tokens (``.../tokens``, ``/api/v1/tokens``)."""

    def tenants(self) -> list[dict[str, Any]]:
        """Every tenant (admin), or this token's own tenant."""
        return self._listing("/api/v1/tenants")

    def create_tenant(self, name: str, weight: float = 1.0, **fields: Any) -> dict[str, Any]:
        """A new tenant (admin): ``{"tenant": {...}, "token": {"id": ..., "token": ...}}``; the
        token is shown only here. ``fields``: max_running_studies, max_trials_per_study, token_label."""
        return self._call("POST", "/api/v1/tenants", json={"name": name, "weight": weight, **fields})

    def update_tenant(self, name: str, **fields: Any) -> dict[str, Any]:
        """Change a tenant's weight, max_running_studies, max_trials_per_study (None: no limit) or code_upload (admin)."""
        return self._call("PATCH", f"/api/v1/tenants/{segment(name)}", json=fields)

    def set_weight(self, name: str, weight: float) -> dict[str, Any]:
        return self.update_tenant(name, weight=weight)

    def set_code_upload(self, name: str, allowed: bool) -> dict[str, Any]:
        """Grant or withdraw a tenant's ``code_upload``: whether it may upload code packages (admin)."""
        return self.update_tenant(name, code_upload=allowed)

    def tokens(self, tenant: str) -> list[dict[str, Any]]:
        """A tenant's tokens: ids, labels, dates (never the tokens themselves)."""
        return self._listing(f"/api/v1/tenants/{segment(tenant)}/tokens")

    def create_token(self, tenant: str, label: str | None = None) -> dict[str, Any]:
        """Another token for ``tenant`` (the admin, or the tenant itself); ``["token"]`` is shown only here."""
        return self._call("POST", f"/api/v1/tenants/{segment(tenant)}/tokens", json={"label": label})

    def revoke_token(self, token_id: int) -> dict[str, Any]:
        return self._call("DELETE", f"/api/v1/tokens/{token_id}")
