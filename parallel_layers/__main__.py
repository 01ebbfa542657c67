"""``python -m parallel_layers demo|bench|plan [flags]``: see :mod:`parallel_layers.cli.demo`, ``benchmarks/suite.py``
 and :mod:`parallel_layers.planner.cli`."""
import os
import sys

USAGE = ("usage: python -m parallel_layers demo [--model gpt|llama --dp 2 --tp 2 --pp 2 --zero 0|1|2|3 "
         "--schedule gpipe|1f1b|interleaved --microbatches 4 --precision fp32|bf16|fp16 --offload none|disk "
         "--steps N ...]\n"
         "       python -m parallel_layers bench [--only kernels|tp|dp|zero|pipeline|demo|scaling] "
         "[--quick|--smoke] [--readme]\n"
         "       python3 -m parallel_layers gpu-check [--out DIR] [--dry-run] [--budget S] [--only STEP]\n"
         "       python -m parallel_layers plan [--gpt L,D,H,V | --hf-config F] --world N --memory-gib G "
         "[--profile h100|a100|h200|FILE] [--json F] [--png F] | plan --calibrate FILE\n"
         "       python -m parallel_layers demo --help | bench --help | gpu-check --help   (all flags)")


def _bench_main(argv) -> int:
    """The benchmarks live in the source checkout's top-level ``benchmarks/`` folder, not in the installed
    package: they import from the directory ``python -m`` runs in, so run this from the checkout's root
    (``make bench`` does)."""
    try:
        from benchmarks import suite
    except ModuleNotFoundError as exc:
        if exc.name != "benchmarks":
            raise
        checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        where = (f"cd {checkout} && python -m parallel_layers bench"
                 if os.path.isfile(os.path.join(checkout, "benchmarks", "suite.py"))
                 else "clone the repository and run it from its root")
        print(f"python -m parallel_layers bench needs the source checkout's benchmarks/ folder on the import "
              f"path: {where}", file=sys.stderr)
        return 2
    return suite.main(argv)


def _main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("demo", "bench", "gpu-check", "plan"):
        print(USAGE)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "bench":
        return _bench_main(argv[1:])
    if argv[0] == "plan":
        from .planner.cli import main as plan
        return plan(argv[1:])
    if argv[0] == "gpu-check":
        from .cli.gpu_check import main as gpu_check
        return gpu_check(argv[1:])
    from .cli.demo import main
    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(_main())
