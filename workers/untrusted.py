"""Reading back, in the control plane, what processes that run a tenant's code send.

The control plane (the API, the scheduling loop, the Ray driver) gets its workers' reports and
its describers' answers through ``ray.get``, and Ray decodes Python values with pickle. A
process that runs a tenant's code decides what bytes it sends, whatever its functions return:
the tenant's code can hand back an object whose ``__reduce__`` names ``os.system``, or replace
Ray's serializer in its own process. Decoding that in the control plane would run the
tenant's command there, next to the database's credentials and the admin's token.

So every ``ray.get`` of such a result goes through :func:`get`, under which Ray's unpickler in
this process refuses every class but the few the protocol between them is made of (the
reports of ``workers/spec.py``, :class:`~fusetune.workers.package.PackageError`, Ray's own
errors, Python's containers and exceptions), as the ``pickle`` documentation's "Restricting
Globals" describes. A refused object reaches the caller as Ray's ``RaySystemError`` (logged by
Ray with what was refused); an error whose cause is refused arrives as Ray's
``UnserializableException``, which keeps the original's traceback as text. Elsewhere in the
process, and in every other process, Ray's unpickler is left as it is.
"""

from __future__ import annotations

import builtins
import io
import pickle
import threading
from collections.abc import Callable
from typing import Any

import ray
import ray.cloudpickle

__all__ = ["get"]

#: Classes a worker or describer sends, by module: the protocol's, nothing else.
_ALLOWED: dict[str, frozenset[str]] = {
    "fusetune.workers.spec": frozenset({"EpochReport", "MemberReport", "Joined", "ArrayOutcome"}),
    "fusetune.workers.package": frozenset({"PackageError"}),
}
_BUILTIN_TYPES = frozenset({"dict", "list", "tuple", "set", "frozenset", "bytes", "bytearray", "str", "int", "float",
                            "complex", "bool"})

_state = threading.local()
_install_lock = threading.Lock()
_ray_loads: Callable[..., Any] | None = None


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED and name in _ALLOWED[module]:
            return super().find_class(module, name)
        if module == "builtins" and (name in _BUILTIN_TYPES or _is_exception(getattr(builtins, name, None))):
            return super().find_class(module, name)
        if module == "ray.exceptions":
            found = super().find_class(module, name)
            if isinstance(found, type) and issubclass(found, ray.exceptions.RayError):
                return found
        raise pickle.UnpicklingError(
            f"{module}.{name} is not among the classes a worker or describer sends: refused (workers/untrusted.py)"
        )


def _is_exception(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, BaseException)


def _loads(data: Any, *args: Any, buffers: Any = None, **kwargs: Any) -> Any:
    assert _ray_loads is not None
    if not getattr(_state, "untrusted", False):
        return _ray_loads(data, *args, buffers=buffers, **kwargs)
    return _Unpickler(io.BytesIO(data), buffers=buffers).load()


def _install() -> None:
    """Route Ray's unpickling in this process through :func:`_loads` (once). Ray's
    deserializer and its error decoding both call ``ray.cloudpickle.loads``."""
    global _ray_loads
    with _install_lock:
        if _ray_loads is None:
            _ray_loads = ray.cloudpickle.loads
            ray.cloudpickle.loads = _loads


def get(refs: Any, timeout: float | None = None) -> Any:
    """``ray.get`` of results sent by a process that runs a tenant's code (see the module
    docstring): only the protocol's classes are decoded."""
    _install()
    before = getattr(_state, "untrusted", False)
    _state.untrusted = True
    try:
        return ray.get(refs, timeout=timeout)
    finally:
        _state.untrusted = before
