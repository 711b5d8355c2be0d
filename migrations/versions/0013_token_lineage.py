"""tokens record the token that minted them (ft_tokens.minted_by), so revoking one revokes its spares

A tenant's token may mint more tokens for its tenant. Before this, a leaked token could mint
spares that outlived its revocation; now each token names the token whose bearer created it
(NULL: the admin or the operator did), and revoking a token revokes every token minted from
it, transitively. Existing tokens keep NULL: who minted them was not recorded.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ft_tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("minted_by", sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f("ix_ft_tokens_minted_by"), ["minted_by"], unique=False)
        batch_op.create_foreign_key("fk_ft_tokens_minted_by", "ft_tokens", ["minted_by"], ["id"], ondelete="CASCADE")


def downgrade() -> None:
    with op.batch_alter_table("ft_tokens", schema=None) as batch_op:
        batch_op.drop_constraint("fk_ft_tokens_minted_by", type_="foreignkey")
        batch_op.drop_index(batch_op.f("ix_ft_tokens_minted_by"))
        batch_op.drop_column("minted_by")
