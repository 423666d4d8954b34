"""Finding the gather pattern of a sharded Muon step in an ATen graph.

A bucket is one `all_gather_into_tensor`. Either its send is flat and the
result, viewed `[W, N]`, is cut into column blocks, one per matrix (every
rank's padded row shard of it), or the gathered value is one matrix whole
(a per-matrix gather of row shards on dim 0, `[W * s, c]`, or a flat
per-matrix send viewed back to its shape). `dist.all_gather_into_tensor(out,
x)` arrives as `copy(new_empty(...), wait)`; the copy is folded away first.
For each block the pattern is

    block = slice(gathered, 1, a, b)   or the gathered value  # [W, numel] / [W * s, c]
    full  = unpad(block)                                   # any closed computation
    then either ("all_gather": every rank computes)
        result = NewtonSchulz(full)
    or ("gather_broadcast": the owner computes, then broadcasts)
        r = cond(rank == owner, NewtonSchulz, zeros_like, (full,))[0]
        b = wait_tensor(broadcast(cat([..., view(r, [-1]), ...]), owner))
        result = view(slice(b, 0, offset, offset + numel), shape)
    mine = select_own(layout(result))                      # layout: any closed computation

where `select_own` takes this rank's block of `numel` elements:
`index_select(., 0, i)` or `index(., [i])` on a `[W, ...]` layout with `i`
a one-element integer graph input (taken to be the rank in the gather's
group: the contract of `rewrite_muon_step`, ShardedMuon passes it so), or,
with the rank a constant (`dist.get_rank()` baked in by Dynamo), any view
that reads a contiguous run of `numel` elements of its source starting at
`rank * numel`: `select`, `chunk` / `split` + `getitem`, `narrow`, slicing.
NewtonSchulz needs one iteration at least, so a gather followed by a plain
normalisation is not matched. Every node from the all-gather to the
selections must serve only this pattern, so that all of it dies once the
selections are replaced. Anything else is declined with the reason, among
them: a gather of values Newton-Schulz already produced (KellerJordan's
round-robin), matrices cut from a flat buffer by element ranges
(Megatron's layout), a gathered value combined with other state before
Newton-Schulz (replicated optimizer state), a gathered value that leaves
the graph before Newton-Schulz (a graph break between them), rows not
divisible by W picked from the unpadded result (uneven shards), the whole
result read besides this rank's rows (every rank needs all of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from laplace_passes.collectives.gathers import (
    ALL_GATHER,
    BROADCAST,
    WAIT,
    check_gathers_before_newton_schulz,
    element_ranges,
    feeds_whole,
    fold_copies_into_new_buffers,
)
from laplace_passes.collectives.newton_schulz import NewtonSchulz, find_newton_schulz
from laplace_passes.collectives.own_rows import (
    index_plumbing,
    own_row_selection,
    require_rank_input,
    selection_source,
    split_of,
)
from laplace_passes.collectives.regions import (
    Region,
    RegionError,
    closed_region,
    live_nodes,
    live_users,
    signature,
)
from laplace_passes.infra.fx_helpers import (
    COND,
    fake_tensor,
    output_values,
    subgraph,
)
from laplace_passes.infra.op_facts import is_view
from laplace_passes.infra.pass_base import Declined
from laplace_passes.infra.strict import strict_mode

aten = torch.ops.aten
Node = torch.fx.Node



@dataclass
class MatrixSite:
    block: Node  # the matrix's column block of the gathered buffer (or the whole gathered value)
    offset: int  # element offset of this rank's shard in the flattened send buffer
    numel: int
    unpad: Region  # block -> full matrix
    newton_schulz: NewtonSchulz
    ns_template: Region  # copied onto each owned matrix
    owner: int | None  # None: every rank computes ("all_gather")
    result: Node
    layout: Region  # result -> [W, ...]
    selection: Node
    transport: tuple[Node, ...] = ()  # gather_broadcast: cond ... broadcast ... slice
    send: Node | None = None  # the gather's send buffer (any shape; packed flattened)

    @property
    def key(self) -> tuple:
        shape = tuple(fake_tensor(self.selection).shape)
        return (self.numel, shape, signature(self.unpad), signature(self.ns_template), signature(self.layout))

    @property
    def nodes(self) -> set[Node]:
        ns_nodes = self.newton_schulz.region.node_set if self.owner is None else frozenset()
        return {self.block, *self.unpad.nodes, *ns_nodes, *self.transport, self.result,
                *self.layout.nodes, self.selection, *index_plumbing(self.selection), *split_of(self.selection)}


@dataclass
class GatherBucket:
    all_gather: Node
    send: Node
    group: str
    world_size: int
    sites: list[MatrixSite]
    infrastructure: set[Node] = field(default_factory=set)  # wait, views, broadcasts: die with the sites

    @property
    def comm(self) -> str:
        return "gather_broadcast" if self.sites[0].owner is not None else "all_gather"

    @property
    def broadcasts(self) -> list[Node]:
        return sorted({n for n in self.infrastructure if n.target is BROADCAST}, key=lambda n: n.name)


@dataclass(frozen=True)
class _OwnerOnly:
    """A cond(rank == owner, NewtonSchulz, zeros_like, (full,)) and its getitem."""

    cond: Node
    getitem: Node
    pred: Node
    owner: int
    newton_schulz: NewtonSchulz
    body: Region


def find_buckets(gm: torch.fx.GraphModule, world_size: int) -> tuple[list[GatherBucket], list[str], bool]:
    """The Muon buckets of `gm`, why anything close was not one, and whether finding them changed the graph.

    It may: a gather into a new buffer (`copy_` into `new_empty`) is first read directly.
    """
    declined: list[str] = []
    folded = fold_copies_into_new_buffers(gm.graph) > 0
    live = live_nodes(gm.graph)
    outer, misses = find_newton_schulz(gm.graph, live)
    declined += misses
    owner_only = _owner_only_conds(gm, live, declined)
    ns_by_input = {ns.region.input: ns for ns in outer}
    buckets = []
    for node in gm.graph.nodes:
        if node.target is ALL_GATHER:
            try:
                buckets.append(_match_bucket(node, world_size, ns_by_input, owner_only, live))
            except Declined as reason:
                declined.append(f"{node.name}: {reason}")
            except Exception as error:  # noqa: BLE001 - a spelling not foreseen: keep the user's graph
                if strict_mode():  # NOTE [a failing pass declines]: the suite finds such failures
                    raise
                declined.append(f"{node.name}: {type(error).__name__} while matching this gather ({error}); "
                                "the rewrite does not know this spelling, the gather is kept")
    return buckets, declined, folded


# ---------------------------------------------------------------- conds


def _owner_only_conds(gm: torch.fx.GraphModule, live: set[Node], declined: list[str]) -> dict[Node, _OwnerOnly]:
    """cond nodes that run Newton-Schulz on the owner only, by their operand."""
    found = {}
    for node in gm.graph.nodes:
        if node.target is not COND or node not in live:
            continue
        try:
            info = _owner_only(gm, node, live)
        except Declined as reason:
            declined.append(f"{node.name}: {reason}")
            continue
        except Exception as error:  # noqa: BLE001 - a spelling not foreseen: keep the user's graph
            if strict_mode():
                raise
            declined.append(f"{node.name}: {type(error).__name__} while matching this cond ({error})")
            continue
        if info is not None:
            found[info.cond.args[3][0]] = info
    return found


def _owner_only(gm: torch.fx.GraphModule, cond: Node, live: set[Node]) -> _OwnerOnly | None:
    """The owner-only Newton-Schulz of `cond`; None when its true branch has nothing like it."""
    pred, true_attr, false_attr, operands = cond.args[:4]
    true_gm, false_gm = subgraph(gm, true_attr), subgraph(gm, false_attr)
    (ns_list, misses) = find_newton_schulz(true_gm.graph)
    if not ns_list and not misses:
        return None
    if len(operands) != 1:
        raise Declined("cond takes more than one operand; expected cond(rank == owner, NS, zeros_like, (full,))")
    owner = _owner_of(pred)
    if len(ns_list) != 1:
        detail = f" ({'; '.join(misses)})" if misses else ""
        raise Declined(f"the true branch holds {len(ns_list)} Newton-Schulz regions, expected 1{detail}")
    body = _branch_body(true_gm)
    extra = set(body.nodes) - ns_list[0].region.node_set - {ns_list[0].region.input}
    if any(n.target not in _LAYOUT_ONLY for n in extra):
        raise Declined(f"the true branch computes more than Newton-Schulz: {sorted(n.name for n in extra)}")
    if ns_list[0].region.input is not body.input:
        raise Declined("the true branch's Newton-Schulz does not start from its operand")
    zero = _branch_output(false_gm)
    if not _is_zeros(zero):
        raise Declined(f"the false branch returns {zero.target}, not zeros")
    getitem = _sole_user(cond, "cond", live)
    return _OwnerOnly(cond, getitem, pred, owner, ns_list[0], body)


_LAYOUT_ONLY = {aten.clone.default, aten.view.default, aten._unsafe_view.default, aten.permute.default,
                aten.transpose.int, aten.t.default}


def _owner_of(pred: Node) -> int:
    if not isinstance(pred, Node) or pred.target is not aten.eq.Scalar or not isinstance(pred.args[1], int):
        raise Declined(f"predicate {getattr(pred, 'name', pred)} is not `rank == owner`")
    require_rank_input(pred.args[0])
    return pred.args[1]


def _branch_output(branch: torch.fx.GraphModule) -> Node:
    (value,) = output_values(branch)
    return value


def _branch_body(branch: torch.fx.GraphModule) -> Region:
    (placeholder,) = [n for n in branch.graph.nodes if n.op == "placeholder"]
    return closed_region(placeholder, _branch_output(branch))


def _is_zeros(node: Node) -> bool:
    if node.target in (aten.zeros_like.default, aten.new_zeros.default, aten.zeros.default):
        return True
    return node.target is aten.full.default and node.args[1] == 0  # zeros_like, decomposed


# ---------------------------------------------------------------- buckets


@dataclass(frozen=True)
class _MatchContext:
    """What matching the blocks of one gather needs besides the block."""

    send: Node
    group: str
    world_size: int
    ns_by_input: dict  # Newton-Schulz regions every rank runs, by input
    owner_only: dict  # owner-only conds, by operand
    live: set[Node]


@dataclass(frozen=True)
class _Work:
    """Where a block's Newton-Schulz runs and where its result comes from."""

    ns: object  # the NewtonSchulz found
    template: object  # the region the owner copies
    owner: int | None  # None: every rank runs it
    result: Node
    transport: tuple  # the broadcast nodes of an owner-only result


def _match_bucket(all_gather: Node, world_size: int, ns_by_input, owner_only, live: set[Node]) -> GatherBucket:
    send, group_size, group = all_gather.args
    if group_size != world_size:
        raise Declined(f"gathers over {group_size} ranks, but world_size={world_size}")
    check_gathers_before_newton_schulz(send, ns_by_input, owner_only)
    send_value = fake_tensor(send)
    if send_value is None or send_value.dim() == 0:
        raise Declined("the all_gather_into_tensor sends a tensor without a known shape")
    wait = _sole_user(all_gather, "all_gather_into_tensor", live)
    users = live_users(wait, live)
    gathered = users[0] if len(users) == 1 else wait
    width = send_value.numel()
    infrastructure = {wait}
    if gathered.target is aten.view.default and list(fake_tensor(gathered).shape) == [world_size, width]:
        infrastructure.add(gathered)
        blocks = _column_blocks(gathered, width, live)  # a flat bucket viewed [W, N]: one block per matrix
    elif send_value.dim() >= 2 or feeds_whole(wait, live):
        blocks = [(wait, 0, width)]  # one matrix per gather, its rows gathered on dim 0
    else:
        raise element_ranges(wait, width, world_size, live)
    sites = []
    context = _MatchContext(send, group, world_size, ns_by_input, owner_only, live)
    for block, offset, numel in blocks:
        sites.append(_site_of_block(context, block, offset, numel))
        infrastructure |= {n for n in sites[-1].transport if n.target in (BROADCAST, WAIT)}
    if len({s.owner is None for s in sites}) > 1:
        raise Declined("mixes matrices every rank orthogonalises with owner-only ones")
    bucket = GatherBucket(all_gather, send, group, world_size, sites, infrastructure)
    _check_contained(bucket, live)
    return bucket


def _site_of_block(context: _MatchContext, block: Node, offset: int, numel: int) -> MatrixSite:
    full = _full_matrix(block, context.ns_by_input, context.owner_only)
    try:
        unpad = closed_region(block, full)
    except RegionError as mixed:
        raise Declined(
            f"the gathered {block.name} is combined with other inputs before Newton-Schulz reads it as {full.name} "
            f"({mixed}): state every rank keeps whole (a momentum of full matrices, as torch.optim.Muon's step "
            "on a gathered gradient) needs the whole gathered value on every rank"
        ) from None
    if full in context.ns_by_input:
        ns = context.ns_by_input[full]
        work = _Work(ns, ns.region, None, ns.region.output, ())
    else:
        info = context.owner_only[full]
        result, transport = _through_broadcast(info, context.group, context.live)
        work = _Work(info.newton_schulz, info.body, info.owner, result, transport)
    site = _finish_site(context, block, offset, numel, unpad, work)
    site.send = context.send
    return site


def _column_blocks(gathered: Node, width: int, live: set[Node]) -> list[tuple[Node, int, int]]:
    blocks = []
    users = live_users(gathered, live)
    for user in users:
        if user.target is aten.slice.Tensor and user.args[1] == 1:
            start, end = user.args[2], min(user.args[3], width)
            blocks.append((user, start, end - start))
        elif len(users) == 1:
            blocks.append((gathered, 0, width))  # one matrix: the whole buffer
        else:
            raise Declined(f"{user.name} uses the gathered buffer other than as a column block")
    blocks.sort(key=lambda b: b[1])
    covered = 0
    for _, start, numel in blocks:
        if start != covered:
            raise Declined(f"column blocks do not tile the gathered buffer (gap or overlap at {covered})")
        covered += numel
    if covered != width:
        raise Declined(f"column blocks cover {covered} of {width} gathered elements")
    return blocks


def _full_matrix(block: Node, ns_by_input, owner_only) -> Node:
    """The first node downstream of `block` that Newton-Schulz (direct or owner-only) consumes."""
    seen, frontier = set(), [block]
    while frontier:
        node = frontier.pop(0)
        if node in ns_by_input or node in owner_only:
            return node
        for user in node.users:
            if user not in seen and user.op == "call_function":
                seen.add(user)
                frontier.append(user)
    if _returned_as_is(block):  # what Newton-Schulz would read is computed in a later graph, not here
        raise Declined(
            f"the gathered {block.name} leaves the graph (a graph output) before any Newton-Schulz reads it: the "
            "gather and Newton-Schulz are in different graphs (a graph break between them, e.g. at DTensor's "
            "distribute_tensor, which Dynamo does not trace)"
        )
    what = f"column block {block.name}" if block.target is aten.slice.Tensor else \
        f"the gathered {block.name} ({_shape_text(block)})"
    raise Declined(
        f"{what} feeds no Newton-Schulz region: not a Muon step "
        "(another optimizer, or Newton-Schulz written in a form this pass does not recognise)"
    )


def _shape_text(node: Node) -> str:
    value = fake_tensor(node)
    return "unknown shape" if value is None else f"[{', '.join(map(str, value.shape))}] {value.dtype}"


def _returned_as_is(node: Node) -> bool:
    """Whether `node`, or a view of it, is an output of the graph."""
    views, frontier = {node}, [node]
    while frontier:
        for user in frontier.pop().users:
            if user.op == "output":
                return True
            if user not in views and is_view(user):
                views.add(user)
                frontier.append(user)
    return False


def _through_broadcast(info: _OwnerOnly, group: str, live: set[Node]) -> tuple[Node, tuple[Node, ...]]:
    """Follow the owner's result through cat -> broadcast -> wait -> slice -> view; check offsets."""
    flat = _sole_user(info.getitem, "cond result", live)
    if flat.target is not aten.view.default or list(flat.args[1]) not in ([-1], [fake_tensor(info.getitem).numel()]):
        raise Declined(f"{flat.name}: the owner's result is not flattened before the broadcast")
    packed = _sole_user(flat, "flattened result", live)
    if packed.target is not aten.cat.default:
        raise Declined(f"{packed.name}: results are not concatenated before the broadcast")
    pieces = packed.args[0]
    offset = sum(fake_tensor(p).numel() for p in pieces[: pieces.index(flat)])
    numel = fake_tensor(flat).numel()
    bcast = _sole_user(packed, "broadcast payload", live)
    if bcast.target is not BROADCAST or bcast.args[2] != group:
        raise Declined(f"{bcast.name}: the owner's results are not broadcast on the gather's group")
    if bcast.args[1] != info.owner:
        raise Declined(f"{bcast.name}: broadcast from rank {bcast.args[1]}, but rank {info.owner} computed it")
    wait = _sole_user(bcast, "broadcast", live)
    piece = [u for u in wait.users if u.target is aten.slice.Tensor and u.args[1:3] == (0, offset)]
    if len(piece) != 1 or min(piece[0].args[3], fake_tensor(wait).numel()) != offset + numel:
        raise Declined(f"{wait.name}: no unique slice [{offset}:{offset + numel}] takes back {info.cond.name}'s result")
    result = _sole_user(piece[0], "broadcast slice", live)
    if result.target is not aten.view.default or fake_tensor(result).shape != fake_tensor(info.getitem).shape:
        raise Declined(f"{result.name}: the broadcast slice is not viewed back to the matrix shape")
    transport = (info.pred, info.cond, info.getitem, flat, packed, bcast, wait, piece[0])
    return result, transport


def _finish_site(context: _MatchContext, block: Node, offset: int, numel: int, unpad, work: _Work) -> MatrixSite:
    world_size = context.world_size
    ns = work.ns
    if ns.batch > 1:
        raise Declined(
            f"Newton-Schulz {ns.output.name} orthogonalises a batch of {ns.batch} matrices at once "
            f"([{ns.batch}, {ns.rows}, {ns.cols}] from the gathered {block.name}): the rewrite gives each gathered "
            "matrix one owner, and cannot split a batch between owners"
        )
    selection = own_row_selection(work.result, world_size, numel, context.group, context.live)
    layout = closed_region(work.result, selection_source(selection))
    if fake_tensor(layout.output).numel() != world_size * numel:
        raise Declined(
            f"{selection.name} selects from a layout of {fake_tensor(layout.output).numel()} elements, "
            f"not one {numel}-element shard per rank like the gathered block {block.name}"
        )
    return MatrixSite(block, offset, numel, unpad, work.ns, work.template, work.owner, work.result, layout, selection,
                      work.transport)


def _sole_user(node: Node, what: str, live: set[Node]) -> Node:
    users = live_users(node, live)
    if len(users) != 1:
        raise Declined(f"{node.name}: the {what} has {len(users)} users, expected 1")
    return users[0]


def _check_contained(bucket: GatherBucket, live: set[Node]) -> None:
    """Everything the rewrite removes must be used only inside the pattern."""
    dying = set(bucket.infrastructure)
    for site in bucket.sites:
        dying |= site.nodes
    keep = {site.selection for site in bucket.sites}
    for node in dying - keep:
        for user in node.users:
            if user in dying:
                continue
            if user not in live:  # e.g. a view functionalization left behind: dies too
                bucket.infrastructure |= _with_descendants(user)
                continue
            raise Declined(f"{node.name} is also used by {user.name}, outside the gather pattern")


def _with_descendants(node: Node) -> set[Node]:
    found, stack = {node}, [node]
    while stack:
        for user in stack.pop().users:
            if user not in found:
                found.add(user)
                stack.append(user)
    return found



