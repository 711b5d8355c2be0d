"""events of studies' trials and arrays (ft_events), for the server-sent event streams

Revision ID: 0008
Revises: 0005
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ft_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(length=255), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=True),
        sa.Column("array_id", sa.Integer(), nullable=True),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("ft_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_ft_events_tenant"), ["tenant"], unique=False)
        batch_op.create_index(batch_op.f("ix_ft_events_study_id"), ["study_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_ft_events_created_at"), ["created_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("ft_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_ft_events_created_at"))
        batch_op.drop_index(batch_op.f("ix_ft_events_study_id"))
        batch_op.drop_index(batch_op.f("ix_ft_events_tenant"))
    op.drop_table("ft_events")
