"""Registration of the ``linerate`` backend with torch.distributed.

``autoload`` is the ``torch.backends`` entry point that torch calls during ``import torch``:
it must be cheap (no transport import, no sockets), idempotent, and must never make
``import torch`` fail, so it catches everything and logs.
"""
from __future__ import annotations

import logging

BACKEND_NAME = "linerate"
log = logging.getLogger("linerate")


def _create(dist_opts, backend_options=None):
    from .backend import create_process_group  # the heavy part, loaded on first use
    return create_process_group(dist_opts, backend_options)


def register() -> bool:
    """Register the backend (once); return True if it is registered."""
    import torch.distributed as dist

    if not dist.is_available():
        return False
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return True
    devices = ["cpu", "cuda"]
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=devices)
    return True


def autoload() -> None:
    try:
        register()
    except Exception:  # noqa: BLE001 - never break `import torch`
        log.warning("linerate: could not register the torch.distributed backend", exc_info=True)
