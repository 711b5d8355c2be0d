"""reads that scale: trial revisions (ft_trials.revision, the ft_revision counter) and the
indexes of paged trial listings

Revision ID: 0007
Revises: 0009
Create Date: 2026-12-04

Chained to 0009, the newest revision in the folder when this one was written (no 0006 existed).
Existing trials get revision 1 and the counter starts there, so ``updated_since=0`` lists every
trial and the first change after the upgrade is revision 2.
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ft_revision",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.execute("INSERT INTO ft_revision (id, value) VALUES (1, 1)")
    with op.batch_alter_table("ft_trials", schema=None) as batch_op:
        batch_op.add_column(sa.Column("revision", sa.BigInteger(), nullable=False, server_default="0"))
    op.execute("UPDATE ft_trials SET revision = 1")
    with op.batch_alter_table("ft_trials", schema=None) as batch_op:
        # (study_id, number, id) serves what the index of study_id alone did (the foreign key's
        # cascade, the coordinator's counts), so that one goes: one index less to write.
        batch_op.drop_index("ix_ft_trials_study_id")
        batch_op.create_index("ix_ft_trials_study_number", ["study_id", "number", "id"], unique=False)
        batch_op.create_index("ix_ft_trials_study_revision", ["study_id", "revision", "id"], unique=False)
        batch_op.create_index("ix_ft_trials_study_state_value", ["study_id", "state", "value"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("ft_trials", schema=None) as batch_op:
        batch_op.drop_index("ix_ft_trials_study_state_value")
        batch_op.drop_index("ix_ft_trials_study_revision")
        batch_op.drop_index("ix_ft_trials_study_number")
        batch_op.create_index("ix_ft_trials_study_id", ["study_id"], unique=False)
        batch_op.drop_column("revision")
    op.drop_table("ft_revision")
