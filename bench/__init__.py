"""The maintainers' benchmarks (bench/README.md), run from the checkout's root: ``python -m bench.<script>``.

Not part of jax_ep's wheel. They import jax_ep as a user does; ``timing``, ``record``, ``ragged_baseline`` and
``copy_timing`` are the measuring tools they share.
"""
