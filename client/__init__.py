"""Python client of the fusetune service, and the way in from a user's own Optuna code.

* :class:`Client`: the REST API, typed.
* :class:`Storage`: a service's studies as an Optuna storage, scoped to the token's tenant.
* :func:`create_study` / :func:`load_study`: ``optuna.create_study``/``load_study`` for studies
  the service trains.
* :func:`optimize`: ``study.optimize`` for a user's own study, its trials trained on the service.
"""

from ._client import Client, FusetuneError
from ._optimize import optimize
from ._specs import component_spec
from ._storage import ReadOnlyStorageError, Storage
from ._studies import create_study, load_study
from .samplers import FusionSampler

__all__ = [
    "Client",
    "FusetuneError",
    "FusionSampler",
    "ReadOnlyStorageError",
    "Storage",
    "component_spec",
    "create_study",
    "load_study",
    "optimize",
]
