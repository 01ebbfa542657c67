"""A stage's backward in two halves, for zero-bubble schedules: B (input gradient) now, W (weight gradients) later.

Zero-bubble pipelines (Qi et al. 2024) split each backward into B, the gradient with respect to the
stage's input (on the critical path: the previous stage waits for it), and W, the gradients of the
weights (needed only before the optimizer step), so that W can fill the pipeline's idle slots.

This works on the autograd graph, for any ``nn.Module`` stage (no change to its layers):

1. the graph from the stage's outputs is walked once; a node is on the *input path* when the input's
   gradient accumulator is reachable from it. A node on that path with an edge leaving it towards a
   weight (an edge whose node is off the input path but reaches a leaf that requires grad) is a
   *boundary*: the weight branch starts there.
2. B: ``torch.autograd.grad(outputs, inputs)`` with ``retain_graph=True``. Autograd computes only the
   edges that lead to the inputs, so every weight-gradient matmul is skipped; a pre-hook on each boundary
   node keeps the gradients that arrive at it (``grad_outputs``): what the weight branch starts from.
3. W: ``torch.autograd.backward`` from those boundary edges (``GradientEdge``) with the kept gradients,
   restricted to the weights (``inputs=``), so the input path is not computed again. Gradients are
   accumulated into ``.grad`` as a plain backward does, so post-accumulate-grad hooks (data parallel
   buckets, ZeRO) fire in W, not in B. The graph is freed at the end of W. A boundary that is a plain
   ``F.linear`` (``addmm``/``mm`` of an input-path tensor and a weight's transpose, its saved tensors in
   the ledger) needs no autograd call: W computes its weight and bias gradients with the formulas the
   node uses (bit for bit) and accumulates every such gradient in one call. Each autograd call walks
   all of the graph below its boundary, so one per Linear made W quadratic in the layers of a stage
   (measured, 32 blocks of d 64 on a stage: W 25.1 ms by autograd calls, 7.1 ms direct, against 12.0 ms
   for the whole backward).

Every node computes from the same gradients and saved tensors as in one full backward, so B then W
equals the full backward bit for bit (a weight used twice in one stage accumulates its two parts in
the same order as long as there are two; tested).

Memory held between B and W: the kept boundary gradients (one per weight branch) and the forward's
saved tensors the weight branches still need. Run under a :class:`.saved_tensors.SavedTensors` ledger
(the engine does), B releases every saved tensor that only the input path used, as it goes (attention's,
the activation function's input, dropout masks): for a GPT block what stays is the Linears' inputs
(7 x d per token) and their output gradients (9 x d), about what the forward saved. Without a ledger
the whole graph's saved tensors stay until W. Norm scales and lone biases (branches of vectors only)
get their gradient in B: deferring them would keep a full activation gradient and the norm's input for
a reduction. :attr:`PendingWeightGrad.held_bytes` counts what is held; the schedule bounds how many
microbatches wait for their W (:func:`simulate`).

Activation checkpointing (torch's non-reentrant checkpoint) recomputes a segment on the first unpack of
its saved tensors in each backward call: once in B and once more in W (all of W's calls share one
recomputation, ``GraphExecGroup``), so a checkpointed stage runs its forward three times, not two. A reentrant
checkpoint is one opaque node whose own backward computes its weights' gradients: those land in B (still
exact, just not deferred).
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence

import torch
import torch.utils.checkpoint
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .saved_tensors import SavedTensors


def _leaf_node(t: torch.Tensor):
    """The gradient accumulator node of a leaf tensor that requires grad (None otherwise)."""
    if not t.requires_grad or t.grad_fn is not None:
        return None
    return get_gradient_edge(t).node


class PendingWeightGrad:
    """What W of one (microbatch, chunk) needs, kept from B: per weight branch, the boundary edges with the
    gradients that reached them, and the weights that branch writes; the gradients B already computed
    (weights shared between branches, vector-only branches); and the forward's saved tensors still held."""

    def __init__(self, branches: List[tuple], early: List[tuple], full: Optional[tuple] = None,
                 saved: Optional[SavedTensors] = None, weights: Sequence[torch.Tensor] = (),
                 linears: Sequence["_LinearW"] = ()):
        self.branches = branches   # [(edges, grads, weights)]
        self.linears = list(linears)   # weight branches of plain matmul nodes, computed without autograd
        self.early = early         # [(weight, its gradient of this microbatch, computed in B)]
        self._full = full          # (outputs, grad_outputs): no input needed a gradient, W is the whole backward
        self._saved = saved
        self._weights = list(weights)
        self._held: Optional[int] = None

    @property
    def grad_bytes(self) -> int:
        """Bytes of the gradients kept between B and W: at the weight branches' boundaries, and the weight
        gradients B computed."""
        kept = [g for _, grads, _ in self.branches for g in grads] + [g for _, g in self.early]
        kept += [lin.grad_out for lin in self.linears]
        return sum(g.numel() * g.element_size() for g in kept)

    @property
    def saved_bytes(self) -> int:
        """Bytes of the forward's saved tensors still held for W (0 when the forward ran without a
        :class:`SavedTensors` ledger: then the whole graph's are, uncounted)."""
        return 0 if self._saved is None else self._saved.held_bytes(exclude=self._weights)

    @property
    def held_bytes(self) -> int:
        """What this microbatch holds between B and W: :attr:`grad_bytes` + :attr:`saved_bytes` (counted
        once: nothing changes between B and W)."""
        if self._held is None:
            self._held = self.grad_bytes + self.saved_bytes
        return self._held

    def run(self) -> None:
        """W: accumulate the weight gradients into ``.grad`` (hooks fire here) and free the graph."""
        self._saved, self._held = None, 0
        if self._full is not None:
            outputs, grads = self._full
            self._full = None
            torch.autograd.backward(outputs, grads)
            return
        branches, early, self.branches, self.early = self.branches, self.early, [], []
        linears, self.linears = self.linears, []
        with _one_recompute():
            for edges, grads, weights in branches:
                torch.autograd.backward(edges, grads, inputs=weights)
        # each Linear's gradient accumulated as soon as computed: W holds one at a time besides .grad
        _accumulate(early)
        while linears:
            _accumulate(linears.pop(0).weight_grads())


def _accumulate(grads: List[tuple]) -> None:
    """``(weight, gradient)`` pairs into ``.grad`` through the weights' own accumulators, so their hooks run
    as in a backward (a call whose roots are the leaves themselves walks no graph)."""
    if grads:
        weights = [w for w, _ in grads]
        torch.autograd.backward(weights, [g for _, g in grads], inputs=weights)


class _LinearW:
    """W of one ``addmm``/``mm`` node whose second operand is a weight's transpose (``F.linear``): its
    weight gradient (and its bias's) computed here, with the formulas autograd's node uses, instead of
    one more autograd call. A call costs a traversal of everything below its boundary node (the whole
    stage below), so one per Linear made W's overhead grow with the square of the layers."""

    __slots__ = ("weight", "bias", "x", "grad_out", "column_major")

    def __init__(self, weight, bias, x, grad_out, column_major):
        self.weight, self.bias, self.x, self.grad_out = weight, bias, x, grad_out
        self.column_major = column_major

    def weight_grads(self) -> List[tuple]:
        dy, x = self.grad_out, self.x
        # autograd's mm_mat2_backward for mat2 = weight.t(), then TBackward's transpose
        grad_w = dy.t().mm(x) if self.column_major else x.t().mm(dy).t()
        out = [(self.weight, grad_w)]
        if self.bias is not None:     # the engine sums the broadcast bias's gradient back to its shape
            out.append((self.bias, dy.sum_to_size(self.bias.shape)))
        return out


def _linear_w(node, leaves, grads, saved: Optional[SavedTensors], to_input, computed_in_b) -> Optional[_LinearW]:
    """The :class:`_LinearW` of a boundary node when it is exactly ``addmm(bias, x, W.t())`` or
    ``mm(x, W.t())`` with ``x`` on the input path, scale factors 1, and its saved tensors in the ledger
    (not a checkpoint's, which would recompute when read outside B); None otherwise (autograd does it)."""
    name = type(node).__name__
    if saved is None or name not in ("AddmmBackward0", "MmBackward0") or not saved.saved_by(node):
        return None
    if not grads or grads[0] is None or getattr(node, "_saved_alpha", 1) != 1 or getattr(node, "_saved_beta", 1) != 1:
        return None
    nexts = [n for n, _ in node.next_functions]
    bias_node, x_node, t_node = (nexts if name == "AddmmBackward0" else [None] + nexts)
    if x_node is None or not to_input.get(x_node, False) or type(t_node).__name__ != "TBackward0":
        return None
    w_node = t_node.next_functions[0][0]
    weight = getattr(w_node, "variable", None)
    bias = getattr(bias_node, "variable", None) if bias_node is not None else None
    if weight is None or weight.dim() != 2 or (bias_node is not None and bias is None):
        return None
    if {id(leaf.variable) for leaf in leaves} != {id(t) for t in (weight, bias) if t is not None}:
        return None
    if any(leaf in computed_in_b for leaf in leaves):
        return None
    sizes = tuple(int(v) for v in node._saved_mat2_sym_sizes)
    strides = tuple(int(v) for v in node._saved_mat2_sym_strides)
    x = node._saved_mat1 if name == "AddmmBackward0" else node._saved_self
    return _LinearW(weight, bias, x, grads[0], strides[0] == 1 and strides[1] == sizes[0])


def _one_recompute() -> contextlib.ExitStack:
    """A context in which torch's non-reentrant checkpoint recomputes each segment once for all of W's
    backward calls (one per weight branch, over disjoint parts of the graph), not once per call:
    ``torch.utils.checkpoint.GraphExecGroup`` (a no-op where torch lacks it or the caller opened one)."""
    scope = contextlib.ExitStack()
    group_type = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    if group_type is not None:
        try:
            scope.enter_context(group_type())
        except RuntimeError:          # groups do not nest: the caller's holds W's calls already
            pass
    return scope


def _leaves_below(nodes) -> List:
    """The leaf accumulators reachable from ``nodes``, in a stable order."""
    seen, out, stack = set(), [], list(nodes)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            out.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return out


def _reaches(roots, targets) -> Dict[object, bool]:
    """For every node reachable from ``roots``: does it reach one of ``targets``? (iterative post-order)"""
    memo: Dict[object, bool] = {}
    for root in roots:
        if root is None or root in memo:
            continue
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                memo[node] = node in targets or any(memo.get(n, False) for n, _ in node.next_functions
                                                    if n is not None)
                continue
            if node in memo:
                continue
            memo[node] = False                       # (a graph has no cycles; marks "being visited")
            stack.append((node, True))
            stack.extend((n, False) for n, _ in node.next_functions if n is not None and n not in memo)
    return memo


def backward_input(outputs: Sequence[torch.Tensor], grad_outputs: Sequence[Optional[torch.Tensor]],
                   inputs: Sequence[torch.Tensor], saved: Optional[SavedTensors] = None) -> tuple:
    """B of one stage: returns ``(input gradients, PendingWeightGrad)``. ``outputs``/``grad_outputs`` as
    for ``torch.autograd.backward`` (a scalar loss: grad None); ``inputs``: the stage's inputs (leaves that
    require grad; an input that does not gets None). Run ``PendingWeightGrad.run()`` later for W.
    ``saved``: the ledger the stage's forward ran under (:class:`.saved_tensors.SavedTensors`); the saved
    tensors only the input path used are released after B.

    Each boundary's weight branch runs in W as its own backward restricted to that branch's weights, so
    autograd computes nothing on the input path again. Two kinds of weights get their gradient in B
    instead (as inputs of the ``autograd.grad`` call), accumulated into ``.grad`` in W:

    * a weight that two branches reach (used twice in the stage): W would give it one branch's part
      twice (through the input path);
    * the weights of a branch that has only vectors (norm scales and shifts, a lone bias): their
      gradient is a reduction over the tokens, cheap on the critical path, while deferring it would keep
      a full activation gradient and the norm's input until W (as Megatron-LM defers only the weight
      GEMMs)."""
    outputs, grad_outputs = list(outputs), list(grad_outputs)
    in_nodes = {n for n in (_leaf_node(x) for x in inputs) if n is not None}
    if not in_nodes:            # nothing to send back (the first stage): all of the backward is W
        weights = [leaf.variable for leaf in _leaves_below([o.grad_fn for o in outputs])]
        return [None] * len(inputs), PendingWeightGrad([], [], (outputs, grad_outputs), saved, weights)
    roots = [o.grad_fn for o in outputs]
    to_input = _reaches(roots, in_nodes)
    # boundaries: nodes on the input path with edges leaving it towards weights (their branch), and
    # outputs that lie off the input path altogether (a loss term of the weights alone)
    branch_of: Dict[object, List] = {}
    for n, on_path in to_input.items():
        if on_path and not hasattr(n, "variable"):
            off = [c for c, _ in n.next_functions if c is not None and not to_input.get(c, False)]
            leaves = _leaves_below(off)
            if leaves:
                branch_of[n] = leaves
    early_nodes = []            # weights whose gradient B computes
    for n in [n for n, leaves in branch_of.items() if all(leaf.variable.dim() <= 1 for leaf in leaves)]:
        early_nodes += branch_of.pop(n)
    off_roots = [(o, g) for o, g in zip(outputs, grad_outputs) if o.grad_fn is not None
                 and not to_input.get(o.grad_fn, False)]
    root_leaves = [_leaves_below([o.grad_fn]) for o, _ in off_roots]
    count: Dict[object, int] = {}
    for leaves in list(branch_of.values()) + root_leaves:
        for leaf in leaves:
            count[leaf] = count.get(leaf, 0) + 1
    early_nodes = list(dict.fromkeys(early_nodes + [leaf for leaf, k in count.items() if k > 1]))
    early_set = set(early_nodes)
    kept: Dict[object, tuple] = {}
    handles = [n.register_prehook(lambda grads, n=n: kept.__setitem__(n, grads)) for n in branch_of]
    try:
        # every output with a graph: an off-path output's part of an early weight is computed here too
        live = [(o, g) for o, g in zip(outputs, grad_outputs) if o.grad_fn is not None]
        wanted = [x for x in inputs if _leaf_node(x) is not None]
        early_w = [leaf.variable for leaf in early_nodes]
        # what only the input path uses can go: W never runs those nodes
        releasable = {n for n, on in to_input.items() if on} - set(branch_of)
        with saved.recording(releasable) if saved is not None else contextlib.nullcontext():
            got = torch.autograd.grad([o for o, _ in live], wanted + early_w, [g for _, g in live],
                                      retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    if saved is not None:
        saved.release_only_used_by(releasable, "used by the input gradient only, after B")
    by_input = dict(zip(map(id, wanted), got[:len(wanted)]))
    early = [(w, g) for w, g in zip(early_w, got[len(wanted):]) if g is not None]
    linears = []
    for node in list(branch_of):
        lin = _linear_w(node, branch_of[node], kept.get(node), saved, to_input, early_set)
        if lin is not None:
            linears.append(lin)
            del branch_of[node]
    branches = []
    for node, leaves in branch_of.items():
        weights = [leaf.variable for leaf in leaves if leaf not in early_set]
        edges = [(GradientEdge(node, i), g) for i, g in enumerate(kept.get(node, ())) if g is not None]
        if weights and edges:
            branches.append(([e for e, _ in edges], [g for _, g in edges], weights))
    for (o, g), leaves in zip(off_roots, root_leaves):
        weights = [leaf.variable for leaf in leaves if leaf not in early_set]
        if weights:
            branches.append(([get_gradient_edge(o)], [torch.ones_like(o) if g is None else g], weights))
    all_weights = [w for _, _, ws in branches for w in ws] + early_w
    all_weights += [t for lin in linears for t in (lin.weight, lin.bias) if t is not None]
    return [by_input.get(id(x)) for x in inputs], PendingWeightGrad(branches, early, None, saved, all_weights,
                                                                    linears)


def split_backward(outputs, grad_outputs, inputs):
    """B then W at once (tests: equals ``torch.autograd.backward`` plus the inputs' gradients)."""
    in_grads, pending = backward_input(outputs, grad_outputs, inputs)
    pending.run()
    return in_grads


__all__ = ["PendingWeightGrad", "backward_input", "split_backward"]
