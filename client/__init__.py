"""Python client of the fusetune service, and the way in from a user's own Optuna code.

* :class:`Client`: the REST API, typed.
* :class:`Storage`: a service's studies as an Optuna storage, scoped to the token's tenant.
* :func:`create_study` / :func:`load_study`: ``optuna.create_study``/``load_study`` for studies
  the service trains.
* :func:`optimize`: ``study.optimize`` for a user's own study, its trials trained on the service.
* :func:`package`: a user's own workload (a ``Workload`` object, or a ``module:attr`` path in a
  folder) as the code package the service trains; ``create_study`` and ``optimize`` call it.
"""

from ._client import Client, FusetuneError
from ._optimize import optimize
from ._package import ConditionalSearchSpaceError, Package, package, static_search_space
from ._specs import component_spec
from ._storage import ReadOnlyStorageError, Storage
from ._studies import create_study, load_study
from .samplers import FusionSampler

__all__ = [
    "Client",
    "ConditionalSearchSpaceError",
    "FusetuneError",
    "FusionSampler",
    "Package",
    "ReadOnlyStorageError",
    "Storage",
    "component_spec",
    "create_study",
    "load_study",
    "optimize",
    "package",
    "static_search_space",
]
