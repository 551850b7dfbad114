"""The EP ops: the contract (``ops``), its checks and types, the routing layout, FP8 rows, the CUDA groups, and one
module per backend (``xla``, ``cuda``). The public names are re-exported by ``jax_ep``."""
