"""Tokens minted with a tenant's token die with it, and a tenant holds a bounded number of live
tokens: over HTTP, on SQLite and PostgreSQL. A leaked token cannot keep its holder in by
minting spares before it is revoked, not even by minting while it is being revoked."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import sqlalchemy as sa
from alembic import command

from fusetune.server.db import get_engine, upgrade
from fusetune.server.db.engine import alembic_config
from tests.server.conftest import LiveApi, live_api
from tests.server.test_studies_api import field_of


def mint(live: LiveApi, token: str, tenant: str = "acme") -> dict:
    """A new token of ``tenant``, minted with ``token``: its record and the token."""
    response = live.client(token).post(f"/api/v1/tenants/{tenant}/tokens", json={"label": "spare"})
    assert response.status_code == 201, response.text
    return response.json()


def works(live: LiveApi, token: str) -> bool:
    status = live.client(token).get("/api/v1/studies").status_code
    assert status in (200, 401), status
    return status == 200


def test_revoking_a_token_revokes_every_token_minted_from_it_transitively(live: LiveApi, admin: httpx.Client) -> None:
    _, first = live.create_tenant("acme")
    leaked = mint(live, first)
    spare = mint(live, leaked["token"])  # the holder of the leaked token mints spares,
    spare_of_spare = mint(live, spare["token"])  # and spares of those
    sibling = mint(live, first)  # minted with the first token: not the leaked one's
    by_admin = live.token_for("acme")
    assert all(works(live, t) for t in (first, leaked["token"], spare["token"], spare_of_spare["token"], sibling["token"], by_admin))

    revoked = live.client(first).delete(f"/api/v1/tokens/{leaked['id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    for token in (leaked["token"], spare["token"], spare_of_spare["token"]):
        assert not works(live, token)
    assert works(live, first) and works(live, sibling["token"]) and works(live, by_admin)
    listed = {t["id"]: t["revoked_at"] is not None for t in admin.get("/api/v1/tenants/acme/tokens").json()}
    assert [i for i, gone in listed.items() if gone] == [leaked["id"], spare["id"], spare_of_spare["id"]]
    # Revoking it again changes nothing; a revoked token mints nothing.
    again = live.client(first).delete(f"/api/v1/tokens/{leaked['id']}")
    assert again.status_code == 200 and again.json()["revoked_at"] == revoked.json()["revoked_at"]
    refused = live.client(spare["token"]).post("/api/v1/tenants/acme/tokens", json={})
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")

    # A leaf goes alone; the admin revoking the first token takes what it minted (the sibling).
    leaf = mint(live, sibling["token"])
    assert live.client(sibling["token"]).delete(f"/api/v1/tokens/{leaf['id']}").status_code == 200
    assert works(live, sibling["token"]) and not works(live, leaf["token"])
    first_id = min(listed)
    assert admin.delete(f"/api/v1/tokens/{first_id}").status_code == 200
    assert not works(live, first) and not works(live, sibling["token"]) and works(live, by_admin)


def test_spares_minted_while_their_token_is_revoked_die_with_it(live: LiveApi) -> None:
    """Mints with a leaked token race its revocation: every spare that was minted is revoked
    once the revocation has answered, and mints after it are refused."""
    _, owner = live.create_tenant("acme")
    leaked = mint(live, owner)
    minters = [live.client(leaked["token"]) for _ in range(10)]
    revoker = live.client(owner)
    for client in (*minters, revoker):  # connected first: the barrier releases requests, not handshakes
        assert client.get("/api/v1/tenants").status_code == 200
    barrier = threading.Barrier(len(minters) + 1)

    def mint_spare(client: httpx.Client) -> httpx.Response:
        barrier.wait()
        return client.post("/api/v1/tenants/acme/tokens", json={"label": "spare"})

    def revoke() -> httpx.Response:
        barrier.wait()
        return revoker.delete(f"/api/v1/tokens/{leaked['id']}")

    with ThreadPoolExecutor(len(minters) + 1) as pool:
        spares = [pool.submit(mint_spare, client) for client in minters]
        revoked = pool.submit(revoke).result()
        answers = [f.result() for f in spares]
    assert revoked.status_code == 200
    assert {r.status_code for r in answers} <= {201, 401}, [r.text for r in answers]
    for response in answers:
        if response.status_code == 201:
            assert not works(live, response.json()["token"])
    assert works(live, owner)


def test_a_tenant_holds_at_most_the_tokens_the_setting_allows(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    for live in live_api(database_url, max_tokens_per_tenant=3, artifact_dir=tmp_path_factory.mktemp("artifacts")):
        admin = live.client(live.admin_token)
        _, first = live.create_tenant("acme")
        spares = [mint(live, first), mint(live, first)]  # 3 live now
        for caller in (live.client(first), admin):  # the admin is held to it too
            response = caller.post("/api/v1/tenants/acme/tokens", json={})
            assert response.status_code == 409, response.text
            assert field_of(response) == [["tenant", "max_tokens_per_tenant"]]
            assert "FUSETUNE_MAX_TOKENS_PER_TENANT=3" in response.text
        _, other = live.create_tenant("other")  # another tenant's tokens count apart
        assert works(live, mint(live, other, "other")["token"])
        # A revoked token no longer counts: one more may be minted, concurrent mints included.
        assert admin.delete(f"/api/v1/tokens/{spares[0]['id']}").status_code == 200
        clients = [live.client(first) for _ in range(6)]
        barrier = threading.Barrier(len(clients))

        def mint_at_once(client: httpx.Client, barrier: threading.Barrier = barrier) -> int:
            barrier.wait()
            return client.post("/api/v1/tenants/acme/tokens", json={}).status_code

        with ThreadPoolExecutor(len(clients)) as pool:
            statuses = sorted(pool.map(mint_at_once, clients))
        assert statuses == [201] + [409] * 5
        live_tokens = [t for t in admin.get("/api/v1/tenants/acme/tokens").json() if t["revoked_at"] is None]
        assert len(live_tokens) == 3


@pytest.fixture
def old_database(database_url: str) -> Iterator[str]:
    """A database at the migration before tokens recorded who minted them, holding a token."""
    config = alembic_config(database_url)
    with get_engine(database_url).begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0012")
        conn.execute(sa.text("INSERT INTO ft_tenants (name, weight, created_at) VALUES ('acme', 1.0, CURRENT_TIMESTAMP)"))
        conn.execute(
            sa.text(
                "INSERT INTO ft_tokens (tenant, token_hash, label, created_at) "
                "VALUES ('acme', :digest, 'old', CURRENT_TIMESTAMP)"
            ),
            {"digest": "a" * 64},
        )
    yield database_url


def test_tokens_made_before_the_lineage_migration_keep_working_and_name_no_minter(old_database: str) -> None:
    upgrade(old_database)
    with get_engine(old_database).connect() as conn:
        rows = conn.execute(sa.text("SELECT label, minted_by, revoked_at FROM ft_tokens")).all()
    assert [tuple(r) for r in rows] == [("old", None, None)]
