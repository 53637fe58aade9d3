"""dedicate_params: the FSDP2 backend's set-up, the model's dmuon state, no_sync and ownership.

``dedicate_params`` checks the selection, agrees on it with every rank, plans the owners,
makes each matrix's record (record.py), builds the *units* (the dedicated matrices one
layer uses, packed per owner and dtype: one broadcast each; a matrix reached from several
modules, tied weights, joins the unit of each) and registers the hooks. Everything dmuon
keeps about a model lives in one :class:`DMuonState`, at ``model._dmuon``: its placement
facts and dtypes, and one object per job, each in a file of its own:

- ``state.residency`` (residency.py): the hooks on each unit raise its events and it
  carries out the schedule (schedule.py): broadcast, land, release (Z3, Z2, prefetch);
- ``state.gradients`` (gradients.py): each matrix's post-accumulate-grad hook keeps the
  gradient under no_sync, or reduces its bucket to the owner;
- ``state.publisher`` (publish.py): after the step, HSDP's publish across replicas.

The DDP backend (ddp.py) is the same state with its own residency (every rank holds every
matrix) and publisher (each owner broadcasts to every rank).

Every rank issues the same collectives in the same order (the units' and buckets' order
is the model's; order.py checks it).

Mixed precision: when the unit sits under a ``fully_shard(..., mp_policy=...)`` with a
``param_dtype`` (or the parameter's policy has one, policy.py), the broadcast carries the
matrix in that dtype and every rank, owner included, computes with that copy; the owner
keeps its float32 master (its record's ``master``) for the optimizer, gradients are reduced
in the policy's ``reduce_dtype`` (or the parameter's ``grad_dtype``) and accumulated under
no_sync in the master's dtype (:meth:`DMuonState.compute_dtype`, :meth:`DMuonState.wire_dtype`).
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dmuon_edu.arguments import require_called_as, require_module
from dmuon_edu.distributed import release_gloo_workers_at_exit

from . import fsdp_exclusion, placeholder, residency, tp
from .boundary import HookBoundaryPredicate, HookBoundaryResolver, check_hook_boundary_arguments, hook_boundaries
from .gradients import Bucket, Gradients
from .names import fqn
from .order import CollectiveOrder, group_timeout
from .plan import plan_owners
from .policy import DMuonParamPolicy, PolicyFn, resolve_param_policies
from .publish import Publisher
from .record import MatrixRecord, TPShard, attach, record_of
from .residency import Residency, Unit
from .schedule import Schedule

__all__ = ["dedicate_params", "no_sync", "ownership", "held_bytes", "in_flight_bytes", "DMuonState", "state_of"]


@dataclass
class DMuonState:
    # The entry point that builds this kind of state, the calls that go with it (for messages), whether every
    # rank holds every dedicated matrix between uses (the DDP backend, ddp.py) or only its owner does, and whether
    # collectives not dmuon's (FSDP2's all-gathers) run in a forward between dmuon's own.
    entry: ClassVar[str] = "dedicate_params"
    order_of_calls: ClassVar[str] = ("call dmuon.dedicate_params(model, mesh, predicate) first, then fully_shard "
                                     "the layers and the model")
    holds_every_matrix: ClassVar[bool] = False
    others_collectives_in_forward: ClassVar[bool] = True
    residency_type: ClassVar[type] = Residency
    publisher_type: ClassVar[type] = Publisher

    model: nn.Module = field(repr=False)
    mesh: DeviceMesh
    reshard_after_forward: bool
    params: dict[str, nn.Parameter]  # dedicated, by name, in model order
    records: dict[str, MatrixRecord]  # what this rank knows of each, by name (record.py)
    order: CollectiveOrder = field(repr=False)  # every collective over the mesh is checked by it
    replicate_mesh: DeviceMesh | None = None  # HSDP: the replicas' axis
    replicate_order: CollectiveOrder | None = field(default=None, repr=False)  # collectives along it
    units: list[Unit] = field(default_factory=list)
    units_of: dict[nn.Parameter, list[Unit]] = field(default_factory=lambda: defaultdict(list))
    schedule: Schedule | None = None  # what the hooks do at each event (schedule.py); set once the units are known
    in_no_sync: bool = False
    # Forwards of the first unit since the last optimizer step: the micro-batch of the window, which the
    # order check's forward events name, so that ranks with different numbers of micro-batches are told so.
    microbatch: int = 0
    tp_index: int = 0  # with tensor parallelism (tp.py): this rank's TP index, and the TP mesh dim's name
    tp_name: str | None = None
    tp_order: CollectiveOrder | None = field(default=None, repr=False)  # the TP group's gathers and scatters

    def __post_init__(self):
        self.group = self.mesh.get_group()
        self.rank = self.mesh.get_local_rank()
        self.world_size = self.mesh.size()
        self.mesh_device = next(iter(self.params.values())).device
        self.name_of = {p: name for name, p in self.params.items()}
        replicated = self.replicate_mesh is not None
        self.replica = self.replicate_mesh.get_local_rank() if replicated else 0
        self.replicas = self.replicate_mesh.size() if replicated else 1
        self.replicate_group = self.replicate_mesh.get_group() if replicated else None
        self.everyone = dist.group.WORLD if replicated else self.group  # a collective over every rank
        # Its jobs, each a class of its own, whose actions run() carries out: residency, gradients, publishing
        self.residency = self.residency_type(self)
        self.gradients = Gradients(self)
        self.publisher = self.publisher_type(self)

    @property
    def orders(self) -> list[CollectiveOrder]:
        """Every CollectiveOrder of this model: the mesh's, and the replicate axis's (HSDP) and the TP group's
        where there are such; dmuon.Muon's order_check sets the mode of each."""
        return [o for o in (self.order, self.replicate_order, self.tp_order) if o is not None]

    @staticmethod
    def owner_of(p: nn.Parameter) -> int:
        """The matrix's *holder* in the mesh: the rank that keeps it whole and broadcasts it. With a
        replicate mesh there is one holder per replica, all at this index."""
        return record_of(p).holder

    def receives_gradient(self, p: nn.Parameter) -> bool:
        """Whether this rank is the matrix's holder in its replica (and TP column): the rank its averaged
        gradient is reduced to."""
        return self.owner_of(p) == self.rank

    def owns(self, p: nn.Parameter) -> bool:
        """Whether this rank holds the whole matrix between uses: its holder only."""
        return self.receives_gradient(p)

    def steps(self, p: nn.Parameter) -> bool:
        """Whether this rank is the matrix's one owner: its holder in the replica that steps it (for a TP-sharded
        matrix, the holder at its TP owner's index: tp.py)."""
        record = record_of(p)
        tp = record.tp
        return self.receives_gradient(p) and record.replica == self.replica and (tp is None or tp.index == tp.owner)

    @staticmethod
    def stepped(p: nn.Parameter) -> torch.Tensor:
        """The tensor the owner's optimizer steps for ``p``: ``p``, or a TP-sharded matrix's full-shape proxy."""
        tp = record_of(p).tp
        return p if tp is None else tp.proxy

    @staticmethod
    def full_shape(p: nn.Parameter) -> torch.Size:
        """The logical matrix's shape (a TP-sharded matrix's, not its shard's)."""
        record = record_of(p)
        return record.shape if record.tp is None else record.tp.full_shape

    def run(self, event: str, unit: Unit | None = None, subject=()) -> None:
        """The executor: carry out the schedule's actions at ``event`` (schedule.py), in order. ``unit``: the unit
        the event is about; ``subject``: what a watch hooks (the unit's inputs or outputs), a gradient event's
        (matrix, gradient), or a full bucket."""
        for action in self.schedule.actions(event, None if unit is None else unit.index):
            _EXECUTE[action.verb](self, None if action.unit is None else self.units[action.unit], subject)

    # -- dtypes ---------------------------------------------------------------------
    def compute_dtype(self, unit: Unit, p: nn.Parameter) -> torch.dtype:
        """The dtype ``p`` is broadcast and computed in: its policy's param_dtype, else fully_shard's, else its own."""
        record = record_of(p)
        return record.policy.param_dtype or self.precision(unit)[0] or record.dtype

    def wire_dtype(self, unit: Unit, p: nn.Parameter) -> torch.dtype:
        """The dtype ``p``'s gradient is reduced in: its policy's grad_dtype, else fully_shard's reduce_dtype, else
        its own."""
        record = record_of(p)
        return record.policy.grad_dtype or self.precision(unit)[1] or record.dtype

    def precision(self, unit: Unit) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(param_dtype, reduce_dtype) of the fully_shard mixed-precision policy over the unit, or Nones.

        Raises:
            ValueError: a parameter's compute_dtype (its policy's param_dtype) is not the policy's param_dtype, or a
                TP-sharded matrix would compute in a dtype other than its own.
        """
        if unit.precision is None:
            policy = None
            path = unit.path
            while True:  # the unit's module, else its nearest ancestor that fully_shard wrapped
                module = self.model.get_submodule(path)
                if isinstance(module, FSDPModule):
                    policy = module._get_fsdp_state()._mp_policy
                    break
                if not path:
                    break
                path = path.rpartition(".")[0]
            param_dtype, reduce_dtype = (policy.param_dtype, policy.reduce_dtype) if policy is not None else (None, None)
            for p in unit.params:
                wanted = record_of(p).policy.param_dtype
                if wanted is not None and param_dtype is not None and wanted != param_dtype:
                    raise ValueError(
                        f"{self.name_of[p]} has compute_dtype (param_dtype) {wanted}, but fully_shard's "
                        f"MixedPrecisionPolicy over {unit.path or 'the model'} computes in {param_dtype}: the layer's "
                        f"inputs and other parameters are cast to {param_dtype}. Pass compute_dtype={param_dtype} "
                        "(or None) to dedicate_params, or change the policy"
                    )
            for p in unit.params:
                record = record_of(p)
                dtype = record.policy.param_dtype or param_dtype
                if isinstance(p, DTensor) and dtype not in (None, record.dtype):
                    raise ValueError(
                        f"{self.name_of[p]} is tensor-parallel (a DTensor) and would compute in {dtype}, but dmuon_edu "
                        f"casts plain tensors only: a DTensor keeps its dtype ({record.dtype}). Leave compute_dtype "
                        f"and the policy's param_dtype at None for it and run the forward under torch.autocast("
                        f"device_type, dtype={dtype}), or leave the matrix out of the predicate"
                    )
            unit.precision = (param_dtype, reduce_dtype)
        return unit.precision


# Each verb of the schedule, and the call that carries it out (state, the action's unit, the event's subject).
_EXECUTE = {
    "issue": lambda state, unit, _: state.residency.issue_broadcasts(unit),
    "land": lambda state, unit, _: state.residency.land(unit),
    "release": lambda state, unit, _: state.residency.release(unit),
    "release_all": lambda state, _unit, _: state.residency.release_all(),
    "watch_backward": residency.watch_backward,
    "watch_backward_end": residency.watch_backward_end,
    "keep": lambda state, _unit, subject: state.gradients.keep(*subject),
    "merge_into_bucket": lambda state, _unit, subject: state.gradients.merge_into_bucket(*subject),
    "reduce": lambda state, _unit, bucket: state.gradients.issue_reduce(bucket),
    "reduce_partial": lambda state, _unit, _: state.gradients.reduce_partial(),
    "wait_reduces": lambda state, _unit, _: state.gradients.wait_reduces(),
    "reduce_across_replicas": lambda state, _unit, _: state.gradients.reduce_across_replicas(),
}


def state_of(model: nn.Module) -> DMuonState:
    require_module("dmuon", model, "pass the model that dmuon.dedicate_params(model, mesh, predicate) prepared")
    state = getattr(model, "_dmuon", None)
    if state is None:
        raise ValueError(
            "this model has no dedicated parameters: call dmuon.dedicate_params(model, mesh, predicate) "
            "before fully_shard, and pass that same model here"
        )
    return state


def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Callable[[str, nn.Parameter], bool],
    compute_dtype: torch.dtype | str | None = None,
    reshard_after_forward: bool = True,
    replicate_mesh: DeviceMesh | None = None,
    hook_boundary_predicate: HookBoundaryPredicate | None = None,
    hook_boundary_strict: bool = True,
    hook_boundary_resolver: HookBoundaryResolver | None = None,
    *,
    param_policy: Mapping[str, Any] | None = None,
    param_policy_fn: PolicyFn | None = None,
) -> dict[str, int]:
    """Give each parameter that ``predicate(name, param)`` selects one owner rank; call before fully_shard.

    The owner keeps the full parameter and, later, its optimizer state; the other ranks
    free their copies now and receive them by broadcast before each use. Every later
    ``fully_shard`` call leaves these parameters alone (see fsdp_exclusion).
    ``reshard_after_forward=True`` is Z3 (free after forward, broadcast again for
    backward); False is Z2 (resident from the first forward until optimizer.step(),
    through every micro-batch, since the parameters cannot change before the step).
    Returns ``{name: owner rank}``.

    HSDP: with ``replicate_mesh``, ``mesh`` is the shard axis of a 2-D ``(replicate,
    shard)`` mesh (``mesh["shard"]``, ``replicate_mesh=mesh["replicate"]``; fully_shard
    the layers on the 2-D mesh). Each matrix still has one owner, planned over every
    rank, that runs Muon on it; in every replica the rank at the owner's shard index
    holds it whole and broadcasts it within its replica. Gradients are averaged within
    each replica to that holder, then across replicas to the owner; after ``step()`` the
    owner publishes the result to the holders of the other replicas.

    Broadcasts happen per layer, on the parameter's *hook boundary* (boundary.py): by
    default the module named by the parameter's name up to its first numeric index
    (``model.layers[3]`` for "layers.3.mlp.up_proj.weight"), or the parameter's own module
    when there is no such index or that module is a container that is never called (a
    ModuleDict); ``hook_boundary_predicate`` or ``hook_boundary_resolver`` choose another
    (a module that reads a child's weight without calling the child, such as
    nn.MultiheadAttention with its ``out_proj``, needs one). Move the model to the mesh's
    device first.

    The arguments and their positional order are the public dmuon project's, up to
    ``hook_boundary_resolver``; names in the result, in state dicts and in
    ``param_policy`` are FQNs without wrapper segments (names.py).

    Args:
        model: the plain model, not yet sharded, on the mesh's device.
        mesh: a 1-D DeviceMesh over every rank of the process group, or, with
            ``replicate_mesh``, the shard axis of a 2-D mesh.
        predicate: ``predicate(name, param) -> bool``, called for each of
            ``model.named_parameters()``; it must select 2-D matrices only (or
            parameters that ``param_policy`` routes to "sharded_adamw").
        compute_dtype: the dtype dedicated matrices are broadcast and computed in (the
            default ``param_dtype`` of ``param_policy``): under a ``fully_shard`` mixed
            precision policy it must be the policy's ``param_dtype``; without one it sets
            it (run the forward under ``torch.autocast`` then). None: the policy's, else
            the parameter's own dtype.
        reshard_after_forward: True for Z3, False for Z2.
        replicate_mesh: HSDP's replicate axis of the same 2-D mesh, or None.
        hook_boundary_predicate: ``(module) -> bool``: the lowest module above each
            parameter (its own included) for which it is True carries its hooks.
        hook_boundary_strict: with ``hook_boundary_predicate`` or
            ``hook_boundary_resolver``, raise when one finds no module for a parameter
            (True, the default), or fall back to the parameter's own module (False).
        hook_boundary_resolver: ``(name, param) -> module or None``: the module that
            carries the parameter's hooks; it takes precedence over the predicate.
        param_policy: per-parameter routes and dtypes, ``{"defaults": {...},
            "overrides": [{"name": tokens, "set": {...}}, ...]}`` (policy.py).
        param_policy_fn: ``(name, param) -> mapping, DMuonParamPolicy or None``, instead
            of ``param_policy``.

    Returns:
        ``{name: owner's rank}`` for each dedicated parameter (its global rank; on a
        1-D mesh over the process group, its rank in the mesh too).

    Raises:
        ValueError: the mesh is not 1-D or does not span the process group (with
            ``replicate_mesh``: the two axes do not span it as a grid), the predicate
            selects nothing or a non-matrix, a matrix is on another device, is not
            contiguous, or shares its storage; a hook boundary cannot be found (strict); a
            policy asks for what dmuon does not do (policy.py says which fields).
        RuntimeError: the model is already sharded, or was already dedicated.
        TypeError: ``model`` is not an nn.Module, a mesh is not a DeviceMesh, ``predicate``
            is not a function of (name, param), ``reshard_after_forward`` or
            ``hook_boundary_strict`` is not a bool, or a hook boundary argument or policy
            part has the wrong type.
    """
    require_module("dedicate_params", model, "pass the model itself, before fully_shard")
    for argument, value in (("mesh", mesh), ("replicate_mesh", replicate_mesh)):
        if (value is not None or argument == "mesh") and (not isinstance(value, DeviceMesh) or value.ndim != 1):
            what = f"a {value.ndim}-D DeviceMesh" if isinstance(value, DeviceMesh) else type(value).__name__
            raise (ValueError if isinstance(value, DeviceMesh) else TypeError)(
                f"dedicate_params needs a 1-D DeviceMesh as {argument}, got {what}: use "
                "init_device_mesh(device_type, (world_size,)), or for HSDP mesh=mesh2d['shard'], "
                "replicate_mesh=mesh2d['replicate'] of init_device_mesh(device_type, (replicas, shards), "
                "mesh_dim_names=('replicate', 'shard'))"
            )
    world = dist.get_world_size() if dist.is_initialized() else None
    replicas = replicate_mesh.size() if replicate_mesh is not None else 1
    _require_predicate(predicate)
    # (a model fully_shard already sharded is refused by dedicate() below, naming the call order)
    sharded = any(isinstance(m, FSDPModule) for m in model.modules())
    tp_mesh = None if sharded else tp.find_tp_mesh(model, predicate, mesh, replicate_mesh)
    if tp_mesh is not None:
        tp.require_grid(mesh, tp_mesh)
    if replicate_mesh is not None and mesh.size() * replicas != world:
        raise ValueError(
            f"the shard mesh ({mesh.size()} ranks) times the replicate mesh ({replicas}) is not the process "
            f"group's {world} ranks: pass the two axes of one 2-D mesh over every rank"
        )
    if replicate_mesh is None and tp_mesh is None and not sharded and mesh.size() != world:
        raise ValueError(
            f"the mesh spans {mesh.size()} rank(s) but the process group has {world}: dmuon needs a mesh over "
            f"every rank of the process group; build it with init_device_mesh('{mesh.device_type}', "
            "(dist.get_world_size(),)) after the process group exists"
        )
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be True (Z3) or False (Z2), got {reshard_after_forward!r}")
    return dedicate(DMuonState, model, mesh, predicate, compute_dtype, reshard_after_forward, replicate_mesh,
                    hook_boundary_predicate, hook_boundary_strict, hook_boundary_resolver, param_policy,
                    param_policy_fn, tp_mesh=tp_mesh)


def dedicate(state_type: type[DMuonState], model: nn.Module, mesh: DeviceMesh, predicate, compute_dtype,
             reshard_after_forward: bool, replicate_mesh: DeviceMesh | None, hook_boundary_predicate,
             hook_boundary_strict, hook_boundary_resolver, param_policy, param_policy_fn,
             tp_mesh: DeviceMesh | None = None) -> dict[str, int]:
    """What dedicate_params and dedicate_params_ddp (ddp.py) share once their meshes are checked: the
    selection and its checks, the plan, the per-parameter records and hooks, the units. ``state_type`` says
    who holds a matrix between uses (DMuonState: its owner only); ``tp_mesh`` is the TP axis of TP-sharded
    matrices (tp.py), None without."""
    entry = state_type.entry
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RuntimeError(f"the model is already sharded by fully_shard: {state_type.order_of_calls}")
    if getattr(model, "_dmuon", None) is not None:
        raise RuntimeError(f"{entry} (or another dmuon entry point) was already called on this model; call it once")
    _require_predicate(predicate)
    check_hook_boundary_arguments(hook_boundary_predicate, hook_boundary_strict, hook_boundary_resolver)
    params, policy_of = _select(state_type, model, mesh, predicate, compute_dtype, param_policy, param_policy_fn,
                                tp_mesh)
    dedicated = {id(p) for p in params.values()}
    aliases = [(alias, p) for alias, p in model.named_parameters(remove_duplicate=False) if id(p) in dedicated]
    boundaries = hook_boundaries(model, aliases, hook_boundary_predicate, hook_boundary_strict, hook_boundary_resolver)
    # With TP the grid is (TP index, DP index): each TP column is a data-parallel world of its own.
    key, rank_at = _agree_on_every_rank(entry, params, policy_of, mesh, replicate_mesh or tp_mesh)
    replicas = replicate_mesh.size() if replicate_mesh is not None else 1
    plan, owners, tp_sharded, tp_owner = _plan(params, mesh.size(), replicas, rank_at, tp_mesh)
    shards = mesh.size()
    # Every replica runs the same events on its shard axis: one key for all ranks. The replicate axis has a key
    # per shard index, shared by that column's ranks.
    # A rank that may wait in another's collective after a layer's forward must report it got there (order.py).
    order = CollectiveOrder(key, dist.get_rank(), range(dist.get_world_size()), mesh.get_group(),
                            report_notes=state_type.others_collectives_in_forward or tp_mesh is not None)
    replicate_order = (CollectiveOrder(f"{key}/replicate-axis-{mesh.get_local_rank()}", dist.get_rank(),
                                       dist.get_process_group_ranks(replicate_mesh.get_group()),
                                       replicate_mesh.get_group())
                       if replicate_mesh is not None else None)
    records = {}
    for name, p in params.items():
        # a DTensor's local tensor (its shard), outside autograd: the master is written in place
        local = residency.local(p).detach() if isinstance(p, DTensor) else p.data
        records[name] = MatrixRecord(name, holder=plan[name] % shards, replica=plan[name] // shards,
                                     owner_rank=owners[name], shape=local.shape, dtype=p.dtype,
                                     policy=policy_of[name], master=local, own_class=type(p))
        attach(p, records[name])
    state = state_type(model, mesh, reshard_after_forward, params, records, order, replicate_mesh, replicate_order)
    if tp_mesh is not None:  # across the TP group of each DP index: its gathers and scatters
        state.everyone = dist.group.WORLD
        state.tp_order = CollectiveOrder(f"{key}/tp-axis-{mesh.get_local_rank()}", dist.get_rank(),
                                         dist.get_process_group_ranks(tp_mesh.get_group()), tp_mesh.get_group())
        state.tp_index = tp_mesh.get_local_rank()
        state.tp_name = tp_mesh.mesh_dim_names[0]
    fsdp_exclusion.install()
    if dist.get_backend() == "gloo":
        release_gloo_workers_at_exit()
    tp_placement = {name: TPShard(tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size(), tp_sharded[name],
                                  tp_owner[name], params[name].shape, state.tp_order) for name in tp_sharded}
    _place_matrices(state, tp_placement)
    for module in {model.get_submodule(alias.rpartition(".")[0]) for alias, p in aliases
                   if isinstance(p, DTensor) and not state.owns(p)}:
        placeholder.guard_state_dict(module)
    _build_units(model, state, aliases, boundaries)
    state.schedule = Schedule(len(state.units), reshard_after_forward, replicas=state.replicas)
    model._dmuon = state
    return dict(owners)


def _place_matrices(state: DMuonState, tp_placement: dict[str, TPShard]) -> None:
    """Each matrix's TP placement (a full-shape proxy on the rank that steps it), a non-owner's placeholder instead
    of its values, and the gradient hook of a trainable one."""
    for name, p in state.params.items():
        record = state.records[name]
        record.tp = tp_placement.get(name)
        if record.tp is not None and state.receives_gradient(p) and record.tp.index == record.tp.owner:
            record.tp.proxy = torch.zeros(p.shape, dtype=p.dtype, device=record.master.device)
        if not state.owns(p):
            record.master = None
            placeholder.make_placeholder(p)
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(residency.outside_dynamo(state.gradients.on_grad))


def _select(state_type: type[DMuonState], model: nn.Module, mesh: DeviceMesh, predicate, compute_dtype,
            param_policy, param_policy_fn, tp_mesh: DeviceMesh | None
            ) -> tuple[dict[str, nn.Parameter], dict[str, DMuonParamPolicy]]:
    """The matrices to dedicate, by name (without wrapper segments), and every selected parameter's policy;
    raises ValueError, naming the fix, for a selection dmuon cannot take."""
    entry = state_type.entry
    selected = {name: p for name, p in model.named_parameters() if predicate(name, p)}
    if not selected:
        raise ValueError(
            "the predicate selected no parameter: it is called as predicate(name, param) for each of "
            "model.named_parameters(); e.g. lambda n, p: 'proj' in n and p.ndim == 2"
        )
    policies = resolve_param_policies(selected, compute_dtype, param_policy, param_policy_fn)
    if state_type.holds_every_matrix:
        sharded = next((name for name, policy in policies.items() if policy.route == "sharded_adamw"), None)
        if sharded is not None:
            raise ValueError(
                f"param_policy routes {sharded} to 'sharded_adamw', AdamW on fully_shard's shards, but {entry} "
                "shards nothing: route it to 'adamw' (its owner steps it with AdamW), or leave it out of the "
                "predicate (dmuon.replicate then all-reduces its gradient and every rank steps it with AdamW)"
            )
    # "sharded_adamw" is AdamW on shards: what fully_shard does with a parameter dmuon leaves alone.
    params = {fqn(name): p for name, p in selected.items() if policies[name].route != "sharded_adamw"}
    if not params:
        raise ValueError(
            "param_policy routes every selected parameter to 'sharded_adamw', which leaves it to fully_shard: "
            "route the matrices for Muon to 'muon' (the default)"
        )
    routes = {fqn(name): policy.optimizer for name, policy in policies.items()}
    for name, p in params.items():
        _require_dedicatable(state_type, name, p, routes[name], mesh, tp_mesh)
    return params, {fqn(name): policy for name, policy in policies.items()}


def _require_dedicatable(state_type: type[DMuonState], name: str, p: nn.Parameter, route: str, mesh: DeviceMesh,
                         tp_mesh: DeviceMesh | None) -> None:
    """Raise ValueError, naming the fix, unless ``p`` can be dedicated: a 2-D matrix on the mesh's device, in a
    block of memory of its own, a DTensor only on the TP axis and then routed to Muon."""
    entry = state_type.entry
    if isinstance(p, DTensor) and tp_mesh is None and p.device_mesh.size() == 1:
        raise ValueError(
            f"{name} is a DTensor on a tensor-parallel mesh of 1 rank ({p.device_mesh.mesh_dim_names}), which "
            f"shards nothing, and {entry} takes plain matrices then: skip parallelize_module when the TP degree "
            "is 1 (and pass the whole data-parallel mesh), or use a TP degree of 2 or more"
        )
    if isinstance(p, DTensor) and tp_mesh is None:
        raise ValueError(
            f"{name} is a DTensor (tensor parallel), which {entry} does not take: tensor parallelism goes with "
            "dmuon.dedicate_params(model, mesh['dp'], ...) on a (dp, tp) mesh with mesh_dim_names, then "
            "fully_shard(..., mesh=mesh['dp']); or, for the DDP backend, dmuon.dedicate_params_ddp_tp(model, "
            "mesh['dp'], ...), then dmuon.replicate_tp(model, mesh['dp'])"
        )
    if tp.shard_dim(p, tp_mesh) is not None and route != "muon":
        # The DDP backend refuses 'sharded_adamw' (above), so it must not be the way out there.
        raise ValueError(
            f"param_policy routes the tensor-parallel matrix {name} to AdamW on its owner, which dmuon_edu does "
            "not do for TP shards: " + (
                "route it to 'muon', or leave it out of the predicate (dmuon.replicate_tp then averages its "
                "shards' gradients and every rank steps them with AdamW)" if state_type.holds_every_matrix else
                "route it to 'sharded_adamw' (fully_shard then shards it with its TP layout) or to 'muon'")
        )
    if p.ndim != 2:
        raise ValueError(
            f"the predicate selected {name} of shape {tuple(p.shape)}: only 2-D matrices can be dedicated "
            "(Muon orthogonalises matrices); add `and p.ndim == 2` to the predicate, or route it to "
            "'sharded_adamw' with param_policy (fully_shard then shards it and AdamW steps the shards)"
        )
    if p.device.type != mesh.device_type:
        raise ValueError(
            f"{name} is on {p.device} but the mesh is on {mesh.device_type}: move the model to the mesh's "
            f"device first (e.g. model.to('{mesh.device_type}')), then call {entry}"
        )
    # A dedicated matrix travels as one block of memory of its own, and its non-owners free that memory.
    local = residency.local(p)
    if not local.is_contiguous():
        raise ValueError(f"{name} is not contiguous (a transposed or expand()-ed view), and a dedicated matrix "
                         "travels as one block of memory of its own: replace it with "
                         f"nn.Parameter(weight.detach().contiguous()) before {entry}")
    if local.storage_offset() != 0 or local.untyped_storage().nbytes() != local.numel() * local.element_size():
        raise ValueError(f"{name} shares its storage with another tensor (it is a view into a larger one); "
                         "dedicated parameters need their own: replace it with "
                         f"nn.Parameter(weight.detach().clone()) before {entry}")


def _plan(params: dict[str, nn.Parameter], shards: int, replicas: int, rank_at: dict[tuple[int, int], int],
          tp_mesh: DeviceMesh | None) -> tuple[dict[str, int], dict[str, int], dict[str, int], dict[str, int]]:
    """(plan index of each matrix's owner, its global rank, the sharded dim of each TP-sharded matrix, the TP
    index of each one's TP owner). Owner g of the plan: replica g // shards, shard index g % shards."""
    plan = plan_owners({name: tuple(p.shape) for name, p in params.items()}, shards * replicas)
    owners = {name: rank_at[divmod(g, shards)] for name, g in plan.items()}
    tp_sharded = {name: tp.shard_dim(p, tp_mesh) for name, p in params.items() if tp.shard_dim(p, tp_mesh) is not None}
    tp_owner: dict[str, int] = {}
    if tp_mesh is not None:
        column = tp_mesh.get_local_rank()
        for d in range(shards):  # per DP owner, its TP group shares the Newton-Schulz work on full matrices
            tp_owner.update(plan_owners({n: tuple(params[n].shape) for n in tp_sharded if plan[n] == d},
                                        tp_mesh.size()))
        owners = {name: rank_at[(tp_owner.get(name, column), g)] for name, g in plan.items()}
    return plan, owners, tp_sharded, tp_owner


def _require_predicate(predicate) -> None:
    require_called_as("predicate", predicate, "predicate(name, param)", ("name", None),
                      "pass a function of (name, param), e.g. lambda n, p: 'proj' in n and p.ndim == 2")


def _agree_on_every_rank(entry: str, params: dict[str, nn.Parameter], policies: dict[str, DMuonParamPolicy],
                         mesh: DeviceMesh, replicate_mesh: DeviceMesh | None) -> tuple[str, dict[tuple[int, int], int]]:
    """Every rank must dedicate the same matrices, with the same shapes, dtypes and policies, or the broadcasts
    pair wrongly; with a replicate mesh, the two axes must cover the process group as a grid.

    Returns a store key for this model's CollectiveOrder that every rank shares (rank 0's), and
    ``{(replica, shard index): global rank}``.
    """
    mine = [(name, tuple(p.shape), str(p.dtype), str(policies[name].param_dtype), str(policies[name].grad_dtype),
             policies[name].optimizer) for name, p in params.items()]
    replica = replicate_mesh.get_local_rank() if replicate_mesh is not None else 0
    here = (f"dmuon/order/{uuid.uuid4().hex}", mine, (replica, mesh.get_local_rank()), dist.get_rank())
    group = mesh.get_group() if replicate_mesh is None else dist.group.WORLD
    _meet_every_rank(entry, group)
    everyone: list = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(everyone, here, group=group)
    except RuntimeError as error:
        raise RuntimeError(
            f"{entry}: not every rank called {entry} within the collective timeout. Every rank "
            "must call it, with the same model and predicate"
        ) from error
    for _, theirs, _, rank in everyone:
        if theirs != mine:
            first = next((a, b) for a, b in itertools.zip_longest(mine, theirs) if a != b)
            stages = ("" if {m[0] for m in theirs} & {m[0] for m in mine} else
                      " No name is on both ranks: if each holds a pipeline stage, dmuon does not support pipeline "
                      "parallelism (every rank of its mesh holds the whole model, or its TP shards); step a stage's "
                      "matrices with dmuon_edu.Muon on each rank instead, or use FSDP2, HSDP or TP with dmuon.")
            raise RuntimeError(
                f"{entry}: rank {dist.get_rank()} and rank {rank} selected different matrices; the first "
                f"difference is {first[0]} here and {first[1]} there (name, shape, dtype, param_dtype, grad_dtype, "
                "optimizer). The predicate and the policy must select the same on every rank: make them depend "
                f"on names and shapes only.{stages}"
            )
    rank_at = {coordinates: rank for _, _, coordinates, rank in everyone}
    grid = {(r, s) for r in range(replicate_mesh.size() if replicate_mesh is not None else 1) for s in range(mesh.size())}
    if set(rank_at) != grid or len(rank_at) != len(everyone):
        raise ValueError(
            "mesh and replicate_mesh are not the two axes of one 2-D mesh: every (replica, shard) pair must be "
            "exactly one rank. Pass mesh2d['shard'] and mesh2d['replicate'] of the same init_device_mesh"
        )
    return everyone[0][0], rank_at


# Per process group: how many times this rank has entered dedicate_params (or its DDP forms) on it.
_ENTRIES: dict[str, int] = defaultdict(int)


def _meet_every_rank(entry: str, group: dist.ProcessGroup) -> None:
    """Wait, in the store, until every rank of ``group`` has entered ``entry`` as often as this one; raise naming
    those that did not within the group's timeout.

    A rank that never calls ``entry`` runs something else on the group meanwhile: the first collective of the
    others would meet one of another size, which gloo answers by aborting the process natively. Only a timed
    wait can tell a rank that never comes from a slow one, and the store's is one that cannot mismatch.
    """
    store = dist.distributed_c10d._get_default_store()
    _ENTRIES[group.group_name] += 1
    prefix = f"dmuon/entered/{group.group_name}/{_ENTRIES[group.group_name]}"
    ranks = dist.get_process_group_ranks(group)
    store.set(f"{prefix}/{dist.get_rank()}", entry)
    timeout = group_timeout(group)
    try:
        store.wait([f"{prefix}/{rank}" for rank in ranks], timeout)
    except RuntimeError:  # DistStoreError: not every key in time
        absent = [rank for rank in ranks if not store.check([f"{prefix}/{rank}"])]
        raise RuntimeError(
            f"{entry}: rank(s) {', '.join(map(str, absent))} did not call {entry} within the group's timeout "
            f"({timeout.total_seconds():g} s), while rank {dist.get_rank()} waited for them. Every rank must call "
            f"it, with the same model and predicate: a call under `if rank == 0:` leaves the others out"
        ) from None


def _build_units(model: nn.Module, state: DMuonState, aliases: list[tuple[str, nn.Parameter]],
                 boundaries: dict[str, str]) -> None:
    """One unit per hook boundary that uses dedicated matrices; a tied matrix joins the unit of every module that
    holds it. A unit packs its matrices by owner and dtypes (the master's, and the policy's param and grad dtypes)."""
    by_path: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for alias, p in aliases:
        by_path.setdefault(boundaries[alias], []).append((alias, p))
    for path, used in by_path.items():
        packs: dict[tuple, list[nn.Parameter]] = {}
        for _, p in used:
            record = record_of(p)
            key = (record.holder, str(record.dtype), str(record.policy.param_dtype), str(record.policy.grad_dtype))
            pack = packs.setdefault(key, [])
            if all(q is not p for q in pack):  # identity: == on tensors compares values
                pack.append(p)
        unit = Unit(path, len(state.units), [(key[0], ps) for key, ps in sorted(packs.items())])
        state.units.append(unit)
        for owner, ps in unit.packs:
            for p in ps:
                state.units_of[p].append(unit)
            # A tied matrix's gradient is complete after the backward of its first unit.
            gradients = state.gradients
            first_use = [p for p in ps if p not in gradients.bucket_of]
            for replica in sorted({record_of(p).replica for p in first_use}):
                members = [p for p in first_use if record_of(p).replica == replica]
                bucket = Bucket(unit, owner, replica, members)
                gradients.buckets.append(bucket)
                gradients.bucket_of.update((p, bucket) for p in members)
        module = model.get_submodule(path)
        outside_dynamo = residency.outside_dynamo
        module.register_forward_pre_hook(
            outside_dynamo(lambda _m, args, kwargs, unit=unit: residency.before_forward(state, unit, (args, kwargs))),
            with_kwargs=True)
        module.register_forward_hook(
            outside_dynamo(lambda _m, _args, output, unit=unit: residency.after_forward(state, unit, output)))
        # A safety net, for code that calls a layer's parts without calling the layer:
        # the module holding the parameter makes the unit resident too (a no-op if it is).
        for own in {alias.rpartition(".")[0] for alias, _ in used} - {path}:
            model.get_submodule(own).register_forward_pre_hook(residency.resident_before(state.residency, unit))


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally, with no communication of either kind, until the block ends.

    Dedicated gradients add into their records' ``accumulated_grad`` on every rank; the FSDP2
    modules get ``set_requires_gradient_sync(False)``. The first backward after the
    block reduces everything accumulated. Run the forward inside the block too.
    """
    state = state_of(model)
    if state.in_no_sync:  # nested: the outer block restores
        yield
        return
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    state.in_no_sync = True
    for m in fsdp_modules:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        state.in_no_sync = False
        for m in fsdp_modules:
            m.set_requires_gradient_sync(True, recurse=False)


def ownership(model: nn.Module) -> dict[str, int]:
    """``{name: owner rank in the mesh}`` for each dedicated parameter of ``model``.

    Raises:
        ValueError: ``dedicate_params`` was never called on ``model``.
    """
    return {name: record.owner_rank for name, record in state_of(model).records.items()}


def held_bytes(model: nn.Module) -> int:
    """Bytes of dedicated-matrix values this rank holds right now, each storage counted once.

    An owner holds its matrices (and, under a mixed-precision policy while a layer uses
    them, their compute copies); a non-owner holds only the copies that are resident,
    i.e. nothing between optimizer steps. Exact, unlike a profiler's peak.

    Raises:
        ValueError: ``dedicate_params`` was never called on ``model``.
    """
    state = state_of(model)
    storages: dict[int, int] = {}
    with torch._C.DisableTorchFunctionSubclass():
        for p in state.params.values():
            for t in (residency.local(p), record_of(p).master) if state.owns(p) else (residency.local(p),):
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def in_flight_bytes(model: nn.Module) -> int:
    """Bytes of the broadcast buffers this rank has in flight right now, which :func:`held_bytes` leaves out.

    A broadcast issued ahead of its layer (the forward prefetch, or the backward's) owns a
    packed buffer until the layer lands it: on the owner a copy of its matrices, on the other
    ranks the space they receive into. Exact, like :func:`held_bytes`.

    Raises:
        ValueError: ``dedicate_params`` was never called on ``model``.
    """
    state = state_of(model)
    return sum(sent.flat.untyped_storage().nbytes() for unit in state.units for sent in unit.in_flight)

