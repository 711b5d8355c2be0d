"""trial revisions in a narrow table of their own (ft_trial_revisions), not a column of ft_trials

The scheduling loop stamps every member of every array at every epoch. As a column of
ft_trials, each stamp wrote the whole trial row anew with an entry in each of its seven
indexes; a row of (trial_id, study_id, revision) with one index of its own costs a fraction
of that (1,024 trials: about 7 ms instead of 18 to 55 ms on the 2-core box). Each trial keeps
its revision.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ft_trial_revisions",
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("revision", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["trial_id"], ["ft_trials.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("trial_id"),
    )
    op.execute("INSERT INTO ft_trial_revisions (trial_id, study_id, revision) SELECT id, study_id, revision FROM ft_trials")
    op.create_index("ix_ft_trial_revisions_study_revision", "ft_trial_revisions", ["study_id", "revision", "trial_id"], unique=False)
    with op.batch_alter_table("ft_trials", schema=None) as batch_op:
        batch_op.drop_index("ix_ft_trials_study_revision")
        batch_op.drop_column("revision")


def downgrade() -> None:
    with op.batch_alter_table("ft_trials", schema=None) as batch_op:
        batch_op.add_column(sa.Column("revision", sa.BigInteger(), nullable=False, server_default="0"))
    op.execute(
        "UPDATE ft_trials SET revision = "
        "(SELECT r.revision FROM ft_trial_revisions r WHERE r.trial_id = ft_trials.id) "
        "WHERE id IN (SELECT trial_id FROM ft_trial_revisions)"
    )
    with op.batch_alter_table("ft_trials", schema=None) as batch_op:
        batch_op.create_index("ix_ft_trials_study_revision", ["study_id", "revision", "id"], unique=False)
    op.drop_index("ix_ft_trial_revisions_study_revision", table_name="ft_trial_revisions")
    op.drop_table("ft_trial_revisions")
