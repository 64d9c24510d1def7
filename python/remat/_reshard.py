"""Resharding from Python: the Rust resharder (``remat_reshard::run``, as ``remat reshard``
runs it), called in process."""

from __future__ import annotations

import os
from typing import Iterable, Mapping, Optional, Sequence, Tuple, Union

from . import _arguments, _native
from .errors import ArgumentError

__all__ = ["reshard", "verify"]

PathLike = Union[str, "os.PathLike[str]"]
Rules = Union[Mapping[str, str], Iterable[Tuple[str, str]]]


def reshard(
    src: PathLike,
    dst: PathLike,
    world_size: int,
    *,
    format: str = "remat",
    source_format: Optional[str] = None,
    preset: Optional[str] = None,
    place: Optional[Rules] = None,
    max_buffer: Union[int, str] = "256MiB",
    dry_run: bool = False,
    force: bool = False,
    rank: Optional[int] = None,
    finalize: bool = False,
) -> dict:
    """Reshards the checkpoint at ``src`` (remat, PyTorch DCP or Hugging Face layout,
    detected unless ``source_format`` says) onto ``world_size`` ranks in ``dst``,
    byte-exact, as ``remat reshard SRC DST --world-size M`` does.

    format: output layout: "remat" (rank files + index), "dcp" (PyTorch DCP with Hugging
        Face storage, loadable by ``torch.distributed.checkpoint``), "hf" (whole tensors).
    preset: placement of tensors no ``place`` rule matches: "simple" or "parallel";
        default: the source's placement on the new ranks.
    place: (PATTERN, RULE) pairs (or a dict), first match wins; RULE is shard(D),
        replicate, whole, rank:R or source; PATTERN a glob over tensor names.
    max_buffer: bound on buffered bytes (int, or text as ``--max-buffer`` takes it:
        "256MiB", "1.5GB"; GB is 10^9 bytes, GiB 2^30, units in any case).
    dry_run: write nothing; the result has per-rank bytes, reads and the buffer peak.
    force: replace an existing output.
    rank / finalize: write one rank's part, then (once every rank is done) check the
        parts and write the index.

    Returns a dict: summary (the line the command prints), source_format,
    source_world_size, tensors, world_size, format, skipped [(file, why)], ranks (per-rank
    statistics), and files_written / bytes_written / seconds / gb_per_s / buffer_bytes
    when written, peak_buffer / max_buffer / threads for a dry run, parts when finalized.

    Raises ArgumentError (naming the argument, in the words ``remat reshard`` uses after
    its flag: a world size of 0, ``max_buffer=0``, an unknown format ...) before anything
    is read, ReshardError (naming the file or tensor) otherwise; on error nothing is
    written.

    >>> r = remat.reshard("ckpt", "ckpt-w3", 3)
    >>> r["world_size"], r["files_written"], r["source_format"]
    (3, 3, 'hf')
    >>> print(r["summary"])
    ckpt: hf layout, 1 rank, 2 tensors, 1 -> 3 ranks (remat layout)
    >>> remat.reshard("ckpt", "ckpt-w2", 2, dry_run=True)["ranks"][0]["rank"]
    0
    >>> remat.reshard("ckpt", "ckpt-w0", 0)
    Traceback (most recent call last):
    ...
    remat.errors.ArgumentError: world_size 0: must be at least 1
    """
    world_size = _arguments.count(world_size, "world_size")
    for name, value in (("format", format), ("source_format", source_format), ("preset", preset)):
        if value is not None and not isinstance(value, str):
            raise ArgumentError(f"{name}: a name (str), not {type(value).__name__}")
    return _native.reshard(
        os.fspath(src),
        os.fspath(dst),
        world_size,
        format,
        source_format,
        preset,
        _rules(place),
        _buffer_bytes(max_buffer),
        bool(dry_run),
        bool(force),
        _rank(rank),
        bool(finalize),
    )


def verify(
    a: PathLike,
    b: PathLike,
    *,
    format_a: Optional[str] = None,
    format_b: Optional[str] = None,
) -> dict:
    """Whether two layouts hold the same global tensors (streaming, chunk checksums
    checked), as ``remat reshard verify A B``. Returns a dict: same, tensors,
    bytes_compared, chunks_checksummed, skipped, and difference (None, or tensor, element,
    detail and the message the command prints).

    >>> _ = remat.reshard("ckpt", "ckpt-w2", 2)
    >>> report = remat.verify("ckpt", "ckpt-w2")
    >>> report["same"], report["tensors"], report["difference"]
    (True, 2, None)
    """
    return _native.verify(os.fspath(a), os.fspath(b), format_a, format_b)


def _rules(place: Optional[Rules]) -> list:
    if place is None:
        return []
    items: Sequence = list(place.items()) if isinstance(place, Mapping) else list(place)
    rules = []
    for item in items:
        if (
            not isinstance(item, (tuple, list))
            or len(item) != 2
            or not all(isinstance(x, str) for x in item)
        ):
            raise ArgumentError(f"place: {item!r} is not a (PATTERN, RULE) pair of strings")
        rules.append((item[0], item[1]))
    return rules


def _buffer_bytes(max_buffer: Union[int, str]) -> int:
    # An int goes through the same reader as text, so its errors read the same.
    return _arguments.size(max_buffer, "max_buffer", nonzero=True)


def _rank(rank: Optional[int]) -> Optional[int]:
    if rank is None:
        return None
    return _arguments.count(rank, "rank", 0)
