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
computed during I instead and accumulated during W. So are the parameters of a
compiled region (`torch.compile`): its backward is one node for the whole region, which
must run once (`runs_whole`).

Keeping the graph alive from I to W would keep every tensor the forward saved, though W
runs only the weight-gradient nodes (a linear layer's matmul: its input, and the
gradient I recorded). A forward run inside `ForwardSaves` stores what autograd saves in
slots; given them, I empties every slot no node of W can read, so between I and W a
microbatch holds what the zero-bubble paper counts for W and nothing more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch._functorch.config
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

Root = torch.Tensor | GradientEdge


def as_edge(root: Root) -> GradientEdge:
    return root if isinstance(root, GradientEdge) else get_gradient_edge(root)


def full_backward(roots: Sequence[Root], grads: Sequence[torch.Tensor]) -> None:
    """B: input and parameter gradients in one pass (accumulated into .grad)."""
    torch.autograd.backward([as_edge(r) for r in roots], list(grads))


class _Slot:
    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value


_RELEASED = object()


class ForwardSaves:
    """Every tensor autograd saves inside the context, each in a slot I can empty.

    Saved-tensor hooks already active (a user's `torch.autograd.graph.save_on_cpu`, the
    activation meter) still apply: a tensor goes through them first, and the slot holds
    what they return. A block wrapped in torch's own checkpoint saves through its hooks,
    not these; it keeps its (small) saved inputs until W, and reading W's nodes there
    would recompute the block, so do not combine the two.
    """

    def __init__(self) -> None:
        self.slots: list[_Slot] = []
        self._probe: set[int] | None = None
        self._outer = None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> ForwardSaves:
        # The hooks in force outside (torch keeps a stack and lets the innermost win).
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> _Slot:
        # A detached alias, not `t`: a node saving its own output would otherwise hold
        # the output, which holds the node (grad_fn), a cycle through C++ that the
        # garbage collector cannot see; the graph would outlive W (six tensors per
        # microbatch of the test model leaked so).
        slot = _Slot(self._outer[0](t) if self._outer else t.detach())
        self.slots.append(slot)
        return slot

    def _unpack(self, slot: _Slot) -> torch.Tensor:
        if self._probe is not None:  # only asking which slots a node reads
            self._probe.add(id(slot))
            return _EMPTY
        if slot.value is _RELEASED:
            raise RuntimeError(
                "partita: a weight-gradient pass read a saved tensor released after the "
                "input-gradient pass; this is a bug in partita.pipeline.backward")
        return self._outer[1](slot.value) if self._outer else slot.value

    def keep_only(self, nodes: Sequence[Node]) -> None:
        """Empty every slot none of `nodes` reads (they are the nodes W will run)."""
        self._probe = read = set()
        try:
            for node in nodes:
                for name in _saved_names(node):
                    getattr(node, name)
        finally:
            self._probe = None
        for slot in self.slots:
            if id(slot) not in read:
                slot.value = _RELEASED
        self.slots = []


_EMPTY = torch.empty(0)
_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(node: Node) -> tuple[str, ...]:
    """The attributes through which a node's saved tensors are read (unpacking them):
    `_saved_<name>` on torch's nodes, `saved_tensors` on a custom Function's."""
    kind = type(node)
    names = _SAVED_NAMES.get(kind)
    if names is None:
        names = tuple(n for n in dir(node) if n.startswith("_saved_")
                      and not n.endswith(("_sym_sizes", "_sym_strides")))
        if hasattr(node, "saved_tensors"):
            names += ("saved_tensors",)
        _SAVED_NAMES[kind] = names
    return names


class WeightPass:
    """What W needs: per intermediate, the re-entry edges, their gradients, its params."""

    def __init__(self, groups: list[tuple[list[GradientEdge], list[torch.Tensor],
                                          list[torch.Tensor]]],
                 eager: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.groups = groups
        self.eager = eager

    @property
    def nbytes(self) -> int:
        """The recorded gradients held until `run`."""
        grads = [g for _, gs, _ in self.groups for g in gs] + [g for _, g in self.eager]
        return sum(g.numel() * g.element_size() for g in grads)

    def run(self) -> None:
        """Accumulate every parameter gradient; the graph is released afterwards.

        A linear layer's weight gradient, and a norm's scale (`_direct_weight_grad`), is
        formed here without autograd. Where `.grad` can take it in place (present, and no
        hook to see the difference: `_adds_in_place`), the matmul accumulates into it
        (`addmm_`) and the norm's sum is added; autograd would have allocated each
        gradient and added it in a second pass (1.7 of 11.3 ms of W for 2 Llama blocks
        of bench pp's size, measured). The rest accumulate in one autograd call, so hooks
        fire: re-entering autograd once per layer made W 30% slower than the same matmuls
        inside a full backward on CPU, because every call first walks the whole graph
        below its root (16 Llama blocks, 144 calls: W 188 ms, where a full backward took
        145 ms more than one computing the input gradient alone)."""
        leaves = list(self.eager)
        with torch.no_grad():
            for edges, grads, params in self.groups:
                into = params[0].grad if len(params) == 1 and _adds_in_place(params[0]) \
                    else None
                grad = _direct_weight_grad(edges, grads, params, into)
                if grad is None:
                    torch.autograd.backward(edges, grads, inputs=params)
                elif grad is not into:
                    leaves.append((params[0], grad))
        if leaves:
            params = [p for p, _ in leaves]
            torch.autograd.backward(params, [g for _, g in leaves], inputs=params)
        self.groups, self.eager = [], []

    def take(self, params: Sequence[torch.Tensor]) -> WeightPass:
        """Move the part of this pass that computes only gradients of `params` into a
        pass of its own (run it first or later: the two share no node)."""
        ids = {id(p) for p in params}
        mine = [all(id(p) in ids for p in group[2]) for group in self.groups]
        taken = WeightPass([g for g, m in zip(self.groups, mine) if m],
                           [(p, g) for p, g in self.eager if id(p) in ids])
        self.groups = [g for g, m in zip(self.groups, mine) if not m]
        self.eager = [(p, g) for p, g in self.eager if id(p) not in ids]
        return taken

    def gradients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """As `run`, but return (parameter, gradient) pairs instead of accumulating
        them into .grad. Every group re-enters autograd here (no direct path):
        running the node releases its saved input at once, which the zero-bubble head
        pass counts on (`PipelineRunner._early_weight_params`)."""
        out = list(self.eager)
        for edges, grads, params in self.groups:
            found = torch.autograd.grad(edges, params, grads, allow_unused=True)
            out += [(p, g) for p, g in zip(params, found) if g is not None]
        self.groups, self.eager = [], []
        return out


def _adds_in_place(param: torch.Tensor) -> bool:
    """`.grad` can take a gradient by an in-place add with the same result autograd's
    accumulation gives: it exists, is dense, of the parameter's shape and dtype, outside
    any graph, and no tensor hook (which would see or change the incoming gradient) or
    post-accumulate hook (the data-parallel engine's, counting arrivals) is registered."""
    grad = param.grad
    return (grad is not None and grad.layout == torch.strided and grad.shape == param.shape
            and grad.dtype == param.dtype and not grad.requires_grad
            and not param._backward_hooks and not param._post_accumulate_grad_hooks)


def _direct_weight_grad(edges: list[GradientEdge], grads: list[torch.Tensor],
                        params: list[torch.Tensor], into: torch.Tensor | None = None,
                        ) -> torch.Tensor | None:
    """The gradient of the one parameter below a re-entry point, formed without autograd
    for the two commonest points, as autograd would form it (bitwise, without `into`);
    None for any other (W then re-enters autograd there). With `into` (the parameter's
    .grad, see `_adds_in_place`) the gradient is added to it and `into` returned."""
    if len(edges) != 1 or len(params) != 1 or edges[0].output_nr != 0:
        return None
    node, kind = edges[0].node, type(edges[0].node).__name__
    if kind == "MmBackward0":
        return _linear_weight_grad(node, grads[0], params[0], into)
    if kind == "MulBackward0":
        grad = _scale_grad(node, grads[0], params[0])
        return grad if grad is None or into is None else into.add_(grad)
    return None


def _scale_grad(node: Node, grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor | None:
    """The gradient of a per-channel scale, `x * weight` with `weight` of the last
    dimension's size (an RMS norm's weight): `grad * x` summed over the broadcast
    dimensions, as torch's mul backward and then `sum_to` (the engine's reduction to the
    input's shape: one `sum` over the leading dimensions, keepdim, then a view)."""
    if getattr(node.next_functions[1][0], "variable", None) is not param:
        return None
    x = node._saved_self.detach()  # detached: see `_linear_weight_grad`
    if (param.dim() != 1 or x.shape != grad.shape or x.shape[-1] != param.shape[0]
            or not x.dtype == grad.dtype == param.dtype):
        return None
    return (grad * x).sum(list(range(grad.dim() - 1)), keepdim=True).view(param.shape)


def _linear_weight_grad(node: Node, grad: torch.Tensor, param: torch.Tensor,
                        into: torch.Tensor | None = None) -> torch.Tensor | None:
    """The weight gradient of `x @ W.t()` (a bias-free linear layer, which autograd
    records as mm <- t <- W), formed by the same matmul and transposes as torch's mm
    backward (`mm_mat2_backward`: a column-major mat2 gets grad.t().mm(x).t()), so it is
    bitwise the gradient a full backward accumulates. With `into`, the same product is
    accumulated into it by one `addmm_` (equal up to rounding: the sum is formed in the
    matmul instead of after it)."""
    transpose = node.next_functions[1][0]
    if transpose is None or type(transpose).__name__ != "TBackward0":
        return None
    if getattr(transpose.next_functions[0][0], "variable", None) is not param:
        return None
    # Detached: unpacked without `ForwardSaves` (a W that follows its I at once), the
    # saved input still requires grad, and the matmul would record a graph of its own.
    x = node._saved_self.detach()
    if into is not None:
        return into.addmm_(grad.t(), x)
    sizes, strides = node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides
    if strides[0] == 1 and strides[1] == sizes[0]:
        grad_mat2 = grad.t().mm(x).t()
    else:
        grad_mat2 = x.t().mm(grad)
    return grad_mat2.t()  # through the transpose, to W


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
                   params: Sequence[torch.Tensor], saves: ForwardSaves | None = None,
                   ) -> tuple[list[torch.Tensor | None], WeightPass]:
    """I: gradients of `inputs` (None where unused); the returned WeightPass is W.
    With `saves` (the forward ran inside it), what only I needed is released."""
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
    whole: set[int] = set()  # id(param) below a node whose backward runs only once
    for entry, found in entries:
        for key in found:
            owners[key] = owners.get(key, 0) + 1
        if isinstance(entry, Node) and runs_whole(entry):
            whole.update(found)
    eager = [p for p in params if owners.get(id(p), 0) > 1 or id(p) in whole]

    captured: dict[Node, tuple] = {}
    handles = [node.register_prehook(_capture(captured, node))
               for node, _ in entries if isinstance(node, Node)]
    wanted = inputs + eager
    try:
        with _once_per_compiled_node(bool(whole)):
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
        mine = [p for key, p in found.items() if owners[key] == 1 and key not in whole]
        if not mine:
            continue
        if isinstance(entry, GradientEdge):
            groups.append(([entry], [root_grad[id(entry)]], mine))
            continue
        got = captured.get(entry, ())
        slots = [(GradientEdge(entry, i), g) for i, g in enumerate(got) if g is not None]
        if slots:
            groups.append(([e for e, _ in slots], [g for _, g in slots], mine))
    if saves is not None:
        # W runs the re-entry nodes on the input path and, below them, nodes off it
        # only; all off-path nodes are a superset, cheap to read (weight casts, views).
        # A compiled node already gave I every gradient it has and W never runs it
        # again: what it saved goes now, not with the graph after W.
        saves.keep_only([n for n, _ in entries if isinstance(n, Node) and not runs_whole(n)]
                        + [n for n in order if not on_path[n]])
    return input_grads, WeightPass(groups, eager_grads)


def runs_whole(node: Node) -> bool:
    """A compiled region's backward node (`torch.compile`: AOTAutograd's one autograd
    function per graph), which computes the input and the weight gradients of the whole
    region in one call. Re-entering it for W would rerun all of it, and could read
    saved tensors its first call overwrote: a backward compiled while its saved tensors
    were to be used once (no `retain_graph`) reuses their memory ("donated buffers"),
    and torch's caches (dynamo's per-code cache shared by every block of a class,
    inductor's on-disk cache, whose key does not record donation) hand that compiled
    backward to later graphs, pipelines included."""
    return type(node).__name__ == "CompiledFunctionBackward"


@contextlib.contextmanager
def _once_per_compiled_node(active: bool) -> Iterator[None]:
    """I keeps the graph for W (`retain_graph`), which AOTAutograd refuses for a backward
    compiled with donated buffers, since a second call would read overwritten memory.
    W never re-enters a compiled node (`runs_whole`), so each runs once: the check is
    lifted for this call only."""
    if not active:
        yield
        return
    with torch._functorch.config.patch(donated_buffer=False):
        yield


def _capture(store: dict, node: Node):
    def hook(grad_outputs):
        # Aliases, not the tensors: a gradient formed in place in a saved tensor (the
        # loss's softmax, partita.loss) would otherwise keep that saved tensor's object
        # alive after I released it, and a meter of saved tensors would count the
        # storage twice, as saved and as held for W.
        store[node] = tuple(None if g is None else g.detach() for g in grad_outputs)
    return hook
