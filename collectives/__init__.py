"""linerate.collectives: algorithms over the transport, the ``linerate`` process group and the
training wrappers. Users import these from ``linerate`` (``linerate.DecentralizedDataParallel``)."""
