"""The maintainers' tools that tests drive (tools/README.md), run from the checkout's root: ``python -m tools.<tool>``.

Not part of jax_ep's wheel."""
