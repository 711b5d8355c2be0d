"""a study's configuration in one place: ft_studies.training and ft_studies.fusion_sampler

Before, a study's training settings lived in its Optuna study's system attr
``fusetune:training`` and its FusionSampler opt-out inside its sampler spec
(``{"fusion": false}``), beside the sampler and pruner columns. Both move to columns of
``ft_studies``: the attr's value into ``training`` (the attr is removed), the flag into
``fusion_sampler`` (the spec keeps only ``name`` and ``kwargs``).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_ATTR = "fusetune:training"


def _optuna_attrs(bind: sa.Connection) -> dict[int, str]:
    """Optuna study id -> the stored training spec JSON (none when Optuna's tables are absent)."""
    if "study_system_attributes" not in sa.inspect(bind).get_table_names():
        return {}
    rows = bind.execute(sa.text("SELECT study_id, value_json FROM study_system_attributes WHERE key = :k"), {"k": _ATTR})
    return {study_id: value for study_id, value in rows}


def upgrade() -> None:
    with op.batch_alter_table("ft_studies", schema=None) as batch_op:
        batch_op.add_column(sa.Column("fusion_sampler", sa.Boolean(), server_default=sa.true(), nullable=False))
        batch_op.add_column(sa.Column("training", sa.JSON(), nullable=True))
    bind = op.get_bind()
    attrs = _optuna_attrs(bind)
    studies = sa.table("ft_studies", sa.column("id"), sa.column("optuna_study_id"), sa.column("sampler", sa.JSON()),
                       sa.column("training", sa.JSON()), sa.column("fusion_sampler", sa.Boolean()))
    for study_id, optuna_id, sampler in bind.execute(sa.select(studies.c.id, studies.c.optuna_study_id, studies.c.sampler)).all():
        sampler = dict(sampler or {})
        fusion = bool(sampler.pop("fusion", True))
        training = json.loads(attrs[optuna_id]) if optuna_id in attrs else None
        bind.execute(studies.update().where(studies.c.id == study_id).values(sampler=sampler, fusion_sampler=fusion, training=training))
    if attrs:
        bind.execute(sa.text("DELETE FROM study_system_attributes WHERE key = :k"), {"k": _ATTR})


def downgrade() -> None:
    bind = op.get_bind()
    studies = sa.table("ft_studies", sa.column("id"), sa.column("optuna_study_id"), sa.column("sampler", sa.JSON()),
                       sa.column("training", sa.JSON()), sa.column("fusion_sampler", sa.Boolean()))
    has_optuna = "study_system_attributes" in sa.inspect(bind).get_table_names()
    for study_id, optuna_id, sampler, training, fusion in bind.execute(sa.select(
        studies.c.id, studies.c.optuna_study_id, studies.c.sampler, studies.c.training, studies.c.fusion_sampler
    )).all():
        if not fusion:
            bind.execute(studies.update().where(studies.c.id == study_id).values(sampler={**(sampler or {}), "fusion": False}))
        if training is not None and has_optuna:
            bind.execute(sa.text("INSERT INTO study_system_attributes (study_id, key, value_json) VALUES (:s, :k, :v)"),
                         {"s": optuna_id, "k": _ATTR, "v": json.dumps(training)})
    with op.batch_alter_table("ft_studies", schema=None) as batch_op:
        batch_op.drop_column("training")
        batch_op.drop_column("fusion_sampler")
