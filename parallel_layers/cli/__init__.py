"""The command line: ``python -m parallel_layers demo`` (``demo``, ``demo_models``, ``demo_support``) and
``python3 -m parallel_layers gpu-check`` (``gpu_check``). Nothing in the library imports from here."""
