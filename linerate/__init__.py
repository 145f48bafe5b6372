"""linerate: a torch.distributed backend over striped TCP (and RDMA), and its tools.

``import linerate`` registers the ``linerate`` backend with torch.distributed: at once where torch
is imported, else when it is (torch's ``torch.backends`` entry point also registers it at
``import torch``, so scripts need no import of ours). It stays cheap: it imports no torch, and
nothing heavy is imported until it is used.

The public names (``linerate.DecentralizedDataParallel``, ``linerate.Options``, ...) load on
first use. The subpackages are ``linerate.transport`` (moves bytes), ``linerate.collectives``
(algorithms and the process group) and ``linerate.tools`` (the ``linerate`` command).
"""
from __future__ import annotations

import os as _os

# In a source tree that is not installed, this folder holds only the package's top module and
# the subpackages are the repository's top-level folders beside it: map them in. An installed
# copy (wheel or site-packages) has them inside this folder and is left alone.
_here = _os.path.dirname(_os.path.abspath(__file__))
_tree = _os.path.dirname(_here)
if (not _os.path.isdir(_os.path.join(_here, "transport"))
        and _os.path.isfile(_os.path.join(_tree, "transport", "__init__.py"))
        and _os.path.isfile(_os.path.join(_tree, "collectives", "__init__.py"))):
    __path__.append(_tree)  # noqa: F821 - a package's __path__


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"


#: The distribution name on PyPI (``linerate`` there is an unrelated project).
DISTRIBUTION = "torch-linerate"
BACKEND_NAME = "linerate"
__version__ = _version()

_LAZY = {
    "ProcessGroupLinerate": ("linerate.collectives.backend", "ProcessGroupLinerate"),
    "create_process_group": ("linerate.collectives.backend", "create_process_group"),
    "Options": ("linerate.collectives.options", "Options"),
    "TransportOptions": ("linerate.transport.options", "TransportOptions"),
    "MetricsOptions": ("linerate.transport.options", "MetricsOptions"),
    "neighbor_allreduce": ("linerate.collectives.neighbor", "neighbor_allreduce"),
    "hierarchical_neighbor_allreduce": ("linerate.collectives.neighbor",
                                        "hierarchical_neighbor_allreduce"),
    "DecentralizedDataParallel": ("linerate.collectives.decentralized", "DecentralizedDataParallel"),
    "PriorityDataParallel": ("linerate.collectives.priority", "PriorityDataParallel"),
    "dump_flight": ("linerate.collectives.flight", "dump"),
    "topology": ("linerate.collectives.topology", None),
    "settings": ("linerate.settings", None),
}


def __getattr__(name):
    # Heavy modules load on first use, so that ``import linerate`` (at ``import torch``) stays cheap.
    if name not in _LAZY:
        raise AttributeError(f"module 'linerate' has no attribute {name!r}")
    import importlib
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def backend_of(group=None):
    """The ``linerate.ProcessGroupLinerate`` behind a torch.distributed group (``None``: the
    default group), for its own methods: ``connection_stats()``, ``slow_report()``,
    ``allreduce_priority()``, ``options``, ... The group's CPU backend is looked at first, then
    its CUDA backend (``"cpu:gloo,cuda:linerate"``). Raises ``RuntimeError`` where
    torch.distributed is not initialized or no backend of the group is linerate's."""
    import torch
    import torch.distributed as dist
    from linerate.collectives.backend import ProcessGroupLinerate
    if isinstance(group, ProcessGroupLinerate):
        return group
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("linerate.backend_of: torch.distributed is not initialized: call "
                               "dist.init_process_group first")
        group = dist.group.WORLD
    found = []
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except Exception:  # noqa: BLE001 - no backend for this device type
            continue
        if isinstance(backend, ProcessGroupLinerate):
            return backend
        found.append(f"{device}: {getattr(backend, 'name', lambda: type(backend).__name__)()}")
    raise RuntimeError(f"linerate.backend_of: the group has no linerate backend "
                       f"({', '.join(found) or 'no backend'}): make one with "
                       f"dist.init_process_group('linerate') or "
                       f"dist.new_group(backend='linerate')")


def register() -> bool:
    """Register the ``linerate`` backend with torch.distributed (once); True if registered.
    Imports torch."""
    from ._torch_hook import register as _register
    return _register()


# Registered now where torch is imported, else once it is: ``import linerate`` itself never
# imports torch (the ``linerate`` command's ``top`` and ``flight`` run without it).
from ._torch_hook import after_torch as _after_torch  # noqa: E402

_after_torch()

__all__ = ["BACKEND_NAME", "DISTRIBUTION", "__version__", "register", "backend_of", *_LAZY]
