"""code packages: ft_packages, ft_tenants.code_upload, ft_studies.package

A tenant with ``code_upload`` (granted by the admin; off for every tenant, existing ones
included) uploads its own code as a zip named by the SHA-256 of its bytes; ``ft_packages``
records which tenant uploaded which digest (the zip itself is in the artifact store at
``packages/<digest>.zip``). A study of an uploaded workload records the package it runs in
``ft_studies.package``.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ft_packages",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=255), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant"], ["ft_tenants.name"], name="fk_ft_packages_tenant", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("digest", "tenant"),
    )
    with op.batch_alter_table("ft_tenants", schema=None) as batch_op:
        # A plain '0' (false on SQLite and PostgreSQL alike): an expression as the default would make
        # SQLite's batch mode copy ft_tenants, whose drop the tokens' and studies' foreign keys refuse.
        batch_op.add_column(sa.Column("code_upload", sa.Boolean(), server_default="0", nullable=False))
    with op.batch_alter_table("ft_studies", schema=None) as batch_op:
        batch_op.add_column(sa.Column("package", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ft_studies", schema=None) as batch_op:
        batch_op.drop_column("package")
    with op.batch_alter_table("ft_tenants", schema=None) as batch_op:
        batch_op.drop_column("code_upload")
    op.drop_table("ft_packages")
