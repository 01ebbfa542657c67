"""triton 3.6's interpreter (``TRITON_INTERPRET=1``) under numpy >= 2.4: a loop with a runtime bound
(``range(0, tl.cdiv(K, BLOCK_K))``, ``tl.range(0, n)``) calls the bound's ``__index__``, which the interpreter
defines as ``int(data)`` on a one-element 1-D array; numpy 2.4 made that conversion an error ("only 0-dimensional
arrays can be converted to Python scalars"), so every such kernel failed. triton 3.9 takes
``int(data.squeeze())``; this backports that one line, and only where the installed interpreter still has the
old form (the GPU machine's image has triton 3.6 with numpy 2.5). Compiled kernels are not touched."""
import inspect

OLD_INDEX = "int(self.handle.data))"


def patch_interpreter_index() -> bool:
    """Make the interpreter's tensor ``__index__`` work with numpy >= 2.4; True if it needed the patch."""
    try:
        from triton.runtime import interpreter
        original = interpreter._patch_lang_tensor
        if getattr(original, "_parallel_layers_patched", False):
            return True
        if OLD_INDEX not in inspect.getsource(original):
            return False
    except (ImportError, AttributeError, OSError, TypeError):
        return False

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._parallel_layers_patched = True
    interpreter._patch_lang_tensor = patched
    return True


patch_interpreter_index()
