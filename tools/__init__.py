"""linerate.tools: the ``linerate`` command and its subcommands (``linerate.tools.dev`` holds the
development drivers: fuzz, soak and the research benchmarks, run as ``python -m``)."""
from linerate import __version__  # noqa: F401 - ``linerate --version``
