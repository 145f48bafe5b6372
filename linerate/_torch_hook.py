"""torch's ``torch.backends`` entry point for linerate (called during ``import torch``).

Importing ``linerate`` registers the backend and logs instead of raising; this hook adds a
last guard so that nothing of ours, not even a broken install, can make ``import torch`` fail.
"""


def autoload() -> None:
    try:
        import linerate  # noqa: F401 - registers the backend
    except Exception:  # noqa: BLE001 - never break `import torch`
        import logging
        logging.getLogger("linerate").warning(
            "linerate: could not register the torch.distributed backend 'linerate'", exc_info=True)
