"""A fake pyverbs (rdma-core 44's API) for linerate's tests; see tests/fake_pyverbs/README.md."""
FAKE = True
