"""``python -m parallel_layers demo [flags]``: see :mod:`parallel_layers.demo`."""
import sys


def _main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "demo":
        print("usage: python -m parallel_layers demo [--dp 2 --tp 2 --pp 2 --zero 0|1|2 "
              "--schedule gpipe|1f1b|interleaved --microbatches 4 --precision fp32|bf16 --steps N ...]\n"
              "       python -m parallel_layers demo --help   (all flags)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from .demo import main
    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(_main())
