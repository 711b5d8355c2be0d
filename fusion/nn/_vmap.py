"""The vmap a batched call runs under, as functorch's interpreter of it."""

from __future__ import annotations

from torch._functorch.pyfunctorch import VmapInterpreter, retrieve_current_functorch_interpreter

from .._errors import FusionError


def vmap_interpreter() -> VmapInterpreter:
    """The innermost functorch transform, which inside a batched call is the members' vmap:
    its level (to unwrap the members' tensors), its batch size (B) and ``lower()`` (to run one
    level below it). Raises :class:`FusionError` under another transform (grad, jvp) or none."""
    interpreter = retrieve_current_functorch_interpreter()
    if not isinstance(interpreter, VmapInterpreter):
        raise FusionError(f"a batched call runs under vmap, not under functorch's {type(interpreter).__name__}")
    return interpreter
