"""linerate: a torch.distributed backend over striped TCP (and RDMA), and its tools.

``import linerate`` registers the ``linerate`` backend with torch.distributed (torch's
``torch.backends`` entry point also imports this package at ``import torch``, so scripts need no
import of ours). It stays cheap: nothing heavy is imported until it is used.

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


def register() -> bool:
    """Register the ``linerate`` backend with torch.distributed (once); True if registered."""
    from .collectives._autoload import register as _register
    return _register()


try:
    register()
except Exception:  # noqa: BLE001 - never break `import torch` (we are imported from it)
    import logging as _logging
    _logging.getLogger("linerate").warning(
        "linerate: could not register the torch.distributed backend 'linerate'", exc_info=True)

__all__ = ["BACKEND_NAME", "DISTRIBUTION", "__version__", "register", *_LAZY]
