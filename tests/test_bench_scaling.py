"""The scaling benchmark (benchmarks/scaling.py) at smoke sizes: rows complete and sane, memory sharded as
each ZeRO stage predicts, every variant training the same model, and the plots drawn.

It asserts nothing about speed (benchmarks print figures; tests check behaviour): timings only have to be
positive and ordered (p20 <= median <= p80).
"""
import math
import os
import re
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # benchmarks/ is a top-level folder of the repo, not part of the installed package

from benchmarks import harness, scaling, scaling_plots  # noqa: E402

PLAN = scaling.PLANS["smoke"]
STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def rows():
    with pytest.MonkeyPatch.context() as mp:
        # a missing extension must fall back to the torch reference, not start a just-in-time build
        mp.setenv("PARALLEL_LAYERS_NO_JIT", "1")
        mp.delenv("PARALLEL_LAYERS_BACKEND", raising=False)
        return scaling.collect("smoke", torch.device("cpu"))


def _f(row, key):
    return float(row[key])


def _by(rows, prefix):
    """{(stage, x): row} of the rows whose case starts with prefix."""
    return {(int(r["case"][len(prefix):]), _f(r, "x")): r for r in rows if r["case"].startswith(prefix)}


def _figure(label, text):
    """The number printed after the regex ``label`` in a row's text. "nan" and "inf" count as numbers: a
    diverged run prints them, and they must reach the comparison (and fail it) rather than the regex."""
    m = re.search(label + r" ([-+]?(?:nan|inf|[0-9.e+-]+))", text)
    assert m, f"no figure after {label!r} in {text!r}"
    return float(m.group(1))


def _component(row, name):
    """MiB of one component (params, grads, optimizer) from the row's memory split."""
    return _figure(rf"\b{name}", row["baseline"])


def test_rows_complete(rows):
    required = ("run_id", "date", "mode", "case", "sizes", "dtype", "backend", "device", "torch", "triton",
                "threads", "ours_median_ms", "ours_p20_ms", "ours_p80_ms", "x", "baseline", "target", "met")
    for r in rows:
        assert set(r) <= set(harness.CSV_FIELDS), sorted(set(r) - set(harness.CSV_FIELDS))
        for k in required:
            assert r.get(k) not in ("", None), (k, r)
        assert r["mode"] == "smoke"
        med, p20, p80 = _f(r, "ours_median_ms"), _f(r, "ours_p20_ms"), _f(r, "ours_p80_ms")
        assert 0 < p20 <= med <= p80 and math.isfinite(p80), r
    assert len({r["run_id"] for r in rows}) == 1
    # every (case, sizes, dtype, backend) once: what the README keeps per run must not collide
    keys = [(r["case"], r["sizes"], r["dtype"], r["backend"]) for r in rows]
    assert len(keys) == len(set(keys))


def test_every_stage_world_and_model_present(rows):
    world = _by(rows, "scale_world_zero")
    assert set(world) == {(s, float(w)) for s in STAGES for w in PLAN["worlds"]}
    model = _by(rows, "scale_model_zero")
    xs = sorted({x for _, x in model})
    assert len(xs) == len(PLAN["widths"]) and set(model) == {(s, x) for s in STAGES for x in xs}
    for (s, _x), r in list(world.items()) + list(model.items()):
        assert _f(r, "mem_mb") > 0
        assert r["backend"].startswith("gloo x")
        if s == 0:   # stage 0 carries the torch DDP + AdamW baseline
            assert _f(r, "base_median_ms") > 0
            assert _f(r, "speedup") == pytest.approx(_f(r, "base_median_ms") / _f(r, "ours_median_ms"))
        else:
            assert r.get("base_median_ms", "") == ""


def test_every_variant_trains_the_same_model(rows):
    """Same init, same data, same AdamW: the loss curves of every stage and of torch DDP agree (a variant
    whose optimizer stepped a detached copy of the parameters would not), and the loss does fall."""
    for r in rows:
        if not r["case"].startswith(("scale_world", "scale_model")):
            continue
        diff = _figure(r"max \|loss - \w+ loss\|", r["baseline"])
        fell = _figure(r"loss fell", r["baseline"])
        assert diff < 1e-3 and fell > 1e-3, r["baseline"]


def test_memory_shards_as_the_stage_predicts(rows):
    """Per-rank bytes at world 2 against world 1 (ZeRO paper): stage 0 divides nothing; stages 1-3 divide
    the optimizer state; 2 and 3 the gradients too; 3 the parameters as well (padding: a few percent)."""
    world = _by(rows, "scale_world_zero")
    for s in STAGES:
        one, two = world[(s, 1.0)], world[(s, 2.0)]
        ratio = {c: _component(two, c) / _component(one, c) for c in ("params", "grads", "optimizer")}
        halved = {"optimizer": s >= 1, "grads": s >= 2, "params": s >= 3}
        for c, h in halved.items():
            if h:
                assert ratio[c] == pytest.approx(0.5, abs=0.06), (s, c, ratio)
            elif not (s == 1 and c == "grads"):   # stage 1: full buffer + the 1/N reduced shard
                assert ratio[c] == pytest.approx(1.0, abs=0.06), (s, c, ratio)
        if s == 0:
            assert _f(two, "mem_mb") == pytest.approx(_f(one, "mem_mb"), rel=0.06)
        else:
            assert _f(two, "mem_mb") < _f(one, "mem_mb")
        total = sum(_component(one, c) for c in ("params", "grads", "optimizer", "other"))
        assert total == pytest.approx(_f(one, "mem_mb"), rel=1e-3)
    # at one world size, each stage holds no more than the one before it
    for w in PLAN["worlds"]:
        mems = [_f(world[(s, float(w))], "mem_mb") for s in STAGES]
        assert all(a >= b * 0.999 for a, b in zip(mems, mems[1:])), (w, mems)
    # memory grows with the model
    model = _by(rows, "scale_model_zero")
    for s in STAGES:
        pts = sorted((x, _f(r, "mem_mb")) for (st, x), r in model.items() if st == s)
        assert all(b[1] > a[1] for a, b in zip(pts, pts[1:])), (s, pts)


def test_element_count_rows(rows):
    elems = [r for r in rows if r["case"].startswith("scale_elems_")]
    ns = scaling.ELEMS["smoke"]["ns"]
    for kind in ("adamw", "cast", "copy"):
        mine = sorted((_f(r, "x"), r) for r in elems if r["case"] == f"scale_elems_{kind}")
        assert [x for x, _ in mine] == [float(n) for n in ns]
        for _, r in mine:
            assert _f(r, "gbps") > 0 and _f(r, "copy_gbps") > 0
            assert _f(r, "bw_fraction") == pytest.approx(_f(r, "gbps") / _f(r, "copy_gbps"))
            if kind != "copy":
                assert _f(r, "base_median_ms") > 0 and _f(r, "speedup") > 0 and _f(r, "base_gbps") > 0


def test_plots_from_rows_and_from_csv(rows, tmp_path):
    paths = scaling_plots.draw(rows, str(tmp_path / "direct"))
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["scaling_elements.png", "scaling_model.png", "scaling_world.png"]
    for p in paths:
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    # from a CSV, smoke runs never count; a quick run does
    csv_path = str(tmp_path / "scaling.csv")
    harness.append_csv(csv_path, rows)
    assert scaling_plots.draw(csv_path, str(tmp_path / "smoke_only")) == []
    harness.append_csv(csv_path, [dict(r, mode="quick", run_id="9999") for r in rows])
    assert len(scaling_plots.draw(csv_path, str(tmp_path / "csv"))) == 3
