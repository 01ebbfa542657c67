"""The guides keep their promises: the runnable examples of the README and docs/building_blocks.md run,
docs/architecture.md's module map names every module, and no link in the docs points outside the repository.

A runnable example is a python block with a marker on the line before it::

    <!-- runnable: 2 ranks -->
    ```python
    ...
    ```

and is a whole script, as ``torchrun --nproc-per-node 2 script.py`` runs it: every rank is a fresh
``python script.py`` process with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), one thread each, started outside the checkout so it uses
the installed package. Every example's ranks start at once (the imports dominate, and they overlap),
and each rank must exit 0 within TIMEOUT_S.
"""
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List

import pytest

from parallel_layers.testing.workers import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
ARCHITECTURE = os.path.join(REPO, "docs", "architecture.md")
EXAMPLE_DOCS = [README, os.path.join(REPO, "docs", "building_blocks.md")]
DOCS = [README, os.path.join(REPO, "benchmarks", "README.md")] + sorted(
    os.path.join(REPO, "docs", f) for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md"))
TIMEOUT_S = 180
MARKER = re.compile(r"^<!-- runnable: (\d+) ranks? -->\n```python\n(.*?)^```", re.M | re.S)
# What the guides must show running: an API named here that no runnable example uses fails the test.
SHOWN_RUNNING = ["ParallelMesh(tp=", "DataParallel(", "ZeroOptimizer(", "ZeroStage3(", "ZeroStage3Optimizer(",
                 ".no_sync()", "opt.clip_grad_norm_(", "PipelineEngine(", "split_model(", "FusedAdamW(",
                 "Parallel3D(model, mesh, loss_fn="]


@dataclass
class Example:
    line: int          # of the marker, 1-based
    ranks: int
    code: str
    doc: str = "README.md"

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def runnable_examples(text: str, doc: str = "README.md") -> List[Example]:
    return [Example(text.count("\n", 0, m.start()) + 1, int(m.group(1)), m.group(2), doc)
            for m in MARKER.finditer(text)]


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


EXAMPLES = [e for doc in EXAMPLE_DOCS for e in runnable_examples(_read(doc), os.path.relpath(doc, REPO))]


def test_the_marker_parser_finds_marked_blocks_only():
    text = ("intro\n<!-- runnable: 2 ranks -->\n```python\nprint(1)\n```\n\n```python\nnot marked\n```\n"
            "<!-- runnable: 1 rank -->\n```python\nx = 1\ny = 2\n```\n")
    found = runnable_examples(text)
    assert [(e.line, e.ranks, e.code) for e in found] == [(2, 2, "print(1)\n"), (10, 1, "x = 1\ny = 2\n")]


def test_the_readme_runs_what_it_teaches():
    missing = [api for api in SHOWN_RUNNING if not any(api in e.code for e in EXAMPLES)]
    assert not missing, f"no runnable example of README.md or docs/building_blocks.md uses {missing}; mark one"


PORT_CLASH = "address already in use"     # another process took the free port before rank 0 bound it


class _Run:
    """One example's ranks: fresh ``python script.py`` processes, output to a file per rank."""

    def __init__(self, example: Example, workdir: str, attempt: int):
        self.example = example
        stem = re.sub(r"[^A-Za-z0-9]+", "_", example.name)
        script = os.path.join(workdir, f"{stem}.py")
        with open(script, "w") as fh:
            fh.write(example.code)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(example.ranks),
                   LOCAL_WORLD_SIZE=str(example.ranks), OMP_NUM_THREADS="1")
        self.logs = [os.path.join(workdir, f"{stem}.try{attempt}.rank{r}.log")
                     for r in range(example.ranks)]
        self.procs = []
        for rank, log in enumerate(self.logs):
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen([sys.executable, script], cwd=workdir, stdout=out,
                                                   stderr=subprocess.STDOUT,
                                                   env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))

    def failed_rank(self) -> bool:
        return any(p.poll() not in (None, 0) for p in self.procs)

    def finished(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def stop(self) -> None:
        """The other ranks of a failed run would wait for the failed one until their timeout."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def results(self) -> List[tuple]:
        out = []
        for p, log in zip(self.procs, self.logs):
            with open(log) as fh:
                out.append((p.returncode, fh.read()))
        return out


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory) -> Dict[int, List[tuple]]:
    """Every runnable example, all started at once: name -> [(exit status, output) per rank]. A run whose
    rendezvous port was taken by another process in the meantime is started again on another port."""
    workdir = str(tmp_path_factory.mktemp("readme_examples"))
    running = {e.name: _Run(e, workdir, 0) for e in EXAMPLES}
    attempts = {e.name: 0 for e in EXAMPLES}
    deadline = time.monotonic() + TIMEOUT_S
    results = {}
    while running:
        for name, run in list(running.items()):
            if not (run.finished() or run.failed_rank() or time.monotonic() > deadline):
                continue
            timed_out = not run.finished() and not run.failed_rank()
            run.stop()
            outcome = run.results()
            if any(status != 0 and PORT_CLASH in out for status, out in outcome) and attempts[name] < 2:
                attempts[name] += 1
                running[name] = _Run(run.example, workdir, attempts[name])
                continue
            del running[name]
            results[name] = [(f"killed after {TIMEOUT_S} s" if timed_out and status != 0 else status, out)
                             for status, out in outcome]
        time.sleep(0.2)
    return results


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_readme_example_runs(example, example_runs):
    failed = [f"rank {rank} of {example.ranks}: exit {status} (-9: stopped after another rank failed)\n"
              f"{out[-3000:]}" for rank, (status, out) in enumerate(example_runs[example.name]) if status != 0]
    assert not failed, f"{example.name}:\n" + "\n".join(failed)


# ---------------------------------------------------------------------- the module map
def _module_map(text: str) -> str:
    start = text.index("\n## Module map")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def _modules() -> List[str]:
    """Every source file a reader may look for, relative to the repo (package __init__ files aside)."""
    found = []
    for top, exts in (("parallel_layers", (".py",)), ("triton_kernels", (".py",)), ("benchmarks", (".py",)),
                      ("csrc", (".cpp", ".h", ".cu", ".cuh"))):
        for folder, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(exts) and f != "__init__.py":
                    found.append(os.path.relpath(os.path.join(folder, f), REPO))
    return sorted(found)


def _named(path: str, section: str) -> bool:
    """The map names a file by its path, or by its name (or a Python module's stem) in a bullet that
    names its folder (a bullet runs to the next one)."""
    folder, name = os.path.split(path)
    if f"`{path}`" in section:
        return True
    stem = name[:-3] if name.endswith(".py") else name
    bullets = re.split(r"\n(?=- |\*\*|\n)", section)
    return any(f"`{folder}/`" in b and (f"`{name}`" in b or f"`{stem}`" in b) for b in bullets)


def test_the_module_map_names_every_module():
    section = _module_map(_read(ARCHITECTURE))
    modules = _modules()
    assert len(modules) > 50, modules
    missing = [m for m in modules if not _named(m, section)]
    assert not missing, f"docs/architecture.md's module map does not name {missing}"


# ---------------------------------------------------------------------- links stay inside the repo
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=[os.path.relpath(d, REPO) for d in DOCS])
def test_every_relative_link_resolves_inside_the_repo(doc):
    broken = []
    for target in LINK.findall(_read(doc)):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = os.path.normpath(os.path.join(os.path.dirname(doc), target.split("#")[0]))
        if not path.startswith(REPO + os.sep) or not os.path.exists(path):
            broken.append(target)
    assert not broken, f"{os.path.relpath(doc, REPO)} links to {broken}"
