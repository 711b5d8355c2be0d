"""The HTTP surface of the service."""

from .routes import health_router, router
from .tenants import router as tenants_router

__all__ = ["health_router", "router", "tenants_router"]
