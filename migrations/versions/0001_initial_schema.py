"""initial schema: studies, trials, arrays, members, workers

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('ft_studies',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('tenant', sa.String(length=255), nullable=False),
    sa.Column('workload', sa.String(length=255), nullable=False),
    sa.Column('n_trials', sa.Integer(), nullable=False),
    sa.Column('epochs', sa.Integer(), nullable=False),
    sa.Column('direction', sa.String(length=16), nullable=False),
    sa.Column('search_space', sa.JSON(), nullable=True),
    sa.Column('sampler', sa.JSON(), nullable=False),
    sa.Column('pruner', sa.JSON(), nullable=True),
    sa.Column('max_array_size', sa.Integer(), nullable=True),
    sa.Column('optuna_study_id', sa.Integer(), nullable=False),
    sa.Column('state', sa.Enum('RUNNING', 'COMPLETE', name='studystate', native_enum=False, length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name'),
    sa.UniqueConstraint('optuna_study_id')
    )
    with op.batch_alter_table('ft_studies', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ft_studies_state'), ['state'], unique=False)
        batch_op.create_index(batch_op.f('ix_ft_studies_tenant'), ['tenant'], unique=False)

    op.create_table('ft_workers',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('device_type', sa.String(length=64), nullable=False),
    sa.Column('node', sa.String(length=255), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('last_seen', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('ft_arrays',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('study_id', sa.Integer(), nullable=False),
    sa.Column('signature', sa.String(length=64), nullable=False),
    sa.Column('state', sa.Enum('RUNNING', 'COMPLETE', 'FAIL', name='arraystate', native_enum=False, length=16), nullable=False),
    sa.Column('worker_id', sa.Integer(), nullable=True),
    sa.Column('epochs_done', sa.Integer(), nullable=False),
    sa.Column('models_steps_per_s', sa.Float(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['study_id'], ['ft_studies.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['worker_id'], ['ft_workers.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('ft_arrays', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ft_arrays_state'), ['state'], unique=False)
        batch_op.create_index(batch_op.f('ix_ft_arrays_study_id'), ['study_id'], unique=False)

    op.create_table('ft_trials',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('study_id', sa.Integer(), nullable=False),
    sa.Column('optuna_trial_id', sa.Integer(), nullable=False),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('signature', sa.String(length=64), nullable=False),
    sa.Column('state', sa.Enum('WAITING', 'RUNNING', 'COMPLETE', 'PRUNED', 'FAIL', name='trialstate', native_enum=False, length=16), nullable=False),
    sa.Column('value', sa.Float(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('array_id', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['array_id'], ['ft_arrays.id'], ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['study_id'], ['ft_studies.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('optuna_trial_id')
    )
    with op.batch_alter_table('ft_trials', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ft_trials_array_id'), ['array_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_ft_trials_signature'), ['signature'], unique=False)
        batch_op.create_index(batch_op.f('ix_ft_trials_state'), ['state'], unique=False)
        batch_op.create_index(batch_op.f('ix_ft_trials_study_id'), ['study_id'], unique=False)

    op.create_table('ft_array_members',
    sa.Column('array_id', sa.Integer(), nullable=False),
    sa.Column('slot', sa.Integer(), nullable=False),
    sa.Column('trial_id', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['array_id'], ['ft_arrays.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['trial_id'], ['ft_trials.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('array_id', 'slot')
    )
    with op.batch_alter_table('ft_array_members', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ft_array_members_trial_id'), ['trial_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('ft_array_members', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_ft_array_members_trial_id'))

    op.drop_table('ft_array_members')
    with op.batch_alter_table('ft_trials', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_ft_trials_study_id'))
        batch_op.drop_index(batch_op.f('ix_ft_trials_state'))
        batch_op.drop_index(batch_op.f('ix_ft_trials_signature'))
        batch_op.drop_index(batch_op.f('ix_ft_trials_array_id'))

    op.drop_table('ft_trials')
    with op.batch_alter_table('ft_arrays', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_ft_arrays_study_id'))
        batch_op.drop_index(batch_op.f('ix_ft_arrays_state'))

    op.drop_table('ft_arrays')
    op.drop_table('ft_workers')
    with op.batch_alter_table('ft_studies', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_ft_studies_tenant'))
        batch_op.drop_index(batch_op.f('ix_ft_studies_state'))

    op.drop_table('ft_studies')
