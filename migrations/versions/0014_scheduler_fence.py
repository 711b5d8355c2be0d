"""the scheduler's fencing row (ft_scheduler): every scheduling commit checks its epoch

A server takes the database's scheduler lock, then increments the epoch of this one row;
every commit of its scheduling loop checks, in the same transaction, that the epoch is
still its own. A scheduler that lost the lock without noticing is refused by the database
as soon as another has taken over (server/fencing.py).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "ft_scheduler",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("leader", sa.String(length=255), nullable=True),
        sa.Column("since", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.bulk_insert(table, [{"id": 1, "epoch": 0}])


def downgrade() -> None:
    op.drop_table("ft_scheduler")
