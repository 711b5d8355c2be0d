"""A workload reachable only by its module path (``tests.server.path_workload:WORKLOAD``).

tests/server/test_auth.py checks that the server imports this module only when the operator
allows workload imports.
"""

from fusetune.workers.workloads._digits import DIGITS_MLP as WORKLOAD

__all__ = ["WORKLOAD"]
