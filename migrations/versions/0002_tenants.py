"""tenants with weights

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ft_tenants",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    # Every tenant that already owns studies starts with one share.
    op.execute(
        "INSERT INTO ft_tenants (name, weight, created_at) "
        "SELECT DISTINCT tenant, 1.0, CURRENT_TIMESTAMP FROM ft_studies"
    )
    with op.batch_alter_table("ft_studies", schema=None) as batch_op:
        batch_op.create_foreign_key("fk_ft_studies_tenant", "ft_tenants", ["tenant"], ["name"])


def downgrade() -> None:
    with op.batch_alter_table("ft_studies", schema=None) as batch_op:
        batch_op.drop_constraint("fk_ft_studies_tenant", type_="foreignkey")
    op.drop_table("ft_tenants")
