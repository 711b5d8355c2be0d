"""who drives a study: the service (its sampler and pruner) or a client (enqueued trials, its pruning)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_studies", schema=None) as batch_op:
        batch_op.add_column(sa.Column("driver", sa.String(length=16), nullable=False, server_default="service"))


def downgrade() -> None:
    with op.batch_alter_table("ft_studies", schema=None) as batch_op:
        batch_op.drop_column("driver")
