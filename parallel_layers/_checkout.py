"""``parallel_layers.triton_kernels`` in a source checkout used in place (``setup.py build_ext --inplace`` and no
install, as ``gpu-check`` runs on the GPU machine): ``triton_kernels/`` sits beside the package, and only an
install maps it into it (setup.py's ``package_dir``). This finder, last on ``sys.meta_path``, maps that one name
onto the checkout's folder, so an install (editable or not) always wins."""
import importlib.abc
import importlib.util
import os
import sys

PACKAGE = __name__.rpartition(".")[0]
FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "triton_kernels")


class CheckoutTritonKernels(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        init = os.path.join(FOLDER, "__init__.py")
        if name != PACKAGE + ".triton_kernels" or not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[FOLDER])


if not any(type(f).__name__ == CheckoutTritonKernels.__name__ for f in sys.meta_path):
    sys.meta_path.append(CheckoutTritonKernels())
