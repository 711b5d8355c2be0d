"""A small typed client for fusetune's REST API.

:class:`Client` is its calls grouped by resource, each group a class of its own module over
one :class:`~._http.Connection`: studies (``_study_calls``, with :meth:`Client.wait` on the
event stream), trials and arrays (``_trial_calls``), tenants and tokens (``_tenant_calls``), code
packages (``_package_calls``).
"""

from __future__ import annotations

from ._http import DEFAULT_URL, PAGE_SIZE, FusetuneError, segment, service_url
from ._package_calls import PackageCalls
from ._study_calls import ENDED, StudyCalls
from ._tenant_calls import TenantCalls
from ._trial_calls import TrialCalls

__all__ = ["DEFAULT_URL", "ENDED", "PAGE_SIZE", "Client", "FusetuneError", "segment", "service_url"]


class Client(StudyCalls, TrialCalls, TenantCalls, PackageCalls):
    """Talks to one fusetune service, e.g. ``Client("http://127.0.0.1:8000", token=...)``.

    ``url`` is ``FUSETUNE_URL`` when omitted; ``token`` is a tenant's (or the admin's) bearer
    token, ``FUSETUNE_TOKEN`` when omitted.
    """
