"""torch's ``torch.backends`` entry point for linerate (called during ``import torch``).

It lives outside the ``collectives`` package so that nothing in that package, not even an
import error, can make ``import torch`` fail: everything is caught and logged.
"""
import logging


def autoload() -> None:
    try:
        from collectives import _autoload
        _autoload.register()
    except Exception:  # noqa: BLE001 - never break `import torch`
        logging.getLogger("linerate").warning(
            "linerate: could not register the torch.distributed backend 'linerate'", exc_info=True)
