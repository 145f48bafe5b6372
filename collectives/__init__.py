"""linerate collectives: algorithms over the transport, and the ``linerate`` process group.

Importing this package registers the backend (as the ``torch.backends`` entry point also does
at ``import torch``), so ``dist.init_process_group("linerate")`` works.
"""
from ._autoload import BACKEND_NAME, register

register()


def __getattr__(name):
    # Heavy modules load on first use, so that the registration above stays cheap.
    if name in ("ProcessGroupLinerate", "create_process_group"):
        from . import backend
        return getattr(backend, name)
    if name == "Options":
        from .options import Options
        return Options
    if name == "neighbor_allreduce":
        from .neighbor import neighbor_allreduce
        return neighbor_allreduce
    if name == "DecentralizedDataParallel":
        from .decentralized import DecentralizedDataParallel
        return DecentralizedDataParallel
    if name == "PriorityDataParallel":
        from .priority import PriorityDataParallel
        return PriorityDataParallel
    if name == "topology":
        import importlib
        return importlib.import_module(".topology", __name__)
    raise AttributeError(f"module 'collectives' has no attribute {name!r}")


__all__ = ["BACKEND_NAME", "register", "ProcessGroupLinerate", "create_process_group", "Options",
           "neighbor_allreduce", "topology", "DecentralizedDataParallel", "PriorityDataParallel"]
