"""Distributed checkpoints of expert-parallel MoE weights and optimizer state, with resharding.

Expert weights live in one of two layouts, and both are saved with
``torch.distributed.checkpoint`` (DCP) so that a checkpoint written on ``N`` ranks loads on any
``M`` ranks.

**Contiguous expert parallelism.** Each stacked expert weight (``w1 [E, D, F]``, ``w2 [E, F, D]``,
``w3 [E, D, F]``) is a DTensor on a 1-D expert-parallel mesh with placement ``Shard(0)``: expert e
lives on rank ``e // (E / R)``. Adam's ``exp_avg`` / ``exp_avg_sq`` are created with
``zeros_like(param)`` and are DTensors with the same placement. DCP stores each DTensor by its
global shape and chunk offsets and reshards on load, so nothing MoE-specific is needed;
:func:`save_expert_parallel_checkpoint` and :func:`load_expert_parallel_checkpoint` are the few
lines that go through :func:`~torch.distributed.checkpoint.state_dict.get_state_dict` /
:func:`~torch.distributed.checkpoint.state_dict.set_state_dict` (which create the optimizer
state of a fresh optimizer before loading into it) and check the shapes against the checkpoint
first, so that a mismatch is a ``ValueError`` naming the entry rather than an error raised from
inside DCP's collective planning.

**Placement with replicas** (:class:`~torch_moe.distributed.placement.Placement`). Rank r holds
``[S, ...]`` rows for each expert weight and each per-expert optimizer state; its slot s is
physical slot ``p = r * S + s`` and holds logical expert ``phys_to_logical[p]``. Hot experts
have several slots holding identical data. ``ExpertParallel(slots_per_rank=S)`` keeps them as
``Shard(0)`` DTensors of global size ``P = R * S``: DCP saves and loads those like any other
DTensor, physical rows and all, and a resume on the same ``R`` and ``S`` is bit-exact when the
placement tables are saved and loaded with them
(:func:`torch_moe.distributed.replicas.placement_state_dict` in ``extra_state``). To change
``R``, ``S`` or the placement across a checkpoint, store the *logical* tensor ``[E, ...]``,
independent of the placement (from the DTensors' ``to_local()`` shards, or from plain local
tensors):

* :func:`logical_expert_state_dict` replaces each expert entry of a state dict by an ``[E, ...]``
  stand-in whose chunks are the rows of this rank's *primary* slots (``logical_to_phys[e, 0]``),
  so every expert is written exactly once whatever its number of replicas. Pass the result to
  :func:`torch.distributed.checkpoint.save`.
* :func:`load_logical_expert_state_dict` reads, for any new placement (any ``R``, any replicas),
  the logical rows of this rank's slots straight into the local tensors, in place.

Design choice: the ``[E, ...]`` stand-in is a tensor subclass implementing DCP's checkpointable
protocol (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, the
hooks through which DTensor itself is saved; private to DCP, so its use is kept to those three
methods). It has to be a ``Tensor``: DCP looks a chunk up by its offset only in tensors. It is
an expanded one-element tensor, so it allocates nothing. Each maximal run of slots
``s0, s0 + 1, ...`` holding experts ``e0, e0 + 1, ...`` is one chunk at offset ``(e0, 0, ...)``
and is a view of the local tensor, so saving copies nothing and loading writes into the slots
directly. The alternatives were worse:

* a DTensor ``Shard(0)`` can only describe contiguous blocks of experts in rank order, while a
  placement puts arbitrary experts on a rank;
* ``ShardedTensor`` (deprecated) can describe per-run shards for saving, but its global metadata
  must not overlap, and on loading two ranks holding replicas of one expert do need overlapping
  rows;
* saving one entry per expert would make the checkpoint depend on the granularity chosen here
  and could not be read as a plain ``[E, ...]`` tensor.

Because the stand-in is a regular entry of the state dict, non-expert entries (router, norms,
``step``, param groups) go through DCP unchanged, and the stored tensor is an ordinary
``[E, ...]`` entry: a checkpoint of a placed model loads into a single-process model as a plain
tensor, and a placement loads from a plain or a DTensor ``Shard(0)`` checkpoint with the same
keys.
Every read fully overwrites what it targets, so loading is bit-exact; tensors are read in the
checkpoint's dtype, which must equal the local one.

**Restarts: atomic commit and the latest complete checkpoint.** A job that restarts after a
failure (``torchrun --max-restarts``) resumes from the newest checkpoint that was written in
full, and must never read one whose writing was interrupted. :func:`atomic_checkpoint` gives
the checkpoint of step ``n`` the id ``D/step_<n, 8 digits>.tmp-<suffix>`` while it is written
and renames it to ``D/step_<n>`` once the body (e.g. :func:`save_expert_parallel_checkpoint`)
has returned on every rank and its ``.metadata`` is on disk; :func:`latest_checkpoint` considers
only committed names holding a ``.metadata``. ``os.rename`` of a directory is atomic on one
filesystem, so a reader sees either no ``step_<n>`` or a complete one; temporary directories
of an interrupted save are removed by the next save. DCP alone does not give this: a reader
cannot tell a directory being written from a finished one, and rewriting an existing
checkpoint id leaves old and new files mixed until its ``.metadata`` is replaced. Rank 0 of
the group makes every filesystem decision (scan, clean-up, rename) and broadcasts it, so the
ranks agree on the checkpoint to load even where their views of a shared filesystem differ,
and a failure raises the same error on every rank instead of leaving the others in a
collective. The protocol knows nothing of MoE (its upstream home would be
``torch.distributed.checkpoint``); it sits here because the expert-parallel checkpoints above
are what a restarted MoE job loads, with any extra state (data position, RNG, scheduler,
placement tables) passed as ``extra_state`` next to the model and optimizer.
"""

import contextlib
import os
import re
import shutil
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn, Tensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from torch_moe.distributed.placement import Placement

__all__ = [
    "logical_expert_state_dict",
    "load_logical_expert_state_dict",
    "expert_runs",
    "save_expert_parallel_checkpoint",
    "load_expert_parallel_checkpoint",
    "atomic_checkpoint",
    "latest_checkpoint",
]

ExpertKeys = Union[Collection[str], Callable[[str], bool]]
CheckpointId = Union[str, os.PathLike]


# ---------------------------------------------------------------------------------------------
# Mapping between local slots and logical experts
# ---------------------------------------------------------------------------------------------


def _check_placement(fn: str, placement, rank) -> int:
    if not isinstance(placement, Placement):
        raise ValueError(f"{fn}: expected placement to be a Placement, but got "
                         f"{type(placement).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"{fn}: expected rank to be an int, but got {rank!r}")
    if not 0 <= rank < placement.num_ranks:
        raise ValueError(f"{fn}: expected rank in [0, {placement.num_ranks}) for a placement on "
                         f"{placement.num_ranks} ranks, but got {rank}")
    return rank


def expert_runs(placement: Placement, rank: int, *, primary_only: bool) -> list:
    """The local slots of ``rank`` grouped into runs of consecutive slots holding consecutive
    logical experts.

    Args:
        placement: the :class:`Placement` of the local tensors.
        rank: the expert-parallel rank, in ``[0, R)``.
        primary_only: keep only the slots that are the primary (lowest physical) slot of their
            expert, i.e. the slots that write the expert when saving. Otherwise keep, for each
            expert held by ``rank``, its first slot on ``rank``: the slots that read the expert
            when loading (the other slots of the same expert on the rank are copies of it).

    Returns:
        A list of ``(slot, expert, length)``: slots ``[slot, slot + length)`` hold logical
        experts ``[expert, expert + length)``. Each expert appears at most once, runs are in
        slot order.
    """
    fn = "expert_runs"
    rank = _check_placement(fn, placement, rank)
    S = placement.slots_per_rank
    phys = torch.arange(rank * S, (rank + 1) * S)
    experts = placement.phys_to_logical[phys]
    if primary_only:
        keep = placement.logical_to_phys[experts, 0] == phys
    else:
        # the first slot of each expert on this rank: slots are scanned in order, and a slot is
        # kept when no earlier slot of the rank holds the same expert
        keep = torch.ones(S, dtype=torch.bool)
        seen = set()
        for s, e in enumerate(experts.tolist()):
            keep[s] = e not in seen
            seen.add(e)
    runs = []
    for s, e in zip(keep.nonzero().flatten().tolist(), experts[keep].tolist()):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == e:
            runs[-1][2] += 1
        else:
            runs.append([s, e, 1])
    return [tuple(r) for r in runs]


# ---------------------------------------------------------------------------------------------
# DCP stand-in for a logical [E, ...] tensor of which this rank holds some rows
# ---------------------------------------------------------------------------------------------


class _LogicalExpertChunks(Tensor):
    """A logical ``[E, ...]`` expert tensor of which this rank holds chunks of whole experts.

    The object itself has the global shape, dtype and device but no data of its own (it is a
    one-element tensor expanded to ``[E, ...]``); DCP only reads its size and goes through the
    checkpointable protocol below for the chunks. Running ops on it is an error.
    """

    _chunks: list  # [(expert offset, Tensor [n, ...] view of the local slots)]

    @staticmethod
    def __new__(cls, size: torch.Size, chunks: list, like: Tensor):
        # ``expand`` gives the global size without allocating it; ``as_subclass`` is the public
        # way to make a tensor subclass instance out of it.
        base = torch.zeros((), dtype=like.dtype, device=like.device).expand(size)
        r = base.as_subclass(cls)
        r._chunks = chunks
        return r

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # metadata queries (size, dtype, device, ...) are fine; anything that would compute on
        # the expanded placeholder is a bug in the caller
        if getattr(func, "__name__", None) in _METADATA_QUERIES:
            return super().__torch_function__(func, types, args, kwargs)
        raise RuntimeError(
            f"{getattr(func, '__name__', func)} on a logical expert stand-in: it only carries "
            f"chunks for torch.distributed.checkpoint; use the local slot tensors instead")

    def __repr__(self) -> str:
        return (f"_LogicalExpertChunks(size={tuple(self.shape)}, dtype={self.dtype}, "
                f"experts={[(e, t.size(0)) for e, t in self._chunks]})")

    def _storage_chunks(self) -> list:
        return [ChunkStorageMetadata(offsets=torch.Size((e,) + (0,) * (t.dim() - 1)),
                                     sizes=t.size()) for e, t in self._chunks]

    # DCP's checkpointable protocol (``torch.distributed._checkpointable``, duck-typed by
    # ``torch.distributed.checkpoint.planner_helpers`` and ``utils``) is private: it is used in
    # these three methods only, and _dcp_write_item builds what it returns.
    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        return [_dcp_write_item(fqn, chunk, t, self.size())
                for chunk, (_, t) in zip(self._storage_chunks(), self._chunks)]

    def __create_chunk_list__(self) -> list:
        return self._storage_chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        for e, t in self._chunks:
            if index.offset is not None and index.offset[0] == e:
                return t
        raise ValueError(f"no chunk of {index.fqn!r} at offset {index.offset}")


# ``__get__`` covers the property getters: shape, dtype, device, ndim, is_meta, ...
_METADATA_QUERIES = {"size", "dim", "numel", "stride", "__get__"}


def _dcp_write_item(fqn: str, chunk: ChunkStorageMetadata, data: Tensor,
                    size: torch.Size) -> WriteItem:
    """One shard write of ``data`` at ``chunk`` of a tensor of global ``size``: the item the
    private checkpointable protocol expects from ``__create_write_items__`` (the classes are
    public, what the protocol wants of them is not)."""
    return WriteItem(
        index=MetadataIndex(fqn, chunk.offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk,
                                    properties=TensorProperties.create_from_tensor(data),
                                    size=size),
    )


# ---------------------------------------------------------------------------------------------
# Placement with replicas: public API
# ---------------------------------------------------------------------------------------------


def _expert_key_set(fn: str, state_dict, expert_keys) -> list:
    if not isinstance(state_dict, dict):
        raise ValueError(f"{fn}: expected state_dict to be a dict, but got "
                         f"{type(state_dict).__name__}")
    if callable(expert_keys):
        return [k for k in state_dict if expert_keys(k)]
    if isinstance(expert_keys, str) or not isinstance(expert_keys, Collection):
        raise ValueError(f"{fn}: expected expert_keys to be a collection of keys or a callable, "
                         f"but got {expert_keys!r}")
    missing = [k for k in expert_keys if k not in state_dict]
    if missing:
        raise ValueError(f"{fn}: expected every expert key in state_dict, but {missing} are "
                         f"missing")
    return list(expert_keys)


def _check_local(fn: str, key: str, t, placement: Placement) -> None:
    # a DTensor parameter is a DTensor, not an nn.Parameter: layout 1 goes through
    # save_expert_parallel_checkpoint instead
    if type(t) not in (Tensor, nn.Parameter) or t.layout != torch.strided:
        kind = type(t).__name__ if not isinstance(t, Tensor) else f"{type(t).__name__} {t.layout}"
        raise ValueError(f"{fn}: expected {key!r} to be a plain strided local tensor [S, ...], "
                         f"but got {kind}")
    if t.dim() == 0 or t.size(0) != placement.slots_per_rank:
        raise ValueError(f"{fn}: expected dim 0 of {key!r} to be slots_per_rank = "
                         f"{placement.slots_per_rank}, but got shape {tuple(t.shape)}")


def logical_expert_state_dict(state_dict: dict, placement: Placement, rank: int,
                              expert_keys: ExpertKeys) -> dict:
    """Turns this rank's local expert slots into entries of the logical experts, for saving.

    Args:
        state_dict: flat dict of this rank's state. Expert entries are local tensors ``[S, ...]``
            (``w1 [S, D, F]``, ``w2 [S, F, D]``, their ``exp_avg`` / ``exp_avg_sq``) laid out by
            ``placement``; other entries may be anything DCP saves.
        placement: the :class:`Placement` of the local tensors, the same on every rank.
        rank: this rank's index in the expert-parallel group, in ``[0, R)``.
        expert_keys: the keys of the expert entries, or a predicate on keys.

    Returns:
        A new dict for :func:`torch.distributed.checkpoint.save`: each expert entry is an
        ``[E, ...]`` stand-in holding views of this rank's primary slots (the replicas of an
        expert are written once, by the rank of ``logical_to_phys[e, 0]``); other entries are
        the same objects as in ``state_dict``. Nothing is copied.
    """
    fn = "logical_expert_state_dict"
    rank = _check_placement(fn, placement, rank)
    keys = _expert_key_set(fn, state_dict, expert_keys)
    runs = expert_runs(placement, rank, primary_only=True)
    out = dict(state_dict)
    for k in keys:
        t = state_dict[k]
        _check_local(fn, k, t, placement)
        t = t.detach()
        size = torch.Size((placement.num_logical,) + tuple(t.shape[1:]))
        chunks = [(e, t.narrow(0, s, n)) for s, e, n in runs]
        out[k] = _LogicalExpertChunks(size, chunks, t)
    return out


def _read_metadata(fn: str, checkpoint_id, storage_reader) -> Metadata:
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError(f"{fn}: expected checkpoint_id or storage_reader, but got neither")
        if not os.path.isdir(checkpoint_id):
            raise ValueError(f"{fn}: expected checkpoint_id to be a checkpoint directory, but "
                             f"{os.fspath(checkpoint_id)!r} is not a directory")
        storage_reader = dcp.FileSystemReader(checkpoint_id)
    elif checkpoint_id is not None:
        storage_reader.reset(checkpoint_id)
    return storage_reader.read_metadata()


def load_logical_expert_state_dict(state_dict: dict, placement: Placement, rank: int,
                                   expert_keys: ExpertKeys, *,
                                   checkpoint_id: Optional[CheckpointId] = None,
                                   storage_reader: Optional[dcp.StorageReader] = None,
                                   process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Loads a checkpoint of logical experts into this rank's local slots, in place.

    The checkpoint may come from :func:`logical_expert_state_dict` under any placement, from a
    DTensor ``Shard(0)`` model or from a single process (plain ``[E, ...]`` tensors): it stores
    logical experts. Every slot of ``rank`` receives the row of its logical expert; a rank
    holding two slots of one expert reads it once and copies it.

    Args:
        state_dict: flat dict of this rank's state, as for :func:`logical_expert_state_dict`,
            laid out under the *new* ``placement``. Expert entries (``w1 [S, D, F]``, ...) are
            overwritten in place; the other entries are loaded by DCP as usual (tensors in
            place, other values replaced in ``state_dict``).
        placement: the new :class:`Placement`; its ``E`` must match the checkpoint.
        rank: this rank's index in the expert-parallel group, in ``[0, R)``.
        expert_keys: the keys of the expert entries, or a predicate on keys.
        checkpoint_id, storage_reader, process_group: as for
            :func:`torch.distributed.checkpoint.load`.

    Raises:
        ValueError: on a local tensor whose dim 0 is not ``S``, a checkpoint entry that is
            missing or not a tensor, whose dim 0 is not ``placement.num_logical`` or whose other
            dims or dtype differ from the local tensor.
    """
    fn = "load_logical_expert_state_dict"
    rank = _check_placement(fn, placement, rank)
    keys = _expert_key_set(fn, state_dict, expert_keys)
    for k in keys:
        _check_local(fn, k, state_dict[k], placement)
    metadata = _read_metadata(fn, checkpoint_id, storage_reader)
    E = placement.num_logical
    for k in keys:
        md = metadata.state_dict_metadata.get(k)
        t = state_dict[k]
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{fn}: expected the checkpoint to hold a tensor [{E}, ...] for "
                             f"{k!r}, but got {'nothing' if md is None else type(md).__name__}")
        if md.size[0] != E:
            raise ValueError(f"{fn}: expected {k!r} in the checkpoint to have the placement's "
                             f"{E} logical experts, but it has {md.size[0]}")
        if tuple(md.size[1:]) != tuple(t.shape[1:]):
            raise ValueError(f"{fn}: expected {k!r} in the checkpoint to have per-expert shape "
                             f"{tuple(t.shape[1:])} of the local tensor, but got "
                             f"{tuple(md.size[1:])}")
        if md.properties.dtype != t.dtype:
            raise ValueError(f"{fn}: expected {k!r} in the checkpoint to have the local dtype "
                             f"{t.dtype}, but got {md.properties.dtype}")
    _check_entries(fn, _plain_entries(state_dict, skip=set(keys)), metadata)

    runs = expert_runs(placement, rank, primary_only=False)
    to_load = dict(state_dict)
    for k in keys:
        t = state_dict[k].detach()
        size = torch.Size((E,) + tuple(t.shape[1:]))
        to_load[k] = _LogicalExpertChunks(size, [(e, t.narrow(0, s, n)) for s, e, n in runs], t)
    dcp.load(to_load, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
             process_group=process_group)
    for k, v in to_load.items():
        if k not in keys:
            state_dict[k] = v

    # slots holding a second copy of an expert on this rank were not read: copy the first one
    S = placement.slots_per_rank
    experts = placement.phys_to_logical[rank * S:(rank + 1) * S].tolist()
    first = {}
    dst, src = [], []
    for s, e in enumerate(experts):
        if e in first:
            dst.append(s)
            src.append(first[e])
        else:
            first[e] = s
    if dst:
        dst, src = torch.tensor(dst), torch.tensor(src)
        for k in keys:
            t = state_dict[k].detach()
            t.index_copy_(0, dst.to(t.device), t.index_select(0, src.to(t.device)))


# ---------------------------------------------------------------------------------------------
# Contiguous expert parallelism (DTensor Shard(0)) and plain models: model + optimizer helpers
# ---------------------------------------------------------------------------------------------


def _plain_entries(tree, prefix: str = "", skip=frozenset()):
    """(key, tensor) of the tensor leaves of nested dicts, keyed the way DCP flattens them."""
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if key in skip:
            continue
        if isinstance(v, dict):
            yield from _plain_entries(v, f"{key}.", skip)
        elif isinstance(v, Tensor):
            yield key, v


def _check_entries(fn: str, entries, metadata: Metadata) -> None:
    for key, t in entries:
        md = metadata.state_dict_metadata.get(key)
        if md is None:
            raise ValueError(f"{fn}: expected the checkpoint to hold {key!r}, a tensor of shape "
                             f"{tuple(t.shape)}, but it has no such entry")
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{fn}: expected {key!r} in the checkpoint to be a tensor of shape "
                             f"{tuple(t.shape)}, but got {type(md).__name__}")
        if tuple(md.size) != tuple(t.shape):
            raise ValueError(f"{fn}: expected {key!r} in the checkpoint to have the model's "
                             f"shape {tuple(t.shape)}, but got {tuple(md.size)}")


def _optimizers(fn: str, optimizers) -> list:
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    optimizers = list(optimizers)
    for o in optimizers:
        if not isinstance(o, torch.optim.Optimizer):
            raise ValueError(f"{fn}: expected optimizers to be torch.optim.Optimizer, but got "
                             f"{type(o).__name__}")
    return optimizers


def _check_model(fn: str, model) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"{fn}: expected model to be an nn.Module, but got "
                         f"{type(model).__name__}")


def _model_and_optim_state(model, optimizers) -> dict:
    if optimizers:
        model_sd, optim_sd = get_state_dict(model, optimizers)
        return {"model": model_sd, "optim": optim_sd}
    return {"model": get_model_state_dict(model)}


def _check_extra_state(fn: str, extra_state) -> dict:
    if extra_state is None:
        return {}
    if not isinstance(extra_state, dict):
        raise ValueError(f"{fn}: expected extra_state to be a dict, but got "
                         f"{type(extra_state).__name__}")
    bad = [k for k in extra_state if not isinstance(k, str) or k in ("model", "optim")]
    if bad:
        raise ValueError(f"{fn}: expected the keys of extra_state to be strings other than "
                         f"'model' and 'optim' (the model and optimizer state), but got {bad}")
    return extra_state


def save_expert_parallel_checkpoint(model: nn.Module, optimizers=None, *,
                                    checkpoint_id: CheckpointId,
                                    extra_state: Optional[dict] = None,
                                    process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Saves a model whose expert weights are DTensors (``Shard(0)`` over the expert-parallel
    mesh, ``w1 [E, D, F]`` globally) or plain tensors, and the state of its optimizers.

    Collective: every rank of ``process_group`` (default: the world) calls it. The state is
    saved as ``{"model": ..., "optim": ...}`` from
    :func:`~torch.distributed.checkpoint.state_dict.get_state_dict`, so DCP stores every DTensor
    (weights and Adam moments alike) by its global shape and can reshard it on load.

    Args:
        extra_state: more entries saved next to ``"model"`` and ``"optim"``, under their own
            keys: anything DCP saves (tensors and DTensors, nested dicts, picklable values such
            as an LR scheduler's ``state_dict()``). A plain tensor or value under one key is
            taken as the same on every rank and stored once; per-rank state goes into a
            DTensor (e.g. ``Shard(0)`` of a ``[R, ...]`` stack) or under per-rank keys.
    """
    fn = "save_expert_parallel_checkpoint"
    _check_model(fn, model)
    extra_state = _check_extra_state(fn, extra_state)
    state = _model_and_optim_state(model, _optimizers(fn, optimizers))
    state.update(extra_state)
    dcp.save(state, checkpoint_id=checkpoint_id, process_group=process_group)


def load_expert_parallel_checkpoint(model: nn.Module, optimizers=None, *,
                                    checkpoint_id: CheckpointId,
                                    extra_state: Optional[dict] = None,
                                    process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Loads a checkpoint of :func:`save_expert_parallel_checkpoint` into ``model`` and
    ``optimizers``, resharding to their current layout (any number of ranks, DTensor
    ``Shard(0)`` or plain tensors).

    A fresh optimizer has its state created first (by ``get_state_dict``) so that the moments
    can be read in place.

    Args:
        extra_state: the extra entries to read, as saved: tensors (and DTensors) of the saved
            global shapes are read in place, other values are replaced in the dict.

    Raises:
        ValueError: when an entry of the model, optimizer or extra state has a different global
            shape in the checkpoint (e.g. another number of experts) or is missing, naming the
            entry.
    """
    fn = "load_expert_parallel_checkpoint"
    _check_model(fn, model)
    optimizers = _optimizers(fn, optimizers)
    extra_state = _check_extra_state(fn, extra_state)
    metadata = _read_metadata(fn, checkpoint_id, None)
    state = _model_and_optim_state(model, optimizers)
    state.update(extra_state)
    _check_entries(fn, _plain_entries(state), metadata)
    dcp.load(state, checkpoint_id=checkpoint_id, process_group=process_group)
    for k in extra_state:
        extra_state[k] = state[k]
    if optimizers:
        set_state_dict(model, optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])


# ---------------------------------------------------------------------------------------------
# Restarts: atomic commit and the latest complete checkpoint
# ---------------------------------------------------------------------------------------------

_STEP_DIGITS = 8
_STEP_PREFIX = "step_"
_COMMITTED = re.compile(r"step_(\d+)")
_STAGING = re.compile(r"step_\d+\.tmp-[0-9a-f]+")
_METADATA = ".metadata"  # DCP's FileSystemWriter writes it after every rank's files

# what rank 0 found, broadcast to the other ranks as (code, value)
_OK, _NOT_A_DIR, _OS_ERROR, _EXISTS, _NOT_WRITTEN = range(5)


def _step_name(step: int) -> str:
    return f"{_STEP_PREFIX}{step:0{_STEP_DIGITS}d}"


def _check_dir(fn: str, checkpoint_dir) -> str:
    path = os.fspath(checkpoint_dir) if isinstance(checkpoint_dir, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path:
        raise ValueError(f"{fn}: expected checkpoint_dir to be a non-empty path (str or "
                         f"os.PathLike of str), but got {checkpoint_dir!r}")
    return path


def _check_step(fn: str, step) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{fn}: expected step to be a non-negative int, but got {step!r}")
    return step


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _int_tensor(values: list, process_group) -> Tensor:
    # a collective's tensor must be on the backend's device: CUDA for NCCL, CPU otherwise
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(process_group) == "nccl" else torch.device("cpu"))
    return torch.tensor(values, dtype=torch.int64, device=device)


def _rank0_decides(process_group, decide: Callable[[], tuple]) -> tuple:
    """Runs ``decide() -> (code, value, error)`` on rank 0 of ``process_group`` only and returns
    rank 0's ``(code, value)`` on every rank, with rank 0's ``error`` (an ``OSError`` it caught,
    to chain) on rank 0 and ``None`` elsewhere. Local without a process group."""
    if not _distributed():
        return decide()
    error = None
    result = _int_tensor([0, 0], process_group)
    if dist.get_rank(process_group) == 0:
        code, value, error = decide()
        result.copy_(_int_tensor([code, value], process_group))
    dist.broadcast(result, group=process_group, group_src=0)
    code, value = result.tolist()
    return code, value, error


def _all_ranks_ok(process_group, ok: bool) -> bool:
    if not _distributed():
        return ok
    flag = _int_tensor([int(ok)], process_group)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=process_group)
    return bool(flag.item())


def _fsync_dir(path: str) -> None:
    # makes the rename itself durable, not only the files it names
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error(fn: str, what: str) -> str:
    # the same message on every rank; rank 0 chains the OSError it caught
    return f"{fn}: rank 0 could not {what} (rank 0 chains the OSError to its error)"


def latest_checkpoint(checkpoint_dir: CheckpointId, *,
                      process_group: Optional[dist.ProcessGroup] = None
                      ) -> Optional[tuple[int, str]]:
    """The newest complete checkpoint that :func:`atomic_checkpoint` committed in
    ``checkpoint_dir``.

    Collective when ``torch.distributed`` is initialized (every rank of ``process_group``,
    default the world, calls it): rank 0 scans the directory and broadcasts the step it picked,
    so that every rank loads the same checkpoint. A local scan otherwise.

    Only committed names ``step_<step, 8 digits>`` holding a DCP ``.metadata`` count. Temporary
    directories of a save that was interrupted (``step_<step>.tmp-<suffix>``) and entries not
    named ``step_...`` are ignored; other ``step_...`` entries (a committed name without
    ``.metadata``, a name renamed by hand) are skipped with a warning.

    Returns:
        ``(step, path)`` of the checkpoint with the highest step, or ``None`` when there is
        none, also when ``checkpoint_dir`` does not exist (a first run).

    Raises:
        ValueError: ``checkpoint_dir`` is not a path, or exists and is not a directory.
        RuntimeError: rank 0 could not list the directory.
    """
    fn = "latest_checkpoint"
    path = _check_dir(fn, checkpoint_dir)

    def scan() -> tuple:
        try:
            if not os.path.lexists(path):
                return _OK, -1, None
            if not os.path.isdir(path):
                return _NOT_A_DIR, 0, None
            names = sorted(os.listdir(path))
        except OSError as error:
            return _OS_ERROR, 0, error
        latest = -1
        for name in names:
            if not name.startswith(_STEP_PREFIX) or _STAGING.fullmatch(name):
                continue
            m = _COMMITTED.fullmatch(name)
            if m is None or name != _step_name(int(m.group(1))):
                warnings.warn(f"{fn}: {os.path.join(path, name)!r} is not named "
                              f"step_<step, {_STEP_DIGITS} digits>: ignored", stacklevel=4)
            elif not os.path.isfile(os.path.join(path, name, _METADATA)):
                warnings.warn(f"{fn}: {os.path.join(path, name)!r} holds no DCP {_METADATA}: "
                              f"not a complete checkpoint, ignored", stacklevel=4)
            else:
                latest = max(latest, int(m.group(1)))
        return _OK, latest, None

    code, step, error = _rank0_decides(process_group, scan)
    if code == _NOT_A_DIR:
        raise ValueError(f"{fn}: expected checkpoint_dir to be a directory, but {path!r} is "
                         f"not one")
    if code == _OS_ERROR:
        raise RuntimeError(_os_error(fn, f"list {path!r}")) from error
    return None if step < 0 else (step, os.path.join(path, _step_name(step)))


@contextlib.contextmanager
def atomic_checkpoint(checkpoint_dir: CheckpointId, step: int, *,
                      process_group: Optional[dist.ProcessGroup] = None) -> Iterator[str]:
    """Gives the checkpoint of ``step`` a temporary id and commits it as
    ``checkpoint_dir/step_<step, 8 digits>`` once the body has written it on every rank::

        with atomic_checkpoint(checkpoint_dir, step) as checkpoint_id:
            save_expert_parallel_checkpoint(model, optimizer, checkpoint_id=checkpoint_id)

    Collective when ``torch.distributed`` is initialized: every rank of ``process_group``
    (default the world) enters it, and the body writes one DCP checkpoint at ``checkpoint_id``
    with the same group.

    On entry, rank 0 creates ``checkpoint_dir`` if needed, removes the temporary directories of
    interrupted saves (the directory belongs to one job at a time) and draws the suffix of the
    temporary name, which it broadcasts. On exit, the ranks first agree on whether the body
    returned on all of them. Then rank 0 checks that the DCP ``.metadata`` is there, which DCP
    writes after the files of every rank, renames the temporary directory to its committed name
    (atomic on one filesystem), syncs the directory, and broadcasts the outcome: every rank
    leaves once the checkpoint is committed. A rank that dies after the rename leaves a
    complete checkpoint, which :func:`latest_checkpoint` then finds; a rank that dies before
    it leaves a temporary directory, which is never loaded.

    Raises:
        ValueError: ``checkpoint_dir`` is not a path or exists and is not a directory, ``step``
            is not a non-negative int, ``checkpoint_dir`` already holds an entry for ``step``,
            or the body wrote no DCP checkpoint at ``checkpoint_id``; nothing is committed.
        RuntimeError: the body raised on another rank (this rank's body returned), or a
            filesystem operation of rank 0 failed; nothing is committed unless the sync of the
            directory after the rename failed.
    """
    fn = "atomic_checkpoint"
    path = _check_dir(fn, checkpoint_dir)
    step = _check_step(fn, step)
    final = os.path.join(path, _step_name(step))

    def prepare() -> tuple:
        try:
            if os.path.lexists(path) and not os.path.isdir(path):
                return _NOT_A_DIR, 0, None
            os.makedirs(path, exist_ok=True)
            if os.path.lexists(final):
                return _EXISTS, 0, None
            for name in os.listdir(path):
                if _STAGING.fullmatch(name):
                    stale = os.path.join(path, name)
                    shutil.rmtree(stale) if os.path.isdir(stale) else os.remove(stale)
        except OSError as error:
            return _OS_ERROR, 0, error
        # the suffix keeps this attempt's files apart from those of an earlier one; drawn from
        # os.urandom, not from torch's generators, whose state the training loop checkpoints
        return _OK, int.from_bytes(os.urandom(6), "little"), None

    code, suffix, error = _rank0_decides(process_group, prepare)
    if code == _NOT_A_DIR:
        raise ValueError(f"{fn}: expected checkpoint_dir to be a directory, but {path!r} is "
                         f"not one")
    if code == _EXISTS:
        raise ValueError(f"{fn}: expected no checkpoint of step {step} in {path!r}, but "
                         f"{final!r} exists (a committed checkpoint is never written twice; an "
                         f"entry of that name without {_METADATA} was not committed by "
                         "atomic_checkpoint and is not loaded: remove it)")
    if code == _OS_ERROR:
        raise RuntimeError(_os_error(fn, f"prepare {path!r} for step {step}")) from error
    staging = f"{final}.tmp-{suffix:012x}"

    try:
        yield staging
    except BaseException:
        _all_ranks_ok(process_group, False)  # the other ranks must not commit, nor wait
        raise
    if not _all_ranks_ok(process_group, True):
        raise RuntimeError(f"{fn}: the checkpoint of step {step} was not committed: the body "
                           f"raised on another rank")

    def commit() -> tuple:
        if not os.path.isfile(os.path.join(staging, _METADATA)):
            return _NOT_WRITTEN, 0, None
        try:
            if os.path.lexists(final):
                return _EXISTS, 0, None
            os.rename(staging, final)
            _fsync_dir(path)
        except OSError as error:
            return _OS_ERROR, 0, error
        return _OK, 0, None

    code, _, error = _rank0_decides(process_group, commit)
    if code == _NOT_WRITTEN:
        raise ValueError(f"{fn}: expected the body to write a DCP checkpoint at {staging!r}, "
                         f"but it holds no {_METADATA}; nothing is committed")
    if code == _EXISTS:
        raise ValueError(f"{fn}: expected no checkpoint of step {step} in {path!r}, but "
                         f"{final!r} appeared while it was written; nothing is committed")
    if code == _OS_ERROR:
        raise RuntimeError(_os_error(fn, f"commit {staging!r} as {final!r}")) from error
