"""The grouped matmul behind ``jax_ep.grouped_matmul``: its entry point and dispatch between paths
(``grouped_matmul``), the Mosaic GPU kernels (``mosaic``), and the padded path with its row copies."""
