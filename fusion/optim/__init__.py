"""Fused optimizers, twins of ``torch.optim`` with per-member hyper-parameters.

Every numeric hyper-parameter is a scalar (shared) or a sequence of length B
(one per member); a wrong length raises ``ValueError`` naming it.
"""

from ._adam import Adam, AdamW
from ._adaptive import Adadelta, Adagrad, RMSprop
from ._base import FusedOptimizer
from ._sgd import SGD

__all__ = ["SGD", "Adadelta", "Adagrad", "Adam", "AdamW", "FusedOptimizer", "RMSprop"]
