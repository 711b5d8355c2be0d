"""The HTTP surface of the service."""

from .packages import router as packages_router
from .routes import health_router, router
from .tenants import router as tenants_router

__all__ = ["health_router", "packages_router", "router", "tenants_router"]
