"""``python -m parallel_layers demo|bench|plan [flags]``: see :mod:`parallel_layers.cli.demo`, ``benchmarks/suite.py``
 and :mod:`parallel_layers.planner.cli`."""
import importlib.util
import os
import subprocess
import sys

from .dimensions import in_reading_order
from .pipeline.schedules import schedule_names

USAGE = ("usage: python -m parallel_layers demo [--model gpt|llama "
         + " ".join(f"--{name} N" for name, _ in in_reading_order({})) + " --zero 0|1|2|3 "
         f"--schedule {'|'.join(schedule_names())} --microbatches 4 --precision fp32|bf16|fp16 --offload none|disk "
         "--steps N ...]\n"
         "       python -m parallel_layers bench [--only kernels|tp|dp|zero|pipeline|demo|scaling] "
         "[--quick|--smoke] [--readme]\n"
         "       python3 -m parallel_layers gpu-check [--out DIR] [--dry-run] [--budget S] [--only STEP]\n"
         "       python -m parallel_layers plan [--gpt L,D,H,V | --hf-config F] --world N --memory-gib G "
         "[--profile h100|a100|h200|FILE] [--json F] [--png F] | plan --calibrate FILE\n"
         "       python -m parallel_layers demo --help | bench --help | gpu-check --help   (all flags)")


def _benchmarks_root():
    """The folder that holds the checkout's ``benchmarks/`` (with ``suite.py``): the one on the import path
    (``python -m`` from the checkout's root puts it there), else the one beside this package's folder (an
    uninstalled or editable checkout); None outside a checkout. Found, not imported: the installed package
    imports nothing of ``benchmarks/``, which is not part of it."""
    spec = importlib.util.find_spec("benchmarks")
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    places.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    for place in places:
        if os.path.isfile(os.path.join(place, "suite.py")):
            return os.path.dirname(os.path.abspath(place))
    return None


def _bench_main(argv) -> int:
    """The benchmarks live in the source checkout's top-level ``benchmarks/`` folder, not in the installed
    package: ``python -m benchmarks.suite`` runs in a child process with that checkout on its import path
    (``make bench`` runs this from the checkout's root)."""
    root = _benchmarks_root()
    if root is None:
        print("python -m parallel_layers bench needs the source checkout's benchmarks/ folder: clone the "
              "repository and run it from its root", file=sys.stderr)
        return 2
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""))
    return subprocess.call([sys.executable, "-m", "benchmarks.suite", *argv], env=env)


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
