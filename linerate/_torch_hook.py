"""Registration of the ``linerate`` backend with torch.distributed.

torch calls every entry point of its ``torch.backends`` group during ``import torch``:
``autoload`` is linerate's (pyproject.toml), and registers the backend. ``import linerate``
registers it too: at once where torch is imported already, else once torch is (``after_torch``:
a source tree that is not installed has no entry point). Nothing here imports torch before the
user does, nor any module of the collectives until a group is created: the ``linerate`` command's
subcommands that need no torch (``top``, ``flight``) start without it.
"""
from __future__ import annotations

import importlib.util
import logging
import sys

BACKEND_NAME = "linerate"
log = logging.getLogger("linerate")


def _create(dist_opts, backend_options=None):
    from linerate.collectives.backend import create_process_group  # loaded on first use
    return create_process_group(dist_opts, backend_options)


def register() -> bool:
    """Register the backend (once); return True if it is registered. Imports torch."""
    import torch.distributed as dist

    if not dist.is_available():
        return False
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return True
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                  devices=["cpu", "cuda"])
    return True


def autoload() -> None:
    """torch's entry point: register, and never make ``import torch`` fail."""
    try:
        register()
    except Exception:  # noqa: BLE001 - never break `import torch`
        log.warning("linerate: could not register the torch.distributed backend 'linerate'",
                    exc_info=True)


class _Loader:
    """torch's own loader, which registers the backend once torch's module has run."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.inner  # torch sees its own loader
        self.inner.exec_module(module)
        autoload()

    def __getattr__(self, name):  # anything else a caller asks the loader
        return getattr(self.inner, name)


class _AfterTorch:
    """A finder on ``sys.meta_path`` that finds nothing itself: when ``torch`` is first
    imported it takes torch's own spec, with a loader that registers the backend once torch
    is loaded, and leaves the path."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        _remove(self)
        spec = importlib.util.find_spec("torch")  # the other finders' answer
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec

    def invalidate_caches(self) -> None:
        pass


def _remove(finder) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def after_torch() -> None:
    """Register the backend now if torch is imported, else once it is (without importing it)."""
    if "torch" in sys.modules:
        autoload()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())


__all__ = ["BACKEND_NAME", "register", "autoload", "after_torch"]
