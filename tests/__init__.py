"""jax_ep's tests, run from the checkout's root (``python -m pytest``); tools/ and bench/ import their helpers as
``tests.reference``, ``tests.helpers`` and ``tests.conftest``."""
