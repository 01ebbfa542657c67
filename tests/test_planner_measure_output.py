"""The planner's measurements print nothing of their own (``python -m parallel_layers bench`` printed a
``FutureWarning: torch.distributed.reduce_op is deprecated`` per process and a kineto ``USDT: ...
profiler_start`` / ``profiler_stop`` pair per profiled step).

* ``live_tensor_bytes`` walked ``gc.get_objects()`` with ``isinstance``, which reads ``obj.__class__``: on
  ``torch.distributed.reduce_op`` that warns. It tests ``type(obj)`` now.
* kineto writes its markers straight to file descriptor 2 on every profiler start and stop, at a severity
  above its errors: ``quiet_profile`` drops those lines and passes everything else through.

Captured at the file descriptor (``capfd``), where C++ writes."""
import os
import sys
import warnings

import torch
import torch.distributed  # noqa: F401  (its deprecated reduce_op proxy is what isinstance() tripped on)

from parallel_layers.planner.measure import _without_kineto_markers, live_tensor_bytes, step_growth


def test_live_tensor_bytes_warns_about_nothing(capfd):
    keep = torch.zeros(1000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held = live_tensor_bytes()
    assert held >= keep.nbytes
    assert [str(w.message) for w in caught] == []
    out, err = capfd.readouterr()
    assert "reduce_op" not in out + err


def test_step_growth_prints_no_kineto_markers(capfd):
    grown = step_growth(lambda: torch.ones(1000).sum(), before=lambda: torch.zeros(10))
    assert grown >= 1000 * 4
    out, err = capfd.readouterr()
    assert "USDT" not in out + err and "profiler_start" not in out + err, err


def test_the_filter_keeps_every_other_line(capfd):
    print("before", file=sys.stderr)
    with _without_kineto_markers():
        os.write(2, b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"ERROR: something kineto means\n")
        print("from python", file=sys.stderr)
    os.write(2, b"after\n")
    _, err = capfd.readouterr()
    # (capfd collects sys.stderr and the descriptor apart: their relative order is its own)
    assert sorted(err.splitlines()) == ["ERROR: something kineto means", "after", "before", "from python"], err


def test_a_block_freed_under_the_profiler_prints_no_allocator_warning():
    """torch's CPU allocator warns once a process when the profiler sees a free of a block allocated before it
    started (every measured rank of ``benchmarks.planner`` printed it); ``step_growth`` frees such blocks on
    purpose (a step frees what the one before allocated). A fresh process: the warning is once a process."""
    import subprocess
    code = ("import torch\n"
            "from parallel_layers.planner.measure import step_growth\n"
            "box = [torch.ones(100000)]\n"
            "step_growth(lambda: box.clear())\n"
            "print('done')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
    assert "allocated before the profiling started" not in proc.stderr, proc.stderr[-2000:]
