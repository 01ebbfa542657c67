"""Microbenchmarks of parallel_layers' fused kernels against the torch code they replace.

``python -m benchmarks.kernels`` prints a table and appends rows to ``benchmarks/results/kernels.csv``;
``python -m benchmarks.plots`` draws PNGs from that CSV. These are programs that print figures, never
tests that assert a time (``tests/test_benchmarks_smoke.py`` only checks that they run).
"""
