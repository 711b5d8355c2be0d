"""a study's max_concurrent_trials: the most of its trials asked and not finished at once

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_studies", schema=None) as batch_op:
        batch_op.add_column(sa.Column("max_concurrent_trials", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ft_studies", schema=None) as batch_op:
        batch_op.drop_column("max_concurrent_trials")
