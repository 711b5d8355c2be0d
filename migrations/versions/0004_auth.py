"""tenants' bearer tokens (hashed) and quotas; the default tenant

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("max_running_studies", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("max_trials_per_study", sa.Integer(), nullable=True))
    op.create_table(
        "ft_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant", sa.String(length=255), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("label", sa.String(length=255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant"], ["ft_tenants.name"], name="fk_ft_tokens_tenant", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("token_hash"),
    )
    with op.batch_alter_table("ft_tokens", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_ft_tokens_tenant"), ["tenant"], unique=False)
    # Studies that name no tenant belong to `default`; tenants are no longer made on the fly.
    op.execute(
        "INSERT INTO ft_tenants (name, weight, created_at) "
        "SELECT 'default', 1.0, CURRENT_TIMESTAMP "
        "WHERE NOT EXISTS (SELECT 1 FROM ft_tenants WHERE name = 'default')"
    )


def downgrade() -> None:
    with op.batch_alter_table("ft_tokens", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_ft_tokens_tenant"))
    op.drop_table("ft_tokens")
    with op.batch_alter_table("ft_tenants", schema=None) as batch_op:
        batch_op.drop_column("max_trials_per_study")
        batch_op.drop_column("max_running_studies")
