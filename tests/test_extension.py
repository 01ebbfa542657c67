"""The compiled extension is optional: without it the package imports, warns once and stays correct.

These run in subprocesses so that hiding ``parallel_layers._C`` does not affect other tests.
"""
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Makes `from parallel_layers import _C` fail as if the extension had never been built.
HIDE_PREBUILT = textwrap.dedent("""
    import importlib.abc, sys
    class _HidePrebuilt(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "parallel_layers._C":
                raise ImportError("hidden by the test")
            return None
    sys.meta_path.insert(0, _HidePrebuilt())
""")


def run_python(code, **env):
    full_env = dict(os.environ, PYTHONPATH=REPO, **env)
    full_env.pop("PARALLEL_LAYERS_BACKEND", None)
    return subprocess.run([sys.executable, "-c", HIDE_PREBUILT + textwrap.dedent(code)], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=900)


def test_no_extension_falls_back_to_reference_with_one_warning():
    result = run_python("""
        import warnings, torch
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            import parallel_layers
            from parallel_layers import ops
            ts = [torch.randn(5), torch.randn(7)]
            bucket = ops.pack_bucket(ts, dtype=torch.bfloat16)
            ops.pack_bucket(ts, dtype=torch.bfloat16)
            ops.unscale_and_norm(ts)
        assert torch.equal(bucket, torch.cat(ts).bfloat16())
        msgs = [str(w.message) for w in caught if "no fused kernel backend" in str(w.message)]
        assert len(msgs) == 1, msgs
        assert "hidden by the test" in msgs[0] and "PARALLEL_LAYERS_NO_JIT" in msgs[0], msgs[0]
        try:
            ops.pack_bucket(ts, backend="cpp")
        except RuntimeError as exc:
            assert "backend 'cpp' was forced but cannot run" in str(exc), exc
        else:
            raise AssertionError("forcing an unavailable backend must raise")
        print("OK")
    """, PARALLEL_LAYERS_NO_JIT="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def test_failed_jit_build_is_a_warning_not_a_crash(tmp_path):
    # A compiler that always fails: the build error must become a fallback with the reason.
    result = run_python("""
        import warnings, torch
        from parallel_layers import ops
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = ops.multi_tensor_cast([torch.randn(3)], dtype=torch.float16)
        msgs = [str(w.message) for w in caught]
        assert any("just-in-time build failed" in m for m in msgs), msgs
        print("OK")
    """, CXX="/bin/false", CC="/bin/false", PARALLEL_LAYERS_CACHE=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


@pytest.mark.skipif(os.environ.get("PARALLEL_LAYERS_SKIP_JIT_TEST") == "1", reason="PARALLEL_LAYERS_SKIP_JIT_TEST=1")
def test_jit_build_when_not_prebuilt(tmp_path):
    """Without a pre-built _C the first use compiles csrc/ into a cache and the cpp backend runs."""
    cache = os.environ.get("PARALLEL_LAYERS_TEST_JIT_CACHE", str(tmp_path))
    result = run_python("""
        import torch
        from parallel_layers import ops, _extension
        ext, why = _extension.load()
        assert ext is not None, why
        assert "parallel_layers_C" in ext.__name__
        assert ops.resolve_backend("pack_bucket", torch.device("cpu")) == "cpp"
        ts = [torch.randn(1000), torch.randn(3)]
        assert torch.equal(ops.pack_bucket(ts, backend="cpp"), torch.cat(ts))
        print("OK")
    """, PARALLEL_LAYERS_CACHE=cache, MAX_JOBS="2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def test_import_never_needs_triton_or_the_extension():
    result = run_python("""
        import sys
        sys.modules["triton"] = None  # as if triton were not installed
        import parallel_layers
        print(parallel_layers.__version__)
    """, PARALLEL_LAYERS_NO_JIT="1")
    assert result.returncode == 0, result.stderr


def test_cuda_home_is_the_toolkit_not_a_wrapper_script(tmp_path, monkeypatch):
    """An nvcc wrapper script in a bin/ folder of its own (the GPU image's /usr/local/bin) must not make
    its parent the toolkit, as torch's guess does; CUDA_HOME, when set, wins."""
    from parallel_layers._extension import find_cuda_home

    wrapper = tmp_path / "local" / "bin"
    wrapper.mkdir(parents=True)
    (wrapper / "nvcc").write_text("#!/bin/sh\nexec /opt/toolkit/bin/nvcc \"$@\"\n")
    (wrapper / "nvcc").chmod(0o755)
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "include").mkdir()
    (toolkit / "bin" / "nvcc").write_text("")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(wrapper))
    assert find_cuda_home(roots=[str(toolkit)]) == str(toolkit)
    assert find_cuda_home(roots=[]) is None                     # the wrapper's parent is no toolkit
    (wrapper / "nvcc").unlink()                                  # nvcc on the PATH inside a real toolkit
    monkeypatch.setenv("PATH", str(toolkit / "bin"))
    assert find_cuda_home(roots=[]) == str(toolkit)
    monkeypatch.setenv("CUDA_HOME", "/somewhere/else")
    assert find_cuda_home(roots=[str(toolkit)]) == "/somewhere/else"
