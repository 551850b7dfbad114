"""Benchmarks of jax_ep next to JAX's own exchanges and a plain peer copy: ``python -m jax_ep.bench --help``."""
