"""The re-tiling pass: every GLA site becomes chunked GLA at the target's chunk size.

NOTE [retile_gla: before and after]
Before (one site, T = 2048, trn2):

    gla = torch.ops.laplace.gla.default(q, k, v, gk, None, 0.0884, 'laplace.gla')
    o = gla[0]
    state = gla[1]

After (16 chunks of 128 tokens, 16-row leaves; see `laplace_passes.ops.chunked`):

    check_gates = torch.ops.laplace.check_gates.default(gk)
    chunked_gla = torch.ops.laplace.chunked_gla.default(q, k, v, check_gates, None, 0.0884, 128, 16, False)
    o = chunked_gla[0]
    state = chunked_gla[1]

`check_gates` refuses positive gates at run time. Gates the graph shows to
be <= 0 by construction (``F.logsigmoid(x) / 16``, ``-F.softplus(x)``: NOTE
[gates proven <= 0] in `laplace_passes.fx.gate_bounds`) go to the op
unchecked, and the report's "gates" column says which and why.

`laplace::chunked_gla` is a GLA chunk-loop op: its autograd is the explicit
reverse recurrence over chunks (`laplace::chunked_gla_backward`), so AOT
Autograd places one forward op in the forward graph and one backward op in
the backward graph, and saves q, k, v, gk (and the initial state), plus the
op's two residual outputs on a target with `save_residuals` (cpu). The
ATen-level unroll pass (`laplace_passes.unroll`) then expands both into
straight-line chunked code, one state update per chunk:

    exp = aten.exp(threshold)                       # each token's decay exp(gk), flushed
    ... every other decay a product of these; intra-chunk scores by halving, tril(A) @ V ...
    mul_15 = aten.mul(exp_last_15, add_14); add_15 = aten.add(mul_15, update_15)   # 16 state updates

NOTE [short sites]
A site of T <= the target's `recurrent_max_tokens` tokens through which no
gradient flows (decode: T = 1, short prefills) gets the recurrent form
instead, the token recurrence as T straight-line state updates
(`laplace_passes.ops.gla.gla_recurrence`), traced into ATen by AOT Autograd like
any Python function in the graph:

    check_gates = torch.ops.laplace.check_gates.default(gk)
    gla_recurrence = laplace_passes.ops.gla.gla_recurrence(q, k, v, check_gates, state, 0.0884, 'matmul')

    S = diag(exp(g_t)) S + k_t^T v_t;  o_t = scale * q_t S     (for each of the T tokens)

A chunk would pad a decode step to a whole chunk (127 of 128 rows padding
on trn2). Sites in training keep the chunked form whatever their length:
autograd of the recurrent form would save every step's state (T states of
[B, H, K, V]), the chunked op's explicit backward only its inputs. The
threshold per target is the measured crossover (`benchmarks/bench_fla.py`);
the last argument is the target's `recurrent_readout` (trn2: 'matmul', a
[1, K] @ [K, V] product per token; cpu: 'reduce', a product summed over K,
which fuses with the state update). It has no chunk plan, so it also takes
a batch Dynamo made dynamic (a decode graph recompiled for a second batch
size); a dynamic T takes the chunked form (NOTE [dynamic T]). The report's
form column says which form each site got and why (docs/DESIGN.md section
3.6).

Sites inside the body of a scan or while_loop are rewritten there (in a copy
of the body); the unroll pass then makes them one chunk-loop op per trip.

NOTE [unproven gates of a recognised loop]
A loop the recognition pass rewrote (`laplace_passes.fx.recognise`) has
the gates log(decay). Where the graph does not show them to be <= 0 (a
decay of 1.5 * sigmoid(x), tanh(x), or a graph input), the check refuses a
positive or NaN gate at run time, so an eager or Inductor compile raises,
naming the loop. A lowered graph cannot raise: its check becomes a clamp
(`laplace_passes.lowering.legalize.ClampGateChecks`), a clamped decay
above 1 is another model, and the log of a decay below 0 is NaN. So with
an inner compiler that lowers, recognition keeps such a token loop as
written (its GLA nodes erased, the loop declined with the reason), and this
pass gives a site of any other recognised form whose gates are unproven the
token recurrence, unchecked (T state updates with exp(gk): the gates as
they are, not clamped), listed as declined, saying why. A `laplace.gla`
call, or an fla call (`fla.chunk_gsa[slots]`), keeps its check, lowered as
a clamp: gates <= 0 are the op's contract.

NOTE [dynamic T]
A site whose sizes are symbolic (a graph Dynamo compiled for dynamic shapes)
is re-tiled too. The chunk-loop op takes any T: it counts its chunks, and
pads the last one, from the actual T at each call. The ATen-level unroll
pass cannot unroll a loop whose trip count is not static, so with a dynamic
T the op stays in the graph as a runtime loop over chunks (the report's form
column says "kept as a runtime loop: T is dynamic"); the token recurrence is
never what runs. Targets that need static shapes (trn2, the lowering inner
compilers) never see such a graph: each concrete shape is compiled on its
own (`laplace_passes.driver.shapes`), and unrolled.

Declined sites keep their `laplace::gla` node (the token recurrence: correct,
slow) and the report says why: inputs the op rejects, inputs without shape
information, or a scale computed at run time (the default scale of a
dynamic head size K). With the compile option ``retile_gla=False`` the pass
rewrites nothing and lists every site as declined for that reason, so the
report still shows each GLA call and recognised loop the graph holds.
"""

from __future__ import annotations

import torch
import torch.fx

from laplace_passes.infra.checks import check_gla_args
from laplace_passes.ops.chunked import chunk_plan, chunked_gla_saved_bytes
from laplace_passes.fx.gate_bounds import Bound, gate_bound
from laplace_passes.fx.sites import GlaSite, bind_site, is_gla_node
from laplace_passes.infra.fx_helpers import fake_value, new_node, provenance_of
from laplace_passes.ops.gla import check_readout, gla_recurrence, is_call_name
from laplace_passes.infra.pass_base import Declined, GraphPass, PassResult
from laplace_passes.infra.report import SiteRecord


class RetileGLA(GraphPass):
    """Replace each `laplace::gla` node by a `laplace::chunked_gla` node at the target's chunk size."""

    name = "retile_gla"

    def __init__(self, chunk_size: int, sub_chunk_size: int, recurrent_max_tokens: int = 0,
                 recurrent_readout: str = "matmul", save_residuals: bool = False, prove_gates: bool = True,
                 checks_become_clamps: bool = False, rewrite: bool = True) -> None:
        check_readout(recurrent_readout, "recurrent_readout")
        # False (option retile_gla=False): every site is listed as declined, none rewritten.
        self.rewrite = rewrite
        # Whether the inner compiler lowers a gate check to a clamp (NOTE [unproven gates of a recognised loop]).
        self.checks_become_clamps = checks_become_clamps
        # Whether gates proven <= 0 skip the run-time check (compile option gate_checks="auto").
        self.prove_gates = prove_gates
        self.chunk_size = chunk_size
        self.sub_chunk_size = sub_chunk_size
        # Whether the chunked op keeps its residuals for the backward (HardwareTarget.save_residuals).
        self.save_residuals = save_residuals
        # Sites of at most this many tokens (decode) get the recurrent form: NOTE [short sites].
        self.recurrent_max_tokens = recurrent_max_tokens
        self.recurrent_readout = recurrent_readout

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        records, declined, proven = [], [], 0
        self.kept_as_token_steps = 0
        # The graph and the bodies of its loops (scan, while_loop): a site in
        # a body becomes one site per trip when the loop is unrolled.
        bodies = _bodies_with_sites(gm)
        for where, graph_module in [("", gm), *bodies]:
            for node in [n for n in graph_module.graph.nodes if is_gla_node(n)]:
                # Bind just before rewriting: rewriting an earlier site replaces
                # nodes a later site may read (GLA layers feed each other).
                record, gates = self._rewrite(graph_module, bind_site(node))
                proven += gates.nonpositive
                record.node = where + record.node  # a site in a loop body: "scan_combine_graph_0.gla_default"
                records.append(record)
                if record.status == "declined":
                    declined.append(f"{record.node}: {record.reason}")
        for _, body in bodies:
            body.recompile()
        retiled = sum(r.status == "retiled" for r in records)
        summary = f"{retiled} of {len(records)} GLA sites re-tiled at chunk {self.chunk_size}"
        if not self.rewrite:
            summary = f"0 of {len(records)} GLA sites re-tiled: option retile_gla=False"
        recurrent = sum(r.status == "retiled" and r.plan["chunk_size"] == 1 for r in records)
        if recurrent:
            summary += f" ({recurrent} in the recurrent form: NOTE [short sites])"
        if proven:
            summary += f"; gates <= 0 by construction at {proven}, not checked at run time"
        return PassResult(gm, modified=retiled + self.kept_as_token_steps > 0, summary=summary, declined=declined,
                          sites=records)

    def _rewrite(self, gm: torch.fx.GraphModule, site: GlaSite) -> tuple[SiteRecord, Bound]:
        """The site rewritten (or declined: the record says why), and what is known of its gates."""
        record = SiteRecord(graph="", node=site.node.name, origin=site.origin, status="declined")
        if not self.rewrite:
            record.reason = ("option retile_gla=False: the site stays laplace::gla, the reference recurrence "
                             "(one state update per token)")
            if self.checks_become_clamps:  # stablehlo, iree, neuron: only the re-tiled forms lower
                record.reason += ("; the inner compiler lowers the graph and has no lowering of laplace::gla, so "
                                  "the compile fails at this site (keep retile_gla on to lower it)")
            record.gates = "checked at run time: the reference op checks them"
            return record, Bound(None, "not re-tiled")
        values = [fake_value(n) for n in site.tensor_inputs()]
        try:
            if any(v is None for v in values):
                raise Declined("no shape information on the inputs (graph was not traced with fake tensors)")
            site.scale = _known_scale(site.scale)
            if isinstance(site.scale, torch.fx.Node):  # K ** -0.5 of a symbolic K: a value known only at run time
                raise Declined(f"the scale is computed at run time ({site.scale.name}, from a dynamic head size "
                               "K); keep K static or pass scale= as a number")
            _require_valid_inputs(site, values)
        except Declined as declined:
            record.reason = declined.reason
            return record, Bound(None, "declined")
        q, v = values[0], values[2]
        B, T, H, K = q.shape
        record.shape = {"B": _size_cell(B), "H": _size_cell(H), "K": _size_cell(K), "V": _size_cell(v.shape[-1]),
                        "dtype": str(q.dtype).removeprefix("torch.")}
        recurrent, record.form = self._form(T if isinstance(T, int) else None, _needs_grad(site.node))
        proof = gate_bound(site.gk)
        gates = proof if self.prove_gates else Bound(None, "gate_checks='always'")
        record.gates = f"<= 0 by construction: {gates.how}" if gates.nonpositive else f"checked at run time: {gates.how}"
        if not proof.nonpositive and self.checks_become_clamps and not is_call_name(site.origin):
            record.gates = f"not checked (a lowered graph): {proof.how}"
            self.kept_as_token_steps += 1
            return self._keep_loop_unchecked(gm, site, record, proof, T), gates
        if recurrent:
            record.plan = {"T": T, "chunk_size": 1, "n_chunks": T, "padding": 0}
            record.saved_bytes = 0  # no gradient flows through it
            self._install(gm.graph, site, gla_recurrence, (site.scale, self.recurrent_readout), "gla_recurrence",
                          check_gates=not gates.nonpositive)
        else:
            initial_state = values[4] if site.initial_state is not None else None
            record.plan = chunk_plan(T, self.chunk_size) if isinstance(T, int) else _runtime_plan(T, self.chunk_size)
            chunked = self._install(gm.graph, site, torch.ops.laplace.chunked_gla.default,
                                    (site.scale, self.chunk_size, self.sub_chunk_size, self.save_residuals),
                                    "chunked_gla", keeps_outputs=False, check_gates=not gates.nonpositive)
            residuals = fake_value(chunked)[2:] if self.save_residuals else None
            # Without a gradient through it (an eval under no_grad), nothing is kept for a backward.
            record.saved_bytes = (chunked_gla_saved_bytes(*values[:4], initial_state, residuals)
                                  if _needs_grad(site.node) else 0)
        record.status = "retiled"
        return record, gates

    def _keep_loop_unchecked(self, gm: torch.fx.GraphModule, site: GlaSite, record: SiteRecord, gates: Bound,
                             T) -> SiteRecord:
        """A recognised loop whose gates a lowered graph would clamp: its token steps, unchecked, not re-tiled
        (NOTE [unproven gates of a recognised loop])."""
        self._install(gm.graph, site, gla_recurrence, (site.scale, self.recurrent_readout), "gla_recurrence",
                      check_gates=False)
        record.form = f"the loop's {T} token steps, unchecked"
        record.reason = (f"its gates (the log of the loop's decay) are not shown to be <= 0 ({gates.how}), and a "
                         "lowered graph cannot refuse a positive one at run time (its check lowers to a clamp, "
                         "which would change the loop's numbers): kept as its token steps, not re-tiled")
        return record

    def _form(self, T: int | None, needs_grad: bool) -> tuple[bool, str]:
        """Whether a site of T tokens (None: not static) gets the recurrent form, and the report's words for
        the form it gets and why (NOTE [short sites])."""
        if T is None:
            return False, (f"chunked, kept as a runtime loop: T is dynamic (chunks of {self.chunk_size} counted, "
                           "and the last one padded, at run time)")
        if T > self.recurrent_max_tokens:
            return False, f"chunked: T = {T} > {self.recurrent_max_tokens}"
        if needs_grad:
            return False, (f"chunked: T = {T} <= {self.recurrent_max_tokens} but gradients flow through it (the "
                           "recurrent form's backward would keep every step's state)")
        return True, (f"recurrent: T = {T} <= {self.recurrent_max_tokens}, no gradient: one state update per "
                      f"token instead of a chunk padded to {self.chunk_size}")

    def _install(self, graph: torch.fx.Graph, site: GlaSite, target, settings: tuple, name: str,
                 keeps_outputs: bool = True, check_gates: bool = True) -> torch.fx.Node:
        """[check_gates +] `target`(q, k, v, gates, initial_state, *settings) in place of the site.

        The new node's first two outputs are the site's (o, final state); when
        it has more (`keeps_outputs` False: the chunked op's residuals), its
        fake value is propagated rather than copied from the site. Without
        `check_gates` (gates proven <= 0) the op reads the site's gk itself.
        """
        # The chunk-loop node inherits where the site came from: reports and
        # per-layer accounting still see the user's layer.
        provenance = provenance_of(site.node)
        with graph.inserting_before(site.node):
            # Same shapes and dtypes as the gates and the reference op's results.
            gates = site.gk if not check_gates else new_node(
                graph, torch.ops.laplace.check_gates.default, _check_arguments(site), name="check_gates",
                provenance=provenance, like=site.gk)
            replacement = new_node(graph, target, (site.q, site.k, site.v, gates, site.initial_state, *settings),
                                   name=name, provenance=provenance, like=site.node if keeps_outputs else None)
        site.node.replace_all_uses_with(replacement)
        graph.erase_node(site.node)
        return replacement


def _check_arguments(site: GlaSite) -> tuple:
    """The gate check's arguments: a recognised loop's origin too, so that its error speaks of the loop."""
    return (site.gk,) if is_call_name(site.origin) else (site.gk, site.origin)


def _known_scale(scale):
    """The scale as a number when the graph knows it: `q.shape[-1] ** -0.5` in a graph specialised to one
    shape (NOTE [specialising per shape]) is a node whose value is a plain float, no longer a symbol."""
    if isinstance(scale, torch.fx.Node):
        value = fake_value(scale)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return scale


def _needs_grad(node: torch.fx.Node) -> bool:
    """Whether the site's output takes part in autograd (Dynamo's example value knows)."""
    value = fake_value(node)
    outputs = value if isinstance(value, (tuple, list)) else [value]
    return any(getattr(output, "requires_grad", False) for output in outputs)


def _bodies_with_sites(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    """("name.", body) for loop bodies holding a GLA site (rewritten in place; report snapshots hold copies)."""
    return [
        (f"{name}.", module) for name, module in gm.named_modules()
        if name and isinstance(module, torch.fx.GraphModule) and any(is_gla_node(n) for n in module.graph.nodes)
    ]


def _size_cell(size) -> int | str:
    """A size for the report: the int, or the symbol's name when it is dynamic."""
    return size if isinstance(size, int) else str(size)


def _runtime_plan(T: torch.SymInt, chunk_size: int) -> dict:
    """The chunk plan of a dynamic T: the chunk size is fixed, the rest is decided per call."""
    return {"T": str(T), "chunk_size": chunk_size, "n_chunks": "run time", "padding": "run time"}


def _require_valid_inputs(site: GlaSite, values: list) -> None:
    """The op's own argument checks, run on the fake inputs."""
    q, k, v, gk = values[:4]
    initial_state = values[4] if site.initial_state is not None else None
    try:
        check_gla_args(q, k, v, gk, initial_state, site.scale)
    except (TypeError, ValueError) as error:
        raise Declined(f"inputs rejected by chunked_gla: {error}") from error
