"""Backward of one (stage, microbatch): whole (B), or split into I and W (zero bubble).

The split follows the autograd graph, not the modules, so it works for any layer type
(tensor-parallel ones included). Call the nodes from which the stage input can be
reached the *input path*; I runs exactly those. A node on the input path with an edge
leaving it towards parameters only (for a linear layer, the matmul node's edge to its
weight) is an *intermediate*. I records the gradient arriving at every intermediate
(a node pre-hook) and computes only the input gradient, keeping the graph alive. W then
re-enters the graph at each intermediate with the recorded gradient and asks for that
intermediate's parameters only, so autograd runs just the weight-gradient edges — the
weight matmuls — and nothing on the input path is computed twice.

W accumulates with `torch.autograd.backward(..., inputs=params)`, so `.grad` fills up
exactly as in an ordinary backward and post-accumulate hooks (the data-parallel
engine's gradient reduction) fire. A parameter reached through several intermediates
(a weight used twice) would be counted twice by that re-entry; its gradient is
computed during I instead and accumulated during W.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

Root = torch.Tensor | GradientEdge


def as_edge(root: Root) -> GradientEdge:
    return root if isinstance(root, GradientEdge) else get_gradient_edge(root)


def full_backward(roots: Sequence[Root], grads: Sequence[torch.Tensor]) -> None:
    """B: input and parameter gradients in one pass (accumulated into .grad)."""
    torch.autograd.backward([as_edge(r) for r in roots], list(grads))


class WeightPass:
    """What W needs: per intermediate, the re-entry edges, their gradients, its params."""

    def __init__(self, groups: list[tuple[list[GradientEdge], list[torch.Tensor],
                                          list[torch.Tensor]]],
                 eager: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.groups = groups
        self.eager = eager

    def run(self) -> None:
        """Accumulate every parameter gradient; the graph is released afterwards."""
        for edges, grads, params in self.groups:
            torch.autograd.backward(edges, grads, inputs=params)
        if self.eager:
            params = [p for p, _ in self.eager]
            torch.autograd.backward(params, [g for _, g in self.eager], inputs=params)
        self.groups, self.eager = [], []


def _post_order(roots: list[Node]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Every node reachable from `roots`, children before parents, and the children."""
    order: list[Node] = []
    children: dict[Node, list[Node]] = {}
    stack: list[tuple[Node, bool]] = [(n, False) for n in reversed(roots)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in children:
            continue
        kids = [c for c, _ in node.next_functions if c is not None]
        children[node] = kids
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(kids) if c not in children)
    return order, children


def backward_input(roots: Sequence[Root], grads: Sequence[torch.Tensor],
                   inputs: Sequence[torch.Tensor],
                   params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor | None],
                                                            WeightPass]:
    """I: gradients of `inputs` (None where unused); the returned WeightPass is W."""
    edges = [as_edge(r) for r in roots]
    grads = list(grads)
    inputs = [x for x in inputs if x.requires_grad]
    targets = {get_gradient_edge(x).node for x in inputs}
    param_of = {get_gradient_edge(p).node: p for p in params if p.requires_grad}
    order, children = _post_order([e.node for e in edges])

    on_path: dict[Node, bool] = {}  # reaches an input: I runs it
    below: dict[Node, dict[int, torch.Tensor]] = {}  # params under an off-path node
    for node in order:
        kids = children[node]
        on_path[node] = any(c in targets or on_path[c] for c in kids)
        if not on_path[node]:
            found = {id(param_of[node]): param_of[node]} if node in param_of else {}
            for c in kids:
                found.update(below[c])
            below[node] = found

    # Re-entry points, parents first so every rank issues W's collectives in one order.
    owners: dict[int, int] = {}  # id(param) -> number of re-entry points reaching it
    entries: list[tuple[Node | GradientEdge, dict[int, torch.Tensor]]] = []
    for edge in edges:  # a root that does not reach the input is re-entered as a whole
        if not on_path[edge.node] and below[edge.node]:
            entries.append((edge, below[edge.node]))
    for node in reversed(order):
        if not on_path[node]:
            continue
        found: dict[int, torch.Tensor] = {}
        for c in children[node]:
            if c not in targets and not on_path[c]:
                found.update(below[c])
        if found:
            entries.append((node, found))
    for _, found in entries:
        for key in found:
            owners[key] = owners.get(key, 0) + 1
    eager = [p for p in params if owners.get(id(p), 0) > 1]

    captured: dict[Node, tuple] = {}
    handles = [node.register_prehook(_capture(captured, node))
               for node, _ in entries if isinstance(node, Node)]
    wanted = inputs + eager
    try:
        result = (torch.autograd.grad(edges, wanted, grads, retain_graph=True,
                                      allow_unused=True) if wanted else ())
    finally:
        for h in handles:
            h.remove()
    input_grads = list(result[:len(inputs)])
    eager_grads = [(p, g) for p, g in zip(eager, result[len(inputs):]) if g is not None]

    groups = []
    root_grad = {id(e): g for e, g in zip(edges, grads)}
    for entry, found in entries:
        mine = [p for key, p in found.items() if owners[key] == 1]
        if not mine:
            continue
        if isinstance(entry, GradientEdge):
            groups.append(([entry], [root_grad[id(entry)]], mine))
            continue
        got = captured.get(entry, ())
        slots = [(GradientEdge(entry, i), g) for i, g in enumerate(got) if g is not None]
        if slots:
            groups.append(([e for e, _ in slots], [g for _, g in slots], mine))
    return input_grads, WeightPass(groups, eager_grads)


def _capture(store: dict, node: Node):
    def hook(grad_outputs):
        store[node] = tuple(grad_outputs)
    return hook
