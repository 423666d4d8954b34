"""Data-parallel Muon steps written the way their users write them, for the Muon rewrite's tests.

Independent of `model_zoo.muon` and of the pass: each step is a pure function
of this rank's row shards (momentum, gradient, parameter) with its
collectives on the default process group and the rank read with
`dist.get_rank()` (Dynamo bakes it in, so each rank compiles its own graph,
as in user code). Two Newton-Schulz spellings: torch.optim.Muon's own
function, and KellerJordan/Muon's `X / (X.norm() + eps)`, `B = b*A + c*A@A`,
`X = a*X + B@X`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
LR, WD, MU = 0.02, 0.1, 0.95
NS_STEPS = 2  # small graphs; the spellings do not depend on the count


def ns_torch(g: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's own Newton-Schulz (it divides in place: give it a tensor it may modify)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(g, COEFFICIENTS, NS_STEPS, EPS)


def ns_kj(g: torch.Tensor) -> torch.Tensor:
    """KellerJordan/Muon's spelling (also Moonlight's and many ports)."""
    a, b, c = COEFFICIENTS
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + EPS)
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        poly = b * gram + c * gram @ gram
        x = a * x + poly @ x
    return x.mT if tall else x


NEWTON_SCHULZ = {"torch": ns_torch, "kj": ns_kj}


def _momentum(m, g):
    buf = m.lerp(g, 1 - MU)
    return buf, g.lerp(buf, MU)  # Nesterov


def _apply(p, update, rows, cols):
    return p.mul(1 - LR * WD).add(update, alpha=-LR * max(1.0, rows / cols) ** 0.5)


def own_rows(o: torch.Tensor, how: str) -> torch.Tensor:
    """This rank's block of rows of a [W * s, c] matrix, spelled `how`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    s = o.size(0) // world
    if how == "chunk":
        return o.chunk(world)[rank]
    if how == "split":
        return o.split(s)[rank]
    if how == "narrow":
        return o.narrow(0, rank * s, s)
    if how == "slice":
        return o[rank * s:(rank + 1) * s]
    if how == "select":
        return o.view(world, s, -1).select(0, rank)
    raise ValueError(how)


def per_matrix(momenta, grads, params, *, own="chunk", ns="torch"):
    """One functional all-gather per matrix of its bf16 row shard (gather dim 0)."""
    new_m, new_p = [], []
    for m, g, p in zip(momenta, grads, params):
        buf, u = _momentum(m, g)
        full = fc.all_gather_tensor(u.bfloat16(), 0, dist.group.WORLD)  # [W * s, c]
        o = NEWTON_SCHULZ[ns](full)
        new_m.append(buf)
        new_p.append(_apply(p, own_rows(o, own), *full.shape))
    return new_m, new_p


def per_matrix_into_tensor(momenta, grads, params, *, own="narrow", ns="kj"):
    """The same with the non-functional `dist.all_gather_into_tensor(out, x)`."""
    world = dist.get_world_size()
    new_m, new_p = [], []
    for m, g, p in zip(momenta, grads, params):
        buf, u = _momentum(m, g)
        send = u.bfloat16()
        full = send.new_empty(world * send.size(0), send.size(1))
        dist.all_gather_into_tensor(full, send)
        new_m.append(buf)
        new_p.append(_apply(p, own_rows(NEWTON_SCHULZ[ns](full), own), *full.shape))
    return new_m, new_p


def flat_bucket(momenta, grads, params, *, ns="kj"):
    """One flat bf16 bucket of every shard, viewed [W, -1]; own rows by view(W, s, c)[rank]."""
    world, rank = dist.get_world_size(), dist.get_rank()
    bufs, updates = zip(*(_momentum(m, g) for m, g in zip(momenta, grads)))
    flat = torch.cat([u.bfloat16().reshape(-1) for u in updates])
    gathered = fc.all_gather_tensor(flat, 0, dist.group.WORLD).view(world, -1)
    new_p, offset = [], 0
    for u, p in zip(updates, params):
        s, c = u.shape
        full = gathered[:, offset:offset + u.numel()].reshape(world * s, c)
        o = NEWTON_SCHULZ[ns](full)
        new_p.append(_apply(p, o.view(world, s, c)[rank], world * s, c))
        offset += u.numel()
    return list(bufs), new_p


def megatron_ranges(momentum, grad, param, *, shapes, ns="torch"):
    """Megatron's layout: rank r holds elements [r L, (r+1) L) of all matrices laid end to end."""
    world, rank = dist.get_world_size(), dist.get_rank()
    buf, u = _momentum(momentum, grad)
    full = fc.all_gather_tensor(u.bfloat16(), 0, dist.group.WORLD)  # [W * L]
    outs, offset = [], 0
    for rows, cols in shapes:
        outs.append(NEWTON_SCHULZ[ns](full[offset:offset + rows * cols].view(rows, cols)).reshape(-1))
        offset += rows * cols
    length = momentum.numel()
    ortho = torch.cat(outs + [full.new_zeros(world * length - offset)])
    return buf, param.mul(1 - LR * WD).sub(ortho[rank * length:(rank + 1) * length] * LR)


def round_robin(params, grads, momenta, *, ns="kj"):
    """KellerJordan's: rank r updates parameters r, r + W, ...; then the updated parameters are gathered."""
    world, rank = dist.get_world_size(), dist.get_rank()
    new_params, new_momenta = list(params), list(momenta)
    for base in range(0, len(params), world):
        i = base + rank
        buf, u = _momentum(momenta[i], grads[i])
        mine = params[i].mul(1 - LR * WD).add(NEWTON_SCHULZ[ns](u), alpha=-LR)
        new_momenta[i] = buf
        gathered = fc.all_gather_tensor(mine, 0, dist.group.WORLD).split(mine.size(0))
        for j in range(world):
            new_params[base + j] = gathered[j]
    return new_params, new_momenta


def dtensor_shard0(momenta, grads, params, *, ns="kj", back="redistribute"):
    """FSDP2-style: DTensors sharded Shard(0) on a 1-D mesh; `.full_tensor()`, Newton-Schulz, back to Shard(0)
    by `from_local(.., [Replicate()]).redistribute(.., [Shard(0)])` or by `distribute_tensor`."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    new_m, new_p = [], []
    for m, g, p in zip(momenta, grads, params):
        buf, u = _momentum(m, g)
        full = u.bfloat16().full_tensor()
        o = NEWTON_SCHULZ[ns](full)
        if back == "redistribute":
            update = DTensor.from_local(o, p.device_mesh, [Replicate()], run_check=False)
            update = update.redistribute(p.device_mesh, [Shard(0)])
        else:
            update = distribute_tensor(o, p.device_mesh, [Shard(0)])
        new_m.append(buf)
        new_p.append(_apply(p, update, *full.shape))
    return new_m, new_p


def torch_muon_step(opt, params, grad_shards):
    """torch.optim.Muon's own step, its gradients gathered from row shards by the caller."""
    for p, shard in zip(params, grad_shards):
        p.grad.copy_(fc.all_gather_tensor(shard, 0, dist.group.WORLD))
    opt.step()
    return [p.detach().clone() for p in params]


def per_matrix_flat_packed(momenta, grads, params, *, ns="kj"):
    """One gather per matrix of its flattened shard, viewed [W, -1]; the result packed back to [W, -1]
    (one row per rank) and this rank's row taken from it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    new_m, new_p = [], []
    for m, g, p in zip(momenta, grads, params):
        buf, u = _momentum(m, g)
        s, c = u.shape
        gathered = fc.all_gather_tensor(u.bfloat16().flatten(), 0, dist.group.WORLD).view(world, -1)
        o = NEWTON_SCHULZ[ns](gathered.view(world * s, c))
        new_m.append(buf)
        new_p.append(_apply(p, o.reshape(world, -1)[rank].view(s, c), world * s, c))
    return new_m, new_p


def index_tensor_rows(momenta, grads, params, *, ns="kj"):
    """Own rows picked with a tensor of row indices (advanced indexing), not a view."""
    rank = dist.get_rank()
    new_m, new_p = [], []
    for m, g, p in zip(momenta, grads, params):
        buf, u = _momentum(m, g)
        s = u.size(0)
        full = fc.all_gather_tensor(u.bfloat16(), 0, dist.group.WORLD)
        rows = torch.arange(rank * s, (rank + 1) * s, device=full.device)
        new_m.append(buf)
        new_p.append(_apply(p, NEWTON_SCHULZ[ns](full)[rows], *full.shape))
    return new_m, new_p


def next_rank_rows(momenta, grads, params, *, ns="kj"):
    """Not a data-parallel step: each rank takes the next rank's rows (a bug the pass must not hide)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    new_m, new_p = [], []
    for m, g, p in zip(momenta, grads, params):
        buf, u = _momentum(m, g)
        full = fc.all_gather_tensor(u.bfloat16(), 0, dist.group.WORLD)
        new_m.append(buf)
        new_p.append(_apply(p, NEWTON_SCHULZ[ns](full).chunk(world)[(rank + 1) % world], *full.shape))
    return new_m, new_p


def column_shards(momenta, grads, params, *, ns="kj"):
    """Column shards: each rank holds [r, c / W], gathered on dim 1; own columns taken back."""
    world, rank = dist.get_world_size(), dist.get_rank()
    new_m, new_p = [], []
    for m, g, p in zip(momenta, grads, params):
        buf, u = _momentum(m, g)
        full = fc.all_gather_tensor(u.bfloat16(), 1, dist.group.WORLD)  # [r, W * k]
        new_m.append(buf)
        new_p.append(_apply(p, NEWTON_SCHULZ[ns](full).chunk(world, dim=1)[rank], *full.shape))
    return new_m, new_p


def batched_newton_schulz(momenta, grads, params, *, ns="kj"):
    """Matrices of one shape stacked [k, s, c], gathered on dim 1, orthogonalised as one batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    bufs, updates = zip(*(_momentum(m, g) for m, g in zip(momenta, grads)))
    stacked = torch.stack([u.bfloat16() for u in updates])  # [k, s, c]
    s = stacked.size(1)
    full = fc.all_gather_tensor(stacked, 1, dist.group.WORLD)  # [k, W * s, c]
    mine = NEWTON_SCHULZ[ns](full)[:, rank * s:(rank + 1) * s]
    return list(bufs), [_apply(p, o, world * s, p.size(1)) for p, o in zip(params, mine.unbind(0))]


def gather_list_stack(momenta, grads, params, *, ns="kj"):
    """`dist.all_gather(list, x)` into W buffers, stacked back into the matrix."""
    world = dist.get_world_size()
    new_m, new_p = [], []
    for m, g, p in zip(momenta, grads, params):
        buf, u = _momentum(m, g)
        send = u.bfloat16()
        pieces = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(pieces, send)
        full = torch.stack(pieces).view(world * send.size(0), send.size(1))
        new_m.append(buf)
        new_p.append(_apply(p, own_rows(NEWTON_SCHULZ[ns](full), "chunk"), *full.shape))
    return new_m, new_p


def gather_list_cat(momenta, grads, params, *, ns="torch"):
    """`dist.all_gather(list, x)` concatenated back with `torch.cat`; own rows by slicing."""
    world = dist.get_world_size()
    new_m, new_p = [], []
    for m, g, p in zip(momenta, grads, params):
        buf, u = _momentum(m, g)
        send = u.bfloat16()
        pieces = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(pieces, send)
        full = torch.cat(pieces)
        new_m.append(buf)
        new_p.append(_apply(p, own_rows(NEWTON_SCHULZ[ns](full), "slice"), *full.shape))
    return new_m, new_p


def uneven_row_shards(momenta, grads, params, *, rows, ns="kj"):
    """Rows not divisible by W: every shard padded to ceil(n / W) rows, the padding cut off after the gather,
    and this rank's rows sliced from the n-row result (the last rank's block shorter, padded back)."""
    rank = dist.get_rank()
    new_m, new_p = [], []
    for m, g, p, n in zip(momenta, grads, params, rows):
        buf, u = _momentum(m, g)
        s = u.size(0)
        full = fc.all_gather_tensor(u.bfloat16(), 0, dist.group.WORLD)[:n]
        mine = NEWTON_SCHULZ[ns](full)[rank * s:(rank + 1) * s]
        new_m.append(buf)
        new_p.append(_apply(p, torch.nn.functional.pad(mine, (0, 0, 0, s - mine.size(0))), *full.shape))
    return new_m, new_p


def whole_result_also_read(momenta, grads, params, *, ns="kj"):
    """The whole orthogonalised matrix read besides this rank's rows (its norm scales the momentum)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    new_m, new_p = [], []
    for m, g, p in zip(momenta, grads, params):
        buf, u = _momentum(m, g)
        full = fc.all_gather_tensor(u.bfloat16(), 0, dist.group.WORLD)
        o = NEWTON_SCHULZ[ns](full)
        new_m.append(buf * o.float().norm())
        new_p.append(_apply(p, o.chunk(world)[rank], *full.shape))
    return new_m, new_p


def with_gathered_bias(momenta, grads, params, *, ns="kj"):
    """A 1-D bias beside the matrices: its shard gathered too (normalised by the whole norm), no Newton-Schulz."""
    world, rank = dist.get_world_size(), dist.get_rank()
    new_m, new_p = [], []
    for m, g, p in zip(momenta, grads, params):
        buf, u = _momentum(m, g)
        new_m.append(buf)
        if p.dim() == 1:
            full = fc.all_gather_tensor(u, 0, dist.group.WORLD)
            new_p.append(p - LR * full.chunk(world)[rank] / full.norm())
            continue
        full = fc.all_gather_tensor(u.bfloat16(), 0, dist.group.WORLD)
        new_p.append(_apply(p, own_rows(NEWTON_SCHULZ[ns](full), "chunk"), *full.shape))
    return new_m, new_p


def in_place(momenta, grads, params, *, ns="torch"):
    """Momenta and parameters updated in place (`lerp_`, `mul_`, `add_`), as torch.optim's steps do."""
    for m, g, p in zip(momenta, grads, params):
        m.lerp_(g, 1 - MU)
        full = fc.all_gather_tensor(g.lerp(m, MU).bfloat16(), 0, dist.group.WORLD)
        rows, cols = full.shape
        p.mul_(1 - LR * WD).add_(own_rows(NEWTON_SCHULZ[ns](full), "chunk"), alpha=-LR * max(1.0, rows / cols) ** 0.5)
    return momenta, params


def mixed_dtypes(momenta, grads, params, *, ns="kj"):
    """Every other matrix gathered in fp32 (its update not cast to bf16), the others in bf16."""
    new_m, new_p = [], []
    for i, (m, g, p) in enumerate(zip(momenta, grads, params)):
        buf, u = _momentum(m, g)
        full = fc.all_gather_tensor(u.bfloat16() if i % 2 == 0 else u, 0, dist.group.WORLD)
        new_m.append(buf)
        new_p.append(_apply(p, own_rows(NEWTON_SCHULZ[ns](full), "chunk").to(p.dtype), *full.shape))
    return new_m, new_p


def ns_five_cubic(g: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz with other coefficients (the cubic 1.5, -0.5 as a quintic) and 5 steps."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(g, (1.5, -0.5, 0.0), 5, EPS)


NEWTON_SCHULZ["torch, 5 cubic steps"] = ns_five_cubic
