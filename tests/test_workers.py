"""The worker pool finds a rank's function by module name without shadowing installed packages, and destroys
the process groups a body leaves behind (each gloo group keeps a thread polling) but not those still held."""
import os
import subprocess
import sys
import textwrap


def test_a_package_module_is_resolved_without_putting_its_folder_first_on_sys_path(tmp_path):
    """``benchmarks/kernels.py`` once shadowed the ``kernels`` package that transformers probes for, so
    ``from transformers import LlamaConfig`` failed on every rank of ``bench --quick``'s torch_native_3d."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("def body():\n    return 'found'\n")
    (pkg / "json.py").write_text("raise ImportError('pkg/json.py shadowed the standard library json')\n")
    code = textwrap.dedent(f"""
        import sys
        from parallel_layers.testing.workers import _resolve
        fn = _resolve("pkg.mod", {str(pkg / "mod.py")!r}, "body")
        assert fn() == "found"
        assert {str(pkg)!r} not in sys.path, sys.path
        sys.modules.pop("json", None)
        import json
        assert not json.__file__.startswith({str(pkg)!r}), json.__file__
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path.parent))
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_a_test_module_is_still_resolved_from_its_folder(tmp_path):
    (tmp_path / "test_thing.py").write_text("import helper_mod\n\ndef body():\n    return helper_mod.VALUE\n")
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    code = textwrap.dedent(f"""
        from parallel_layers.testing.workers import _resolve
        assert _resolve("test_thing", {str(tmp_path / "test_thing.py")!r}, "body")() == 7
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


_HELD: dict = {}


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def body_make_groups(rank, world, hold):
    import torch
    import torch.distributed as dist

    for _ in range(4):
        group = dist.new_group(list(range(world)))
        dist.all_reduce(torch.ones(1), group=group)
    if hold:
        _HELD[len(_HELD)] = group               # a plain dict (not tracked by the cyclic collector) keeps one
    return _threads()


def body_after(rank, world):
    import torch
    import torch.distributed as dist

    for group in _HELD.values():                # still usable: the pool left it alone
        dist.all_reduce(torch.ones(1), group=group)
    return _threads(), len(_HELD)


def test_groups_a_body_leaves_behind_are_destroyed_and_held_ones_kept(dist_pools):
    pool = dist_pools(2, "gloo")
    pool.run(body_after)                        # the count before the bodies below
    before = [t for t, _ in pool.run(body_after)]
    during = pool.run(body_make_groups, False)
    assert all(d > b for d, b in zip(during, before)), (before, during)
    after = [t for t, _ in pool.run(body_after)]
    assert after == before, (before, after)
    pool.run(body_make_groups, True)
    held = pool.run(body_after)
    assert all(n >= 1 for _, n in held)
    assert all(t > b for (t, _), b in zip(held, before)), (before, held)
