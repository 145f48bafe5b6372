"""Registration of the ``linerate`` backend with torch.distributed.

``register`` is what torch's ``torch.backends`` entry point (``linerate._torch_hook``, through ``import linerate``) calls during
``import torch``: it must be cheap (no transport import, no sockets) and idempotent.
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
