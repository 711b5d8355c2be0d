"""Alembic migrations on SQLite and PostgreSQL, beside Optuna's own tables."""

from __future__ import annotations

import json

import optuna
import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory

from fusetune.server.db import Base, get_engine, get_optuna_storage, upgrade
from fusetune.server.db.engine import VERSION_TABLE, alembic_config

#: The newest migration: upgrading must land there.
HEAD = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def tables(url: str) -> set[str]:
    return set(sa.inspect(get_engine(url)).get_table_names())


def test_upgrade_creates_every_table_and_is_idempotent(database_url: str) -> None:
    upgrade(database_url)
    upgrade(database_url)
    assert set(Base.metadata.tables) <= tables(database_url)
    with get_engine(database_url).connect() as conn:
        assert conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar_one() == HEAD


def test_migrations_match_the_models(database_url: str) -> None:
    """Autogenerate finds nothing to add: the migrations describe exactly the models."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    upgrade(database_url)
    with get_engine(database_url).connect() as conn:
        context = MigrationContext.configure(conn, opts={"include_object": lambda o, n, t, r, c: t != "table" or n.startswith("ft_")})
        assert compare_metadata(context, Base.metadata) == []


def test_optuna_tables_live_beside_ours(database_url: str) -> None:
    upgrade(database_url)
    storage = get_optuna_storage(database_url)
    optuna.create_study(study_name="side-by-side", storage=storage)
    assert {"studies", "trials", "alembic_version"} <= tables(database_url)
    assert {"ft_studies", "ft_trials", VERSION_TABLE} <= tables(database_url)


def test_downgrade_removes_only_our_tables(database_url: str) -> None:
    upgrade(database_url)
    get_optuna_storage(database_url)
    config = alembic_config(database_url)
    with get_engine(database_url).begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "base")
    remaining = tables(database_url)
    assert not {t for t in remaining if t.startswith("ft_")}
    assert "studies" in remaining


def test_tenants_migration_gives_existing_tenants_one_share(database_url: str) -> None:
    config = alembic_config(database_url)
    with get_engine(database_url).begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0001")
        conn.execute(
            sa.text(
                "INSERT INTO ft_studies (name, tenant, workload, n_trials, epochs, direction, sampler,"
                " optuna_study_id, state, created_at) VALUES ('old', 'acme', 'digits-mlp', 1, 1,"
                " 'maximize', '{}', 1, 'RUNNING', CURRENT_TIMESTAMP)"
            )
        )
    upgrade(database_url)
    with get_engine(database_url).connect() as conn:
        # acme from its study (0002); `default` from 0004, for studies that name no tenant.
        assert sorted(conn.execute(sa.text("SELECT name, weight FROM ft_tenants")).all()) == [("acme", 1.0), ("default", 1.0)]


def test_auth_migration_keeps_an_existing_default_tenant_and_adds_no_quotas(database_url: str) -> None:
    config = alembic_config(database_url)
    with get_engine(database_url).begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0003")
        conn.execute(sa.text("INSERT INTO ft_tenants (name, weight, created_at) VALUES ('default', 2.5, CURRENT_TIMESTAMP)"))
    upgrade(database_url)
    with get_engine(database_url).connect() as conn:
        rows = conn.execute(sa.text("SELECT name, weight, max_running_studies, max_trials_per_study FROM ft_tenants")).all()
        assert rows == [("default", 2.5, None, None)]
        assert conn.execute(sa.text("SELECT COUNT(*) FROM ft_tokens")).scalar_one() == 0


def test_0015_moves_a_studys_configuration_into_its_row(database_url: str) -> None:
    """A study stored before 0015 kept its training settings in its Optuna study's system attr
    and its FusionSampler opt-out inside its sampler spec; after it, both are its row's."""
    config = alembic_config(database_url)
    get_optuna_storage(database_url)
    with get_engine(database_url).begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0014")
    optuna_id = optuna.create_study(study_name="old", storage=database_url)._study_id
    training = {"optimizer": {"name": "Adam", "kwargs": {}}, "lr_scheduler": None, "warmup_epochs": None,
                "max_norm": None, "amp": None, "metrics": []}
    with get_engine(database_url).begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO ft_studies (name, tenant, workload, n_trials, epochs, direction, sampler, driver, optuna_study_id, state, created_at) "
            "VALUES ('old', 'default', 'digits-mlp', 4, 2, 'maximize', :sampler, 'service', :o, 'RUNNING', CURRENT_TIMESTAMP)"
        ), {"sampler": '{"name": "TPESampler", "kwargs": {"seed": 1}, "fusion": false}', "o": optuna_id})
        conn.execute(sa.text("INSERT INTO study_system_attributes (study_id, key, value_json) VALUES (:o, 'fusetune:training', :v)"),
                     {"o": optuna_id, "v": json.dumps(training)})
    upgrade(database_url)
    from fusetune.server.db import Study, get_sessionmaker

    with get_sessionmaker(database_url)() as session:
        study = session.scalar(sa.select(Study).where(Study.name == "old"))
        assert study.sampler == {"name": "TPESampler", "kwargs": {"seed": 1}}
        assert study.config.fusion_sampler is False and study.config.training.optimizer == "Adam"
    storage = get_optuna_storage(database_url)
    assert "fusetune:training" not in storage.get_study_system_attrs(optuna_id)
