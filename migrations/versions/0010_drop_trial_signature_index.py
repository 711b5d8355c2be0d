"""drop ix_ft_trials_signature: no query looks trials up by signature

Every change to a trial (each array-epoch stamps its members' revision) writes an entry in
each of ft_trials' indexes, since the stamped column is indexed; this one served no query
(the scheduler reads a study's unfinished trials and groups them by signature in memory).

Revision ID: 0010
Revises: 0007
Create Date: 2026-12-01
"""

from alembic import op

revision = "0010"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_trials", schema=None) as batch_op:
        batch_op.drop_index("ix_ft_trials_signature")


def downgrade() -> None:
    with op.batch_alter_table("ft_trials", schema=None) as batch_op:
        batch_op.create_index("ix_ft_trials_signature", ["signature"], unique=False)
