"""where trials can resume from and where arrays ran: ft_trials.checkpoint_epoch, ft_arrays.node

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_trials", schema=None) as batch_op:
        batch_op.add_column(sa.Column("checkpoint_epoch", sa.Integer(), nullable=True))
    with op.batch_alter_table("ft_arrays", schema=None) as batch_op:
        batch_op.add_column(sa.Column("node", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ft_arrays", schema=None) as batch_op:
        batch_op.drop_column("node")
    with op.batch_alter_table("ft_trials", schema=None) as batch_op:
        batch_op.drop_column("checkpoint_epoch")
