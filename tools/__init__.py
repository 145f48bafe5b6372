"""Command-line tools of linerate: the ``linerate`` console script and its subcommands."""
from importlib.metadata import PackageNotFoundError, version as _dist_version


def _version() -> str:
    try:
        return _dist_version("linerate")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "0.1.0"


__version__ = _version()
