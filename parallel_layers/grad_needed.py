"""Whether the backward now running wants a tensor's gradient (for custom autograd Functions).

A custom ``torch.autograd.Function`` sees ``ctx.needs_input_grad``, fixed when its forward ran. A
zero-bubble pipeline (:mod:`parallel_layers.pipeline.backward_split`) runs one graph's backward in two
calls: B wants the input gradient and not the weight's, W the weight's and not the input's. A Function
that computes (or writes into a buffer) every gradient its forward allowed would do both matmuls twice,
or write a weight gradient twice. :func:`grad_needed` asks autograd's engine instead: is the node that
takes ``t``'s gradient part of this backward? Inside a full backward the answer is ``needs_input_grad``'s.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge


def grad_needed(t: torch.Tensor) -> bool:
    """True unless autograd's running backward will certainly not use ``t``'s gradient (call it inside a
    Function's backward, on a saved input; when the engine cannot tell, True: compute it as before)."""
    if t is None or not t.requires_grad:
        return True
    try:
        return bool(torch._C._will_engine_execute_node(get_gradient_edge(t).node))
    except (RuntimeError, AttributeError):
        return True


__all__ = ["grad_needed"]
