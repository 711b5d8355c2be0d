"""The HTTP surface of the service."""

from .routes import health_router, router

__all__ = ["health_router", "router"]
