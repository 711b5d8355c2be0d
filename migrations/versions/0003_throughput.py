"""measured throughput per signature, device type and B; array timings

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ft_throughput",
        sa.Column("signature", sa.String(length=64), nullable=False),
        sa.Column("device_type", sa.String(length=64), nullable=False),
        sa.Column("members", sa.Integer(), nullable=False),
        sa.Column("models_steps_per_s", sa.Float(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("signature", "device_type", "members"),
    )
    with op.batch_alter_table("ft_arrays", schema=None) as batch_op:
        batch_op.add_column(sa.Column("timings", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ft_arrays", schema=None) as batch_op:
        batch_op.drop_column("timings")
    op.drop_table("ft_throughput")
