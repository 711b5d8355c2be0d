"""torch's lazy imports that must not happen inside a training array."""

from __future__ import annotations

import importlib
import sys
import threading

__all__ = ["import_torch_dynamo"]

_lock = threading.Lock()


def import_torch_dynamo() -> None:
    """Import ``torch._dynamo`` (if not yet imported) on a thread of its own.

    ``torch.optim`` imports ``torch._dynamo`` the first time an optimizer is built, and
    that import calls ``torch.fx.wrap``, which keeps its caller's frame, and through each
    frame's ``f_back`` every frame above it, for the life of the process. Whatever the
    first optimizer's builder held would never be freed: a worker's first array (its fused
    model, optimizer state and data; on a GPU, device memory), or the server's first study.
    Imported here first, the frames kept are this thread's, which hold nothing. The server
    and each worker call it as they start (the import takes about a second); in any other
    process, :class:`fusion.optim.FusedOptimizer` and the workers' checks of torch's own
    optimizers call it before they build one.
    """
    if "torch._dynamo" in sys.modules:
        return
    with _lock:
        if "torch._dynamo" in sys.modules:
            return

        def run() -> None:
            # A torch without dynamo fails here as it would at its first optimizer; nothing
            # is kept of the error (its traceback would keep frames too).
            try:
                importlib.import_module("torch._dynamo")
            except Exception:
                pass

        thread = threading.Thread(target=run, name="fusetune-import-torch-dynamo", daemon=True)
        thread.start()
        thread.join()
