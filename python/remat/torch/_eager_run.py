"""Running an eager plan: the model's own forward, with saved-tensor hooks that keep,
offload or drop each saved tensor as the plan says, and a rebuild in the backward that
replays the recorded aten ops (eager's own kernels, on the same arguments).

Notes on what keeps the result bit-identical to plain eager:

1. Every op of the forward is checked against the profiled one (the op and its output
   shapes); the ops a rebuild will replay are also checked for the exact tensors they read,
   and replay with the constants they ran with (a scale set between steps).
   A step that diverges keeps everything it saves from there on, and a saved tensor whose
   rebuild would need an op past the divergence is refused at unpack with an error naming
   the module and op: never a wrong gradient.
2. A random op that a rebuild replays has its generator state recorded before it runs and
   restored around the replay (``fork_rng``), so the replay draws the same numbers and the
   generator ends where eager leaves it.
3. Replays run under ``no_grad`` with autocast disabled: the recorded ops are already the
   ones autocast chose (its casts are ops of their own), so replaying them as they are gives
   the same dtypes.
4. A rebuilt tensor is a view of a fresh storage with the recorded size, stride and offset;
   the ops that made it wrote that storage in the same order as the forward did.
5. Offload (CUDA): the copy to pinned host memory runs on a side stream after an event on
   the compute stream; the device block is marked used by that stream (``record_stream``),
   so the allocator cannot hand it out before the copy ends. The copy back runs on another
   side stream and the unpack makes the compute stream wait on its event; nothing
   synchronizes the device. On CPU, offload goes to the caller's file store (``_store``):
   a worker thread writes the storage to a file and reads it back before its reader. The
   step waits for the write before the op at which the value's python reference dies (its
   plan frees it there, and the planner's ``Free`` waits for its copy out), so that a slow
   store stalls the step rather than hold more storages than the predicted peak.
6. Lifetimes: a dropped or offloaded tensor is held by nothing of ours; a rebuilt one is
   held by the handles autograd keeps, so it goes when its last backward node has run.
   Anchors (tensors rebuilds start from) are held by the rebuilds that need them.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ._eager_plan import KEEP, OFFLOAD, RECOMPUTE, EagerPlan
from ._eager_profile import Profile, TensorRef, _cdata, version_message, view_of
from ._store import FileStore
from .errors import StepDivergedError

CAPTURE, REGISTER, CREATE, ANCHOR, SEND, WAIT = 1, 2, 4, 8, 16, 32


class RuntimePlan:
    """Per-op flags and lookups derived once from a plan."""

    def __init__(self, profile: Profile, plan: EagerPlan, device: torch.device,
                 store: Optional[FileStore] = None):
        self.profile = profile
        self.plan = plan
        self.device = device
        n = profile.forward_ops
        self.flags = [0] * n
        self.send_after: dict[int, list[int]] = {}  # op -> offloaded values to copy after it
        # Op -> offloaded values whose store write must be done before it runs (note 5); the
        # writes of values dying when the forward ends or later are waited for there.
        self.wait_before: dict[int, list[int]] = {}
        read_by_recipes: set[int] = set()
        for vid, kind in plan.decisions.items():
            value = profile.values[vid]
            if kind in (RECOMPUTE, OFFLOAD):
                self.flags[value.op] |= CREATE | REGISTER
            if kind == OFFLOAD:
                # The copy starts once the forward's last in-place write into the storage
                # has run (a dropout mask is made empty, then filled): its bytes as saved.
                last = max([value.op, *(w for w in value.writers if w < n)])
                self.flags[last] |= SEND
                self.send_after.setdefault(last, []).append(vid)
                death = value.python_death if value.python_death is not None else n
                at = max(death, last + 1)
                if at < n:
                    self.flags[at] |= WAIT
                    self.wait_before.setdefault(at, []).append(vid)
            if kind == RECOMPUTE:
                r = plan.recipes[vid]
                for i in r.ops:
                    self.flags[i] |= CAPTURE
                    for ref in profile.ops[i].leaves:
                        if isinstance(ref, TensorRef) and ref.value >= 0:
                            read_by_recipes.add(ref.value)
        for vid in read_by_recipes:
            self.flags[profile.values[vid].op] |= REGISTER
        # The last forward op each group's rebuild replays (divergence check).
        self.group_max = {g: max(r.ops) for g, r in plan.group_recipes.items()}
        self.drops = _drop_tables(profile, plan)  # group -> op -> values dropped before it
        for vid in plan.anchors:
            self.flags[profile.values[vid].op] |= ANCHOR | REGISTER
        # Offloaded values are prefetched at the unpack that comes at or before their
        # planned position (the backward is seen only through unpacks).
        self.prefetch_after: dict[int, list[int]] = {}
        log = sorted((p, k) for k, pack in enumerate(profile.packs) for p in pack.unpacks)
        for vid, position in plan.prefetch_at.items():
            trigger = 0
            for c, (p, _) in enumerate(log):
                if p <= position:
                    trigger = c
            self.prefetch_after.setdefault(trigger, []).append(vid)
        self.refused = False  # a rebuild refused (a static or anchor freed): profile again
        self.streams = None
        self.store = None  # a CPU plan's file store (``_store``), where it offloads
        if any(k == OFFLOAD for k in plan.decisions.values()):
            if device.type == "cuda":
                self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            else:
                self.store = store


class StepState:
    """One planned forward and the backward that follows it."""

    def __init__(self, rt: RuntimePlan):
        self.rt = rt
        self.op = 0
        self.packs = 0
        self.unpacks = 0
        # Op -> what a replay passes where the profile has a static tensor (this step's
        # tensor there) or a constant this step changed.
        self.static_args: dict[int, dict[int, Any]] = {}
        self.rng: dict[int, tuple] = {}
        # Anchor -> its storage, or its ``_Value`` where offloaded (the plan's note 7).
        self.anchors: dict[int, Any] = {}
        self.values: dict[int, "_Value"] = {}
        self.cdata: dict[int, int] = {}  # value -> storage cdata, while the forward runs
        self.weak: list[int] = []
        self.offloaded: dict[int, weakref.ref] = {}
        self.sending: dict[int, torch.UntypedStorage] = {}  # offloaded, copy not started
        self.writing: dict[int, Any] = {}  # offloaded to a store, write maybe not done yet
        self.diverged_at: Optional[int] = None
        self.divergence = ""
        self.internal = False
        self.materialized: dict[int, weakref.ref] = {}
        # Values to be rebuilt, alive while autograd holds their handles: their group's
        # rebuild hands each its storage (the plan's note 4).
        self.members: dict[int, weakref.ref] = {}
        self.pending = sorted((c, v) for c, vids in rt.prefetch_after.items() for v in vids)
        self.next_prefetch = 0

    def diverge(self, at: int, what: str) -> None:
        if self.diverged_at is None:
            self.diverged_at = at
            self.divergence = what

    def send(self, vid: int) -> None:
        """Starts the offload copy of ``vid``, whose storage is final (its last profiled
        write has run, or the forward has ended)."""
        storage = self.sending.pop(vid, None)
        value = self.values.get(vid)
        if value is None or storage is None:
            return  # not made as profiled (a divergence keeps it)
        self.internal = True  # the copy's own ops are not the model's
        try:
            value.offload(storage)
        finally:
            self.internal = False
        self.offloaded[vid] = weakref.ref(value)
        if self.rt.store is not None:
            self.writing[vid] = value.host

    def wait_writes(self, before: int) -> None:
        """Waits for the store writes the plan has freed by op ``before`` (note 5)."""
        for vid in self.rt.wait_before.get(before, ()):
            written = self.writing.pop(vid, None)
            if written is not None:
                written.wait()

    def end_forward(self) -> None:
        profile = self.rt.profile
        if self.diverged_at is None and self.op != profile.forward_ops:
            self.diverge(self.op, f"the forward ran {self.op} ops, the profiled one "
                                  f"{profile.forward_ops}")
        groups: dict[int, _Group] = {}
        plan = self.rt.plan
        for value in self.values.values():
            g = plan.groups.get(value.vid)
            if value.kind != RECOMPUTE or g is None:
                continue
            group = groups.get(g)
            if group is None:
                recipe = plan.group_recipes[g]
                group = groups[g] = _Group(g, self, {
                    a: self.anchors[a] for a in recipe.anchors if a in self.anchors})
            value.group = group
        # Offloads whose last profiled write never came (the step diverged before it): the
        # storage is final now.
        for vid in list(self.sending):
            self.send(vid)
        # Writes of values that die when the forward ends, or later (note 5).
        for vid in list(self.writing):
            self.writing.pop(vid).wait()
        self.values = {}
        self.anchors = {}
        self.cdata = {}
        for w in self.weak:
            torch.UntypedStorage._free_weak_ref(w)
        self.weak = []


class _Kept:
    __slots__ = ("tensor", "version", "pack")

    def __init__(self, tensor, pack):
        self.tensor = tensor
        self.version = tensor._version
        self.pack = pack


class _Saved:
    __slots__ = ("value", "ref")

    def __init__(self, value, ref):
        self.value = value
        self.ref = ref


class _Value:
    """A saved storage the plan moved off the device: rebuilt or fetched on first unpack."""

    __slots__ = ("vid", "kind", "state", "group", "storage", "host", "event", "fetched",
                 "__weakref__")

    def __init__(self, vid: int, kind: str, state: StepState):
        self.vid = vid
        self.kind = kind
        self.state = state
        self.group: Optional[_Group] = None  # set when the forward ends (recompute)
        self.storage: Optional[torch.UntypedStorage] = None
        self.host = None
        self.event = None
        self.fetched = None

    # ---- offload (CUDA: pinned host memory; CPU: the caller's file store) ----------------
    def offload(self, storage: torch.UntypedStorage) -> None:
        store = self.state.rt.store
        if store is not None:
            self.host = store.put(storage)
            return
        d2h, _ = self.state.rt.streams
        device = storage.device
        raw = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        self.host = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=True)
        d2h.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(d2h):
            self.host.copy_(raw, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(d2h)
        raw.record_stream(d2h)

    def prefetch(self) -> None:
        # Back already: an offloaded anchor a rebuild fetched before its planned prefetch.
        if self.storage is not None or self.fetched is not None or self.kind != OFFLOAD:
            return
        store = self.state.rt.store
        if store is not None:
            self.fetched = store.get(self.host)
            return
        _, h2d = self.state.rt.streams
        device = self.state.rt.device
        current = torch.cuda.current_stream(device)
        raw = torch.empty(self.host.numel(), dtype=torch.uint8, device=device)
        h2d.wait_stream(current)
        h2d.wait_event(self.event)
        with torch.cuda.stream(h2d):
            raw.copy_(self.host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(h2d)
        raw.record_stream(h2d)
        self.fetched = (raw, event)

    # ---- the storage, back on the device ------------------------------------------------
    def materialize(self) -> torch.UntypedStorage:
        if self.storage is not None:
            return self.storage
        if self.kind == OFFLOAD and self.state.rt.store is not None:
            self.prefetch()
            self.storage = self.fetched.result().untyped_storage()  # StoreError if it failed
            self.host = self.fetched = None
            return self.storage
        if self.kind == OFFLOAD:
            self.prefetch()
            raw, event = self.fetched
            torch.cuda.current_stream(raw.device).wait_event(event)
            self.storage = raw.untyped_storage()
            self.host = self.fetched = None
            return self.storage
        group = self.group
        if group is None:  # the forward never ended (an exception inside the model)
            raise StepDivergedError(
                "a saved tensor was unpacked before the planned forward ended; remat "
                "refuses rather than give other gradients than eager", op="", module="")
        group.rebuild()
        self.group = None
        self.state = None
        if self.storage is None:
            raise StepDivergedError(
                f"rebuilding saved value {self.vid} made no storage for it", op="", module="")
        return self.storage


class _Group:
    """Rebuilt values whose recipes share ops (the plan's note 4): the first unpack of any
    member replays the union of their recipes once and hands every live member its
    storage. Holds the anchors and the step's captured arguments until then."""

    __slots__ = ("gid", "state", "anchors", "done")

    def __init__(self, gid: int, state: StepState, anchors: dict):
        self.gid = gid
        self.state: Optional[StepState] = state
        self.anchors = anchors
        self.done = False

    def rebuild(self) -> None:
        if self.done:
            return
        state = self.state
        env, cached = self._replay(state)
        for u, storage in env.items():
            if u in cached:
                continue
            ref = state.members.get(u)
            member = ref() if ref is not None else None
            if member is not None and member.storage is None and member.group is self:
                member.storage = storage
                state.materialized[u] = state.members.pop(u)
        self.done = True
        self.anchors = {}
        self.state = None  # the rebuild's captured arguments go with it

    def _replay(self, state: StepState) -> tuple[dict, set]:
        rt = state.rt
        profile = rt.profile
        if state.diverged_at is not None and rt.group_max[self.gid] >= state.diverged_at:
            op = profile.ops[min(state.diverged_at, len(profile.ops) - 1)]
            first = profile.ops[min(rt.plan.group_recipes[self.gid].ops)]
            raise StepDivergedError(
                f"this step diverged from the profiled one at op {state.diverged_at} "
                f"({state.divergence}; profiled there: {op.name} in `{op.where}`), and "
                f"tensors made from {first.name} in `{first.where}` on would be rebuilt from "
                "ops past that point; remat refuses rather than give other gradients than "
                "eager. The next step is profiled again.",
                op=op.name, module=op.where)
        recipe = rt.plan.group_recipes[self.gid]
        # Values of the recipe that an earlier rebuild of this step left on the device (held
        # by their own handles) are used as they are, as the planner's schedule does.
        env: dict[int, torch.UntypedStorage] = {}
        for u, ref in state.materialized.items():
            other = ref()
            if (other is not None and other.storage is not None
                    and not profile.values[u].writers):
                env[u] = other.storage
        device_type = rt.device.type
        cached = set(env)
        drop_after = rt.drops[self.gid]
        with torch.no_grad(), torch.autocast(device_type=device_type, enabled=False):
            for i in recipe.ops:
                rec = profile.ops[i]
                for u in drop_after.get(i, ()):
                    if u not in cached:
                        env.pop(u, None)  # read by no later op of the rebuild, no member
                if cached and _already_made(rec, cached):
                    continue
                statics = state.static_args.get(i, {})
                leaves = []
                for p, leaf in enumerate(rec.leaves):
                    if not isinstance(leaf, TensorRef):
                        leaves.append(statics.get(p, leaf))
                    elif leaf.value < 0:
                        t = statics[p]
                        if t.untyped_storage().nbytes() < _extent_bytes(leaf):
                            rt.refused = True
                            raise _freed(profile, rec, leaf, t.untyped_storage())
                        leaves.append(t.clone() if p in rec.static_writes else t)
                    else:
                        storage = env.get(leaf.value)
                        if storage is None:
                            storage = self.anchors[leaf.value]
                            if type(storage) is _Value:
                                storage = storage.materialize()  # offloaded: fetched back
                            # Checked before ``set_``, which would grow a freed storage
                            # back with whatever bytes the allocator hands out.
                            if storage.nbytes() < _extent_bytes(leaf):
                                rt.refused = True
                                raise _freed(profile, rec, leaf, storage)
                        leaves.append(view_of(storage, leaf))
                args, kwargs = pytree.tree_unflatten(leaves, rec.spec)
                if rec.random:
                    out = _replay_random(rec.func, args, kwargs, state.rng[i], rt.device)
                else:
                    out = rec.func(*args, **kwargs)
                if rec.new_values:
                    for ref, t in zip(rec.outputs, pytree.tree_leaves(out)):
                        if ref is not None and ref.value in rec.new_values:
                            env.setdefault(ref.value, t.untyped_storage())
        return env, cached


def _drop_tables(profile: Profile, plan: EagerPlan) -> dict[int, dict[int, list[int]]]:
    """Per group, op -> the values its rebuild made on the way that no member is and no
    later op of the rebuild reads, to drop before that op runs (as the forward would have
    dropped them; ``eager_schedule`` frees them alike)."""
    members: dict[int, set[int]] = {}
    for v, g in plan.groups.items():
        members.setdefault(g, set()).add(v)
    tables = {}
    for g, recipe in plan.group_recipes.items():
        ops = recipe.ops
        last: dict[int, int] = {}  # value -> position in ``ops`` of its last reader
        for k, i in enumerate(ops):
            rec = profile.ops[i]
            for ref in rec.leaves:
                if isinstance(ref, TensorRef) and ref.value >= 0:
                    last[ref.value] = k
            for v in rec.new_values:
                last.setdefault(v, k)
        table: dict[int, list[int]] = {}
        for v, k in last.items():
            if v not in members.get(g, ()) and k + 1 < len(ops):
                table.setdefault(ops[k + 1], []).append(v)
        tables[g] = table
    return tables


def _extent_bytes(ref: TensorRef) -> int:
    """Bytes of storage the tensor ``ref`` describes reaches into."""
    if any(n == 0 for n in ref.size):
        return 0
    last = ref.offset + sum((n - 1) * s for n, s in zip(ref.size, ref.stride))
    return (last + 1) * ref.dtype.itemsize


def _freed(profile: Profile, rec, ref: TensorRef, storage) -> Exception:
    """A static or anchor a rebuild reads has lost its storage since the forward
    (``resize_``, as FSDP2 frees parameters), which the profiled step did not show at this
    point (the planner avoids what it showed): refuse rather than read freed memory."""
    if ref.value < 0:
        what = f"`{profile.statics[ref.static]}`"
    else:
        made = profile.ops[profile.values[ref.value].op]
        what = f"a tensor made by {made.name} in `{made.where}`"
    return StepDivergedError(
        f"rebuilding a saved tensor replays {rec.name} in `{rec.where}`, which reads {what}; "
        f"its storage holds {storage.nbytes()} bytes now, {_extent_bytes(ref)} are needed "
        "(freed since the forward, unlike in the profiled step); remat refuses rather than "
        "give other gradients than eager. The next step is profiled again.",
        op=rec.name, module=rec.where)


def _already_made(rec, cached: set) -> bool:
    """Whether op ``rec`` only makes or writes values found rebuilt already."""
    made = rec.new_values or [
        rec.leaves[p].value for p in rec.written
        if isinstance(rec.leaves[p], TensorRef) and rec.leaves[p].value >= 0]
    return bool(made) and all(v in cached for v in made)


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _replay_random(func, args, kwargs, states, device):
    cpu, cuda = states
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        return func(*args, **kwargs)


class RunMode(TorchDispatchMode):
    """The planned forward's dispatch mode: checks each op against the profile and keeps
    what rebuilds need (see the module notes)."""

    def __init__(self, state: StepState):
        super().__init__()
        self.state = state
        rt = state.rt
        self.ops = rt.profile.ops
        self.flags = rt.flags
        self.n = rt.profile.forward_ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = self.state
        if st.internal:
            return func(*args, **kwargs)  # an offload's copy: not the model's
        i = st.op
        st.op = i + 1
        if st.diverged_at is not None:
            return func(*args, **kwargs)
        if i >= self.n or self.ops[i].func is not func:
            expected = self.ops[i].name if i < self.n else "the end of the forward"
            st.diverge(i, f"ran {func._schema.name}, expected {expected}")
            return func(*args, **kwargs)
        rec = self.ops[i]
        flags = self.flags[i]
        if flags & WAIT:
            st.wait_writes(i)
        if flags & CAPTURE:
            if not self._capture(i, rec, args, kwargs):
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if type(out) is torch.Tensor:
            if rec.outputs and rec.outputs[0] is not None and out.shape != rec.outputs[0].size:
                st.diverge(i, f"{rec.name} made shape {tuple(out.shape)}, profiled "
                              f"{rec.outputs[0].size}")
                return out
            if flags & (REGISTER | CREATE | ANCHOR):
                self._made(rec, flags, [out])
        elif flags & (REGISTER | CREATE | ANCHOR) or rec.outputs:
            leaves = pytree.tree_leaves(out)
            for ref, t in zip(rec.outputs, leaves):
                if ref is not None and isinstance(t, torch.Tensor) and tuple(t.shape) != ref.size:
                    st.diverge(i, f"{rec.name} made shape {tuple(t.shape)}, profiled {ref.size}")
                    return out
            if flags & (REGISTER | CREATE | ANCHOR):
                self._made(rec, flags, leaves)
        if flags & SEND:
            for vid in st.rt.send_after[i]:
                st.send(vid)  # their storages are final after op i
        return out

    def _capture(self, i, rec, args, kwargs) -> bool:
        """Keeps the statics op ``i`` reads (and its generator state), after checking that
        it reads the very tensors the profile saw."""
        st = self.state
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != rec.spec:
            st.diverge(i, f"{rec.name} is called with other arguments than profiled")
            return False
        statics = {}
        for p, ref in enumerate(rec.leaves):
            if not isinstance(ref, TensorRef):
                # A constant that differs from the profiled one (a scale set between steps)
                # is what this forward ran with, and so what its replay must run with.
                if not _same_constant(leaves[p], ref):
                    statics[p] = leaves[p]
                continue
            t = leaves[p]
            if not isinstance(t, torch.Tensor):
                st.diverge(i, f"{rec.name} argument {p} is no longer a tensor")
                return False
            if ref.value >= 0:
                if st.cdata.get(ref.value) != _cdata(t):
                    st.diverge(i, f"{rec.name} reads another tensor than the profiled step")
                    return False
            else:
                statics[p] = t
        st.static_args[i] = statics
        if rec.random:
            st.rng[i] = _rng_state(st.rt.device)
        return True

    def _made(self, rec, flags, leaves) -> None:
        st = self.state
        plan = st.rt.plan
        for ref, t in zip(rec.outputs, leaves):
            if ref is None or ref.value not in rec.new_values or ref.value in st.cdata:
                continue
            storage = t.untyped_storage()
            st.cdata[ref.value] = storage._cdata
            st.weak.append(storage._weak_ref())
            vid = ref.value
            kind = plan.decisions.get(vid)
            anchor = bool(flags & ANCHOR) and vid in plan.anchors
            if anchor and kind != OFFLOAD:
                st.anchors[vid] = storage
            if flags & CREATE and kind in (RECOMPUTE, OFFLOAD):
                value = _Value(vid, kind, st)
                st.values[vid] = value
                if kind == RECOMPUTE:
                    st.members[vid] = weakref.ref(value)
                if kind == OFFLOAD:
                    st.sending[vid] = storage  # until its copy starts (``_send``)
                    if anchor:
                        # An offloaded anchor (the plan's note 7): its rebuilds fetch it.
                        st.anchors[vid] = value


def _same_constant(now, profiled) -> bool:
    if now is profiled:
        return True
    if type(now) is not type(profiled):
        return False
    if isinstance(now, float) and now != now:
        return profiled != profiled  # NaN as recorded
    try:
        return bool(now == profiled)
    except (TypeError, RuntimeError):
        return False


def make_hooks(state: StepState):
    """The pack / unpack pair for one planned step."""
    rt = state.rt
    packs = rt.profile.packs
    decisions = rt.plan.decisions

    def pack(t: torch.Tensor):
        k = state.packs
        state.packs = k + 1
        if state.diverged_at is not None or k >= len(packs):
            if state.diverged_at is None:
                state.diverge(state.op, "autograd saved more tensors than in the profile")
            return _Kept(t, None)
        ref = packs[k].ref
        if tuple(t.shape) != ref.size or t.dtype != ref.dtype:
            state.diverge(state.op, f"saved tensor {k} has shape {tuple(t.shape)} "
                                    f"{t.dtype}, profiled {ref.size} {ref.dtype}")
            return _Kept(t, None)
        vid = ref.value
        if vid < 0 or decisions.get(vid, KEEP) == KEEP:
            return _Kept(t, packs[k])
        value = state.values.get(vid)
        if value is None or state.cdata.get(vid) != _cdata(t):
            state.diverge(state.op, f"saved tensor {k} is not the profiled one")
            return _Kept(t, None)
        return _Saved(value, ref)

    def unpack(handle):
        c = state.unpacks
        state.unpacks = c + 1
        if state.pending:
            _prefetch(state, c)
        if type(handle) is _Kept:
            t = handle.tensor
            if t._version != handle.version:
                if handle.pack is not None:
                    raise RuntimeError(version_message(handle.pack, handle.version, t._version))
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified "
                    f"by an inplace operation: shape {list(t.shape)}, version {t._version}, "
                    f"expected {handle.version}")
            return t
        return view_of(handle.value.materialize(), handle.ref)

    return pack, unpack


def _prefetch(state: StepState, count: int) -> None:
    pending = state.pending
    while state.next_prefetch < len(pending) and pending[state.next_prefetch][0] <= count:
        ref = state.offloaded.get(pending[state.next_prefetch][1])
        state.next_prefetch += 1
        value = ref() if ref is not None else None
        if value is not None:
            value.prefetch()
