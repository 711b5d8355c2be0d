"""Schemathesis hooks of tests/server/test_openapi_schemathesis.py (SCHEMATHESIS_HOOKS).

A code package's upload is a zip (PUT /api/v1/packages/{digest}, ``application/zip``):
its generated bodies are sent as raw bytes, as Schemathesis sends ``application/octet-stream``.
"""

import schemathesis

schemathesis.serializer.alias("application/zip", "application/octet-stream")
