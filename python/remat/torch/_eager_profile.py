"""Profiling one eager training step, as PyTorch's autograd really runs it.

The model's own forward runs under a ``TorchDispatchMode`` (every aten op, its arguments and
outputs, its time) and ``saved_tensors_hooks`` (every tensor autograd saves for backward).
During the backward that follows, hooks on the autograd nodes push the same mode for each
node's evaluation (its ``apply``, then the gradient sums autograd makes from its outputs),
so the backward's ops and the gradients they make are seen too, in autograd's own order. Nothing is traced, decomposed or re-run: the profiled step is the
user's step, and its results are the user's.

What runs after the model returns and before its first backward node (a loss computed by
the caller, ``F.cross_entropy(model(x), y)``, and that loss's own backward nodes) is seen
too, where it can be without disturbing the caller: when no other dispatch mode is active
as the forward returns, the mode stays pushed (ops there are backward-phase ops "outside
the model", run once, never rebuilt) until the first node of the model's graph runs; from
then on it only passes ops through. Autograd copies the thread's modes into the backward,
and restores them after, so the mode is taken off the caller's stack only on the caller's
thread, outside autograd: at the model's next call, an optimizer's next step, or the next
module call after the backward (:func:`release_outside_modes`).

Bytes are counted per storage (a *value*): views own nothing, aliases count once. Each
value's life is read off the storage itself:

1. ``born``: the op that made the storage.
2. ``python_death``: the first op position at which nothing but autograd's saved-tensor
   handles holds it (the model's code dropped its last reference). Only forward values.
3. ``expiry``: the first op position at which the storage is gone, in the unplanned step
   (our handles hold saved storages exactly as long as autograd holds its saved tensors).

What the caller keeps of the forward's output is part of the step too (note 6).

A position is an index into the step's op list: "at position p" means after op p-1 ran
and before op p runs; ``len(ops)`` is the end of the step.

Notes on invariants the planner and the runtime rely on:

1. A tensor argument of an op is a :class:`TensorRef`: the value (storage) it views, its
   size / stride / offset / dtype, and the number of in-place writes the storage had before
   (its *version* in this step). Rebuilding a reference is ``set_`` on the storage, never a
   replayed view op.
2. A value's contents at version ``k`` are its creation op followed by the first ``k - 1``
   ops that wrote into it in place, each replayed on rebuilt arguments.
3. A static tensor (parameter, buffer, the step's inputs, anything made outside the
   profiled forward) is never a value: it is resident for the whole step.
4. On CUDA an op may allocate more than its outputs while it runs and free it before it
   returns (a cuBLAS or reduction workspace: 128 MiB in one backward op of a bf16 MLP on
   an H200), which no storage shows. The profiled step resets the allocator's peak counter
   before each op and reads it after (``OpRecord.workspace``), so the plan's predicted
   peak counts it wherever the op runs, replays included; a caller's
   ``torch.cuda.max_memory_allocated`` over the profiled step therefore reads only its
   last op's peak: read peaks from the steps after it.
5. An op's time on CUDA is the longer of its device time, between two events recorded
   around it and read once the step's backward is done, and its host time around the call
   (its launch; all of an op on CPU tensors), with no synchronization per op: a device
   synchronization around each op adds its launch and wait latency to every op's time
   (the profiled step of a 16-layer Llama ran 34-54x a plain one that way). Where the
   events cannot be read, the host's time stays. On a CPU the host's clock is the op's
   time: the least of :data:`REPEATS` calls of a pure op (one that writes nothing, draws
   no random numbers and takes plain tensors; the extra calls' outputs are dropped at once,
   and no mode below this one is skipped). Other work on the machine only ever adds to a
   call's time, and an op's first call pays for its lazy set-up, so the least is the
   estimate that moves least from one profile to the next.
6. Outputs the caller keeps. A storage still held by something other than autograd's saved
   tensors when the model's backward begins (``Value.held_outside``: the caller's ``out``,
   a loss computed outside the model that saved it) cannot be freed by any plan: its python
   death is its expiry. The caller may keep more in a later step than it did in this one
   (``out = model(x); out.loss.backward()`` keeps the logits and a returned key/value cache
   alive through the backward, ``model(x).loss.backward()`` keeps nothing), and a plan is
   made once per input signature: so every storage the forward returned, whether reached
   as a tensor or inside an object (transformers' ``DynamicCache``), is charged as held by
   the caller from its op to the end of the step (``Value.returned``), the worst a caller
   can do. A step whose caller drops its output then peaks below its prediction, never above.
7. Objects the model's modules change (``Profile.module_writes``): for each module call,
   the tensors reachable from its non-tensor arguments are compared before and after the
   call. A module that changed one (GPT-2's attention appends to the ``DynamicCache`` it is
   given) would change it again when ``torch.utils.checkpoint`` re-runs its forward in the
   backward (the caller's cache would hold every key twice), so it is never run that way.
"""

from __future__ import annotations

import dataclasses
import time
import types
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

OUTSIDE = "outside the model"  # where an op after the forward, before the model's backward ran

# Batch-norm kernels update running statistics in place without saying so in their schema;
# a replay must not apply the update a second time. Value: argument positions.
STATS_IN_PLACE = {
    "aten::native_batch_norm": (3, 4),
    "aten::_native_batch_norm_legit": (3, 4),
    "aten::_native_batch_norm_legit_functional": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
    "aten::_batch_norm_with_update": (3, 4),
}

# Calls timed per op on a CPU, where one call's time follows whatever else the machine ran
# (note 5): the op's own call and this many minus one more, the least kept.
REPEATS = 5

# Ops whose outputs cannot be rebuilt by replaying them: they change storages behind the
# dispatcher's back, read host state, or talk to other processes.
_NOT_REPLAYABLE = {
    "aten::set_",
    "aten::resize_",
    "aten::_local_scalar_dense",
    "aten::record_stream",
    "aten::_assert_async",
    "aten::_assert_tensor_metadata",
}


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A tensor, as a view of a value's storage (or of a static tensor)."""

    value: int  # value id, or -1 for a static tensor
    static: int  # index into Profile.statics when value == -1, else -1
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    version: int  # in-place writes into the value before this reference (1 = as made)


@dataclasses.dataclass
class OpRecord:
    index: int
    func: Any  # torch._ops.OpOverload
    spec: pytree.TreeSpec  # of (args, kwargs)
    leaves: list  # TensorRef for tensors, the constant otherwise
    outputs: list  # TensorRef per output tensor leaf (None for non-tensors)
    new_values: list[int]  # values this op made
    phase: str  # "forward" or "backward"
    where: str  # the module (forward) or autograd node (backward) it ran in
    seconds: float
    random: bool
    written: list[int]  # leaf positions the op writes in place
    static_writes: tuple[int, ...]  # leaf positions of statics it writes (replay on copies)
    stats: tuple[int, ...]  # of those, batch-norm running statistics (not read for output)
    replayable: bool
    # Bytes the op held beyond its outputs while it ran (kernel workspaces, a reduction's
    # scratch), as the CUDA allocator's peak showed them (note 4); 0 on a CPU.
    workspace: int = 0

    @property
    def name(self) -> str:
        return self.func._schema.name


@dataclasses.dataclass
class Value:
    id: int
    op: int  # creation op
    nbytes: int
    device: torch.device
    writers: list[int] = dataclasses.field(default_factory=list)  # in-place writes, in order
    python_death: int | None = None
    expiry: int | None = None
    # Held by something other than autograd's saved tensors when the model's backward
    # began, or returned (note 6): no plan frees it before its expiry.
    held_outside: bool = False
    returned: bool = False  # reachable from what the forward returned (note 6)
    saved: bool = False
    first_unpack: int | None = None
    recomputable: bool = True
    why_not: str = ""  # why it cannot be recomputed
    # Statics and values whose storage was gone (resized below what it held when first
    # seen) at this value's first unpack, where a rebuild of it runs: FSDP2 frees a module's
    # unsharded parameters after its forward and gathers them again only when its backward
    # begins. A rebuild must not read them there.
    absent_statics: frozenset = frozenset()
    absent_values: frozenset = frozenset()


@dataclasses.dataclass
class PackRecord:
    """One tensor autograd saved, in pack order."""

    ordinal: int
    ref: TensorRef
    at: int  # op position when it was packed
    where: str
    unpacks: list[int] = dataclasses.field(default_factory=list)


class Profile:
    """Everything one profiled step showed. Filled by :class:`Profiler`."""

    def __init__(self):
        self.ops: list[OpRecord] = []
        self.values: list[Value] = []
        self.packs: list[PackRecord] = []
        self.statics: list[str] = []  # a name per static tensor (parameter name or "input")
        self.static_nbytes: list[int] = []  # its storage's bytes when first seen
        self.static_bytes = 0
        self.forward_ops = 0  # ops [0, forward_ops) ran in the forward
        # Forward calls per module (qualified name); containers never called are absent.
        self.module_calls: dict[str, int] = {}
        # The values among a module's arguments (positional and keyword) at its first call:
        # what torch.utils.checkpoint around it would hold until its backward is done.
        self.module_inputs: dict[str, tuple[int, ...]] = {}
        # Modules whose forward changed an object it was given (note 7): name -> what.
        self.module_writes: dict[str, str] = {}
        self.complete = False  # the backward finished
        self.device = torch.device("cpu")
        self.signature: tuple = ()

    def value_of(self, ref: TensorRef) -> Value | None:
        return self.values[ref.value] if ref.value >= 0 else None


def _written_positions(func, args, kwargs, leaves_of) -> list[int]:
    """Leaf positions (into the flattened (args, kwargs)) of the tensors ``func`` writes."""
    schema = func._schema
    positions: list[int] = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        if i < len(args):
            positions.extend(leaves_of(("args", i)))
        elif arg.name in kwargs:
            positions.extend(leaves_of(("kwargs", arg.name)))
    return positions


def _leaf_index(args, kwargs):
    """Maps ("args", i) / ("kwargs", name) to the leaf positions of that argument."""
    table: dict[tuple, list[int]] = {}
    start = 0
    for i, a in enumerate(args):
        n = len(pytree.tree_leaves(a))
        table[("args", i)] = list(range(start, start + n))
        start += n
    for k, v in kwargs.items():
        n = len(pytree.tree_leaves(v))
        table[("kwargs", k)] = list(range(start, start + n))
        start += n
    return lambda key: table.get(key, [])


class _Live:
    """A value's storage while the step runs: a weak reference, and our own holders."""

    __slots__ = ("weak", "ours")

    def __init__(self, weak: int):
        self.weak = weak
        self.ours = 0  # tensors our handles hold (1 for a saved value)


class _Handle:
    """What the profiled step's saved-tensor hook returns: the saved tensor, through one
    alias per value (a distinct TensorImpl, so storage use counts tell the model's own
    references apart from ours)."""

    __slots__ = ("record", "tensor")

    def __init__(self, record: PackRecord, tensor: torch.Tensor):
        self.record = record
        self.tensor = tensor


class Profiler(TorchDispatchMode):
    """Records one step into a :class:`Profile`. Used by ``auto_checkpoint``'s first
    training step: ``begin_forward`` / ``end_forward`` around the model's forward, then the
    backward hooks installed by ``end_forward``."""

    def __init__(self, model: torch.nn.Module, device: torch.device, sync):
        super().__init__()
        self.profile = Profile()
        self.profile.device = device
        self.sync = sync  # waits for the device (read the CUDA events, note 5)
        self.cuda = device.type == "cuda"
        self.device_timed: list = []  # (op index, begin event, end event) on CUDA
        self.live: dict[int, _Live] = {}  # storage cdata -> live record (value or static)
        self.value_by_cdata: dict[int, int] = {}
        self.static_by_cdata: dict[int, int] = {}
        self.names = {}
        for name, p in model.named_parameters():
            self.names.setdefault(_cdata(p), name)
        for name, b in model.named_buffers():
            self.names.setdefault(_cdata(b), name)
        self.module_names = {id(m): n or type(model).__name__ for n, m in model.named_modules()}
        self.model = model
        self.module_stack: list[str] = [type(model).__name__]
        self.phase = "forward"
        self.node_name = ""
        self.node_hooks: list = []
        self.internal = False
        self.static_seen: dict[int, int] = {}
        self._module_hooks = []
        self.on_complete = None
        self.outside = False  # the mode stays pushed past the forward (module notes)
        self.backward_started = False
        self.backward_from = 1 << 62  # the op position where the model's backward began
        self.dispatching = False  # inside our own op: a second push of this mode passes
        # Per module (id) in call: what its non-tensor arguments held as it began (note 7).
        self.object_states: dict[int, list] = {}

    @property
    def after_forward(self) -> bool:
        """Outside the model, before its first backward node: the outside mode's stretch."""
        return self.outside and not self.backward_started

    # ---- module tracking (for messages) -------------------------------------------------
    def _push_module(self, module, *_):
        name = self.module_names.get(id(module), type(module).__name__)
        self.module_stack.append(name)
        if self.phase == "forward":
            calls = self.profile.module_calls
            calls[name] = calls.get(name, 0) + 1

    def _note_inputs(self, module, args, kwargs):
        name = self.module_names.get(id(module))
        if name is None or self.phase != "forward":
            return None
        self.object_states.setdefault(id(module), []).append(self._object_state(args, kwargs))
        if name in self.profile.module_inputs:
            return None
        found = []
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                key = _cdata(t)
                vid = self.value_by_cdata.get(key, -1) if key is not None else -1
                if vid >= 0:
                    found.append(vid)
        self.profile.module_inputs[name] = tuple(found)
        return None

    def _note_writes(self, module, args, kwargs, _output):
        """Whether the call changed an object it was given (note 7)."""
        states = self.object_states.get(id(module))
        name = self.module_names.get(id(module))
        if not states or name is None or self.phase != "forward":
            return None
        before = states.pop()
        if name not in self.profile.module_writes:
            after = dict(self._object_state(args, kwargs))
            changed = [what for what, state in before if after.get(what) != state]
            if changed:
                self.profile.module_writes[name] = changed[0]
        return None

    def _object_state(self, args, kwargs) -> list[tuple[str, tuple]]:
        """Per non-tensor argument of a module call, the tensors reachable from it (storage,
        shape, version): what a call that appends to or writes into it changes."""
        self.internal = True
        try:
            named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
            state = []
            for what, arg in named:
                if isinstance(arg, torch.Tensor) or isinstance(arg, _ATOMS):
                    continue
                state.append((f"{what} ({type(arg).__name__})", tuple(
                    (_cdata(t), tuple(t.shape), t._version) for t in tensors_in(arg))))
            return state
        finally:
            self.internal = False

    def _pop_module(self, *_):
        if len(self.module_stack) > 1:
            self.module_stack.pop()

    def begin_forward(self):
        from torch.nn.modules import module as nn_module

        self._module_hooks = [
            nn_module.register_module_forward_pre_hook(self._push_module),
            nn_module.register_module_forward_hook(self._pop_module),
        ]
        for module in self.model.modules():
            self._module_hooks.append(module.register_forward_pre_hook(
                self._note_inputs, with_kwargs=True))
            self._module_hooks.append(module.register_forward_hook(
                self._note_writes, with_kwargs=True))
        self.__enter__()

    def end_forward(self, outputs) -> None:
        self.__exit__(None, None, None)
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        self.profile.forward_ops = len(self.profile.ops)
        self.object_states = {}
        self._poll()
        self._note_returned(outputs)
        self._hook_backward(outputs)
        if torch.is_grad_enabled() and not _get_current_dispatch_mode_stack():
            # What the caller does before the backward reaches the model (its loss) is part
            # of the step's memory: watched until then (module notes).
            self.phase = "backward"
            self.node_name = OUTSIDE
            self.outside = True
            self.__enter__()
            _hold_outside(self)

    def _note_returned(self, outputs) -> None:
        """Marks the values the forward returned, as tensors or inside objects (note 6)."""
        for t in tensors_in(outputs):
            key = _cdata(t)
            vid = self.value_by_cdata.get(key, -1) if key is not None else -1
            if vid >= 0:
                self.profile.values[vid].returned = True

    def _note_held(self) -> None:
        """At the model's first backward node: the forward's values something other than
        autograd's saved tensors still holds (note 6)."""
        self._poll()
        values = self.profile.values
        for key in self.live:
            vid = self.value_by_cdata.get(key)
            if vid is not None and values[vid].op < self.profile.forward_ops and \
                    values[vid].python_death is None:
                values[vid].held_outside = True

    # ---- the dispatch mode ------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.internal or self.profile.complete or self.dispatching:
            return func(*args, **kwargs)  # our own bookkeeping, or a mode left on a thread
        self._poll()
        leaves, spec = pytree.tree_flatten((args, kwargs))
        refs = [self._ref(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        written = _written_positions(func, args, kwargs, _leaf_index(args, kwargs))
        name = func._schema.name
        stats = [p for p in STATS_IN_PLACE.get(name, ()) if p < len(args)]
        stats_leaves = set()
        for p in stats:
            stats_leaves.update(_leaf_index(args, kwargs)(("args", p)))
        static_writes = set(stats_leaves)
        index = len(self.profile.ops)
        begin = self._begin_timing()
        start = time.perf_counter()
        self.dispatching = True
        try:
            out = func(*args, **kwargs)
        finally:
            self.dispatching = False
        seconds = time.perf_counter() - start
        self._end_timing(index, begin)
        workspace = self._workspace()
        if not self.cuda and _pure(func, written, static_writes, leaves):
            seconds = self._median_of_repeats(func, args, kwargs, seconds)
        for p in written:
            ref = refs[p]
            if not isinstance(ref, TensorRef):
                continue
            if ref.value >= 0:
                writers = self.profile.values[ref.value].writers
                if not writers or writers[-1] != index:
                    writers.append(index)
            else:
                static_writes.add(p)
        outputs, new_values = [], []
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                outputs.append(None)
                continue
            key = _cdata(t)
            if key is not None and key not in self.live:
                new_values.append(self._new_value(t, key, index))
            outputs.append(self._ref(t))
        replayable = func.namespace == "aten" and name not in _NOT_REPLAYABLE
        record = OpRecord(
            index=index,
            func=func,
            spec=spec,
            leaves=refs,
            outputs=outputs,
            new_values=new_values,
            phase=self.phase,
            where=self.module_stack[-1] if self.phase == "forward" else self.node_name,
            seconds=seconds,
            random=torch.Tag.nondeterministic_seeded in func.tags,
            written=written,
            static_writes=tuple(sorted(static_writes)),
            stats=tuple(sorted(stats_leaves)),
            replayable=replayable,
            workspace=workspace,
        )
        self.profile.ops.append(record)
        return out

    def _median_of_repeats(self, func, args, kwargs, first: float) -> float:
        """On a CPU (note 5): the least of the op's call and :data:`REPEATS` - 1 more on
        the same arguments, their outputs dropped at once."""
        times = [first]
        self.dispatching = True
        try:
            for _ in range(REPEATS - 1):
                start = time.perf_counter()
                func(*args, **kwargs)
                times.append(time.perf_counter() - start)
        finally:
            self.dispatching = False
        return min(times)

    def _begin_timing(self):
        """On CUDA (note 5): the allocator's peak counter reset and an event recorded on
        the op's stream, no synchronization; on a CPU, nothing (the host's clock is the
        op's time)."""
        if not self.cuda:
            return None
        torch.cuda.reset_peak_memory_stats(self.profile.device)
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        return begin

    def _end_timing(self, index: int, begin) -> None:
        if begin is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.device_timed.append((index, begin, end))

    def _device_times(self) -> None:
        """The CUDA ops' device times, read once the step is done (note 5); where the
        events cannot be read, the host's times stay."""
        timed, self.device_timed = self.device_timed, []
        if not timed:
            return
        ops = self.profile.ops
        try:
            self.sync()
            seconds = [(i, begin.elapsed_time(end) / 1e3) for i, begin, end in timed]
        except (RuntimeError, ValueError):
            return
        for i, s in seconds:
            # An op costs at least its launch on the host (an op on CPU tensors in a CUDA
            # step runs no kernel at all), and at least its kernels on the device.
            ops[i].seconds = max(ops[i].seconds, s)

    def _workspace(self) -> int:
        """The bytes the op just run held above what it left allocated (note 4)."""
        if not self.cuda:
            return 0
        device = self.profile.device
        return max(0, torch.cuda.max_memory_allocated(device)
                   - torch.cuda.memory_allocated(device))

    # ---- storages -----------------------------------------------------------------------
    def _new_value(self, t: torch.Tensor, key: int, index: int) -> int:
        storage = t.untyped_storage()
        vid = len(self.profile.values)
        self.profile.values.append(
            Value(id=vid, op=index, nbytes=storage.nbytes(), device=t.device)
        )
        self.live[key] = _Live(storage._weak_ref())
        self.value_by_cdata[key] = vid
        return vid

    def _ref(self, t: torch.Tensor) -> TensorRef:
        key = _cdata(t)
        vid = self.value_by_cdata.get(key, -1) if key is not None else -1
        if vid >= 0:
            value = self.profile.values[vid]
            version = 1 + len(value.writers)
            return TensorRef(vid, -1, tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                             t.dtype, version)
        sid = self.static_by_cdata.get(key) if key is not None else None
        if sid is None and key is not None and self.phase == "backward" and not self.after_forward:
            # A gradient autograd made between nodes: a value from here on.
            vid = self._new_value(t, key, len(self.profile.ops))
            return TensorRef(vid, -1, tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                             t.dtype, 1)
        if sid is None:
            sid = len(self.profile.statics)
            self.profile.statics.append(self.names.get(key, "input"))
            self.profile.static_nbytes.append(0)
            if key is not None:
                self.static_by_cdata[key] = sid
                storage = t.untyped_storage()
                self.profile.static_bytes += storage.nbytes()
                self.profile.static_nbytes[sid] = storage.nbytes()
                # A static's storage stays alive in our table for the step (it is resident).
                self.live[key] = _Live(storage._weak_ref())
        return TensorRef(-1, sid, tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                         t.dtype, 0)

    def _poll(self) -> None:
        """Marks python deaths and expiries at the current position."""
        position = len(self.profile.ops)
        forward = self.phase == "forward" or self.after_forward
        gone = []
        for key, live in self.live.items():
            vid = self.value_by_cdata.get(key)
            if vid is None:
                if torch._C._storage_Use_Count(live.weak) == 0:
                    gone.append(key)  # a static that died: its address may come back
                continue
            value = self.profile.values[vid]
            uses = torch._C._storage_Use_Count(live.weak)
            if uses == 0:
                gone.append(key)
                value.expiry = position
                if value.python_death is None:
                    value.python_death = position
                continue
            # One use is the storage's own Python object (kept while the storage lives),
            # ``live.ours`` are our handles' aliases: anything above is the model's.
            if forward and value.python_death is None and uses <= 1 + live.ours:
                value.python_death = position
        for key in gone:
            live = self.live.pop(key)
            torch.UntypedStorage._free_weak_ref(live.weak)
            self.value_by_cdata.pop(key, None)
            self.static_by_cdata.pop(key, None)

    # ---- saved tensors ------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        ref = self._ref(t)
        record = PackRecord(len(self.profile.packs), ref, len(self.profile.ops),
                            self.module_stack[-1])
        self.profile.packs.append(record)
        tensor = t
        if ref.value >= 0:
            self.profile.values[ref.value].saved = True
            # Our own TensorImpl over the storage, counted, so that use counts tell the
            # model's references apart from ours.
            self.internal = True
            try:
                tensor = view_of(t.untyped_storage(), ref)
            finally:
                self.internal = False
            self.live[_cdata(t)].ours += 1
        return _Handle(record, tensor)

    def unpack(self, handle: _Handle) -> torch.Tensor:
        record = handle.record
        position = len(self.profile.ops)
        record.unpacks.append(position)
        if record.ref.value >= 0:
            value = self.profile.values[record.ref.value]
            if value.first_unpack is None:
                value.absent_statics, value.absent_values = self._absent_storages()
            if value.first_unpack is None or position < value.first_unpack:
                value.first_unpack = position
            # Autograd skips its version check when hooks are set: ours, from the writes
            # this mode saw before the backward began (FSDP2 gathers a parameter into its
            # storage again in the backward, through another tensor than the one saved,
            # whose version autograd would not see changed).
            now = 1 + sum(1 for w in value.writers if w < self.backward_from)
            if now != record.ref.version:
                raise RuntimeError(version_message(record, record.ref.version, now))
        return handle.tensor

    def _absent_storages(self) -> tuple[frozenset, frozenset]:
        """Statics and values alive whose storage now holds fewer bytes than when first seen
        (freed by ``resize_``, which no dispatch mode sees). One that died is no concern:
        the runtime holds what a rebuild reads."""
        statics, values = [], []
        for key, live in self.live.items():
            vid = self.value_by_cdata.get(key)
            sid = self.static_by_cdata.get(key) if vid is None else None
            if vid is None and sid is None:
                continue
            storage = torch.UntypedStorage._new_with_weak_ptr(live.weak)
            if storage is None:
                continue
            if vid is not None and storage.nbytes() < self.profile.values[vid].nbytes:
                values.append(vid)
            elif sid is not None and storage.nbytes() < self.profile.static_nbytes[sid]:
                statics.append(sid)
        return frozenset(statics), frozenset(values)

    # ---- the backward -------------------------------------------------------------------
    def _hook_backward(self, outputs) -> None:
        """Pushes this mode around every autograd node of the forward's graph, and finishes
        the profile when the backward ends."""
        roots = [t.grad_fn for t in pytree.tree_leaves(outputs)
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen, stack = set(), list(roots)
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            self.node_hooks.append(
                node.register_prehook(lambda grads, n=node: self._node_start(n)))
            stack.extend(n for n, _ in node.next_functions)

    def _node_start(self, node):
        if self.profile.complete:
            return  # a node that outlived the profiled step (DDP keeps grad accumulators)
        if not self.backward_started:
            self._note_held()
            self.backward_started = True
            self.backward_from = len(self.profile.ops)
            self.phase = "backward"
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self.node_name = node.name()
        # Autograd sets the thread's modes as they were when the backward began around each
        # node it evaluates, and restores them after: pushed here (without the flags
        # ``__enter__`` keeps, which nothing would restore), the mode sees the node's ops and
        # then the gradient sums autograd makes from the node's outputs, and goes with the
        # node's evaluation. (Not again where it is on top already: the outside mode, which
        # autograd's copy of the caller's modes carries.)
        stack = _get_current_dispatch_mode_stack()
        if not stack or stack[-1] is not self:
            torch._C._push_on_torch_dispatch_stack(self)

    def _finish(self):
        self._poll()
        self._device_times()
        end = len(self.profile.ops)
        for value in self.profile.values:
            if value.expiry is None:
                value.expiry = end
            if value.returned:
                # The worst a caller can do (note 6): hold it through the step.
                value.held_outside = True
                value.expiry = end
            if value.held_outside:
                value.python_death = value.expiry
            elif value.python_death is None:
                value.python_death = min(value.expiry, self.profile.forward_ops)
        for live in self.live.values():
            torch.UntypedStorage._free_weak_ref(live.weak)
        self.live.clear()
        self.value_by_cdata.clear()
        self.profile.complete = True
        for h in self.node_hooks:
            h.remove()
        self.node_hooks = []
        if self.on_complete is not None:
            self.on_complete(self.profile)
        # A mode left on the caller's stack until it is released holds nothing of the model.
        self.model = None
        self.names = {}
        self.module_names = {}


# ---- the outside mode's release ------------------------------------------------------------

_HELD: list[Profiler] = []  # profilers whose outside mode may still be on a thread's stack
_RELEASE_HOOKS: list = []


def _hold_outside(profiler: Profiler) -> None:
    _HELD.append(profiler)
    if not _RELEASE_HOOKS:
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer

        _RELEASE_HOOKS.append(optimizer.register_optimizer_step_pre_hook(
            lambda *_: release_outside_modes()))
        _RELEASE_HOOKS.append(nn_module.register_module_forward_pre_hook(
            lambda *_: release_outside_modes()))


def release_outside_modes(force: bool = False) -> None:
    """Takes the outside modes of finished profiles (all of them with ``force``: the model
    is called again) off this thread's dispatch stack. Called on the caller's thread only,
    outside autograd, which would restore what it saw when its backward began."""
    if not _HELD or torch._C._current_graph_task_id() != -1:
        return
    for profiler in list(_HELD):
        if not (force or profiler.profile.complete):
            continue
        if profiler.outside:
            if not _remove_from_stack(profiler):
                continue  # another thread's stack: released when that thread gets here
            profiler.outside = False
        _HELD.remove(profiler)
    if not _HELD:
        for h in _RELEASE_HOOKS:
            h.remove()
        _RELEASE_HOOKS.clear()


_MODE_FLAGS = ("old_dispatch_mode_flags", "old_non_infra_dispatch_mode_flags",
               "old_without_ignore_compile_internals_dispatch_mode_flags")


def _remove_from_stack(mode: TorchDispatchMode) -> bool:
    """Pops ``mode`` off this thread's dispatch stack, under the modes the caller pushed since
    (which stay, in their order). Whether it was there."""
    stack = _get_current_dispatch_mode_stack()
    at = next((i for i in range(len(stack) - 1, -1, -1) if stack[i] is mode), None)
    if at is None:
        return False
    if at == len(stack) - 1:
        mode.__exit__(None, None, None)
        return True
    above = stack[at + 1]
    # The mode just above entered while ours was on: on its exit it restores the "a mode is
    # active" flags to what they were before ours entered, which ours saved.
    for name in _MODE_FLAGS:
        mine, theirs = getattr(mode, name, None), getattr(above, name, None)
        if mine:
            saved = mine.pop()
            if theirs and sum(m is above for m in stack) == 1:
                theirs[-1] = saved
    popped = [torch._C._pop_torch_dispatch_stack(None) for _ in range(len(stack) - at)]
    for other in reversed(popped[:-1]):
        torch._C._push_on_torch_dispatch_stack(other)
    return True


_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device,
          torch.Size, torch.nn.Module, type, types.FunctionType, types.MethodType,
          types.BuiltinFunctionType, types.ModuleType)


def tensors_in(obj, limit: int = 10_000) -> list[torch.Tensor]:
    """The tensors reachable from ``obj`` through containers and objects' attributes (a
    model output, a key/value cache and its layers), modules and functions aside; at most
    ``limit`` objects are looked into."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [obj]
    while stack and len(seen) < limit:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
            continue
        if isinstance(x, _ATOMS) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend(x)
        else:
            attrs = getattr(x, "__dict__", None)
            if isinstance(attrs, dict):
                stack.extend(attrs.values())
            for slot in getattr(type(x), "__slots__", ()):
                if isinstance(slot, str) and slot != "__weakref__":
                    stack.append(getattr(x, slot, None))
    return found


def _pure(func, written, static_writes, leaves) -> bool:
    """Whether calling ``func`` again on the same arguments changes nothing the step sees:
    an aten op that writes nothing, draws no random numbers and is replayable, on plain
    tensors (a tensor subclass, DTensor, may talk to other ranks inside the op)."""
    return (func.namespace == "aten" and not written and not static_writes
            and func._schema.name not in _NOT_REPLAYABLE
            and torch.Tag.nondeterministic_seeded not in func.tags
            and not func._schema.is_mutable
            and all(type(x) in (torch.Tensor, torch.nn.Parameter) for x in leaves
                    if isinstance(x, torch.Tensor)))


def _cdata(t: torch.Tensor) -> int | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, meta without storage
        return None
    if storage.nbytes() == 0 and storage.device.type == "meta":
        return None
    return storage._cdata


def view_of(storage: torch.UntypedStorage, ref: TensorRef) -> torch.Tensor:
    """The tensor ``ref`` describes, as a view of ``storage`` (no copy, no autograd: the new
    tensor requires no gradient, so ``set_`` records nothing, and a ``no_grad`` block around
    it would only double its cost on this hot path)."""
    t = torch.empty(0, dtype=ref.dtype, device=storage.device)
    t.set_(storage, ref.offset, ref.size, ref.stride)
    return t


def version_message(record: PackRecord, saved: int, now: int) -> str:
    return (
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: a tensor of shape {list(record.ref.size)} saved in "
        f"`{record.where}` is at version {now}; expected version {saved} instead"
    )
