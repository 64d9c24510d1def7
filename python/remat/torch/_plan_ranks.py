"""One plan for every rank: under ``torch.distributed``, rank 0 plans a step and every rank
runs rank 0's decisions (``auto_checkpoint``'s ``share_plan``).

Plans depend on measured op times, which differ between processes; two ranks planning
apart may rebuild different regions, and where a region holds a collective they would
issue different ones. So planning an input signature is collective on the default group:
every rank sends rank 0 its signature and its step's structure (all ranks learn of any
difference and raise the same error, rather than some going on to a collective the others
never reach), rank 0 plans, and broadcasts the plan as a record (``_plan_file``), which the
other ranks bind to their own profiled step. Rank 0's failure to plan (a budget nothing
meets) is broadcast too and raised on every rank.

Every rank must plan the same signatures at the same steps: the first step of each new
input shape profiles on every rank, and the next step with that shape plans, so ranks fed
batches of the same shapes in the same order (what DDP and FSDP loops do) meet there.
"""

from __future__ import annotations

from typing import Callable

from .errors import PlanMismatchError
from ._plan_file import first_difference, fingerprint


def sharing(share_plan: bool) -> bool:
    """Whether this process plans together with the other ranks of its default group."""
    if not share_plan:
        return False
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def check_same_step(signature: str, ops: list[list]) -> None:
    """Every rank's signature and step structure against rank 0's (collective)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, [signature, fingerprint(ops)])
    differing = [r for r in range(world) if gathered[r] != gathered[0]]
    if not differing:
        return
    rank = differing[0]
    if gathered[rank][0] != gathered[0][0]:
        raise PlanMismatchError(
            f"share_plan: rank {rank} plans input signature {gathered[rank][0]} while rank 0 "
            f"plans {gathered[0][0]}; ranks must see the same input shapes in the same order "
            "(or pass share_plan=False)", source=f"rank {rank}", field="signature")
    # Every rank knows of the difference: all send their structures, for the message.
    structures: list = [None] * world
    dist.all_gather_object(structures, ops)
    raise PlanMismatchError(
        f"share_plan: rank {rank}'s step differs from rank 0's: "
        f"{first_difference(structures[rank], structures[0])} (rank 0's is 'there'); "
        "pass share_plan=False to plan on each rank", source=f"rank {rank}", field="step")


def share(make_record: Callable[[], dict]) -> tuple[dict, bool]:
    """Rank 0 calls ``make_record`` and every rank receives its record (collective);
    ``(record, planned_here)``. An error rank 0 meets is raised on every rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    payload: list = [None]
    failure = None
    if rank == 0:
        try:
            payload[0] = ["plan", make_record()]
        except BaseException as e:  # every rank must hear of it, or the others would wait
            failure = e
            payload[0] = ["error", type(e).__name__, str(e)]
    dist.broadcast_object_list(payload, src=0)
    if failure is not None:
        raise failure
    kind, *rest = payload[0]
    if kind == "error":
        name, message = rest
        from ..errors import BudgetError
        from .errors import CaptureError

        cls = BudgetError if name == "BudgetError" else CaptureError
        raise cls(f"rank 0 could not plan this step: {message}")
    return rest[0], rank == 0
