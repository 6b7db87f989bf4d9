"""What a native run (:mod:`.native_run`) keeps of the objects its recorded calls read,
and how it patches the addresses of the ones it may relocate.

A recorded call's argument blocks hold the addresses of the tensors it read. Before a
later run makes them, each read slot is checked against what was recorded:

* a slot whose object's address the blocks hold only as whole 8-byte fields
  (:func:`relocations`) keeps no reference at all (:data:`UNHELD`): its fields are
  patched to the address of whatever the slot holds now, before every run. So a
  fresh output or intermediate of one run is never kept alive by the record, and a
  block's stale address is never made: the patch comes first.
* any other slot keeps a weak reference (:func:`hold`) where the object takes one
  (tensors and arrays do): it matches only the very object, while it is alive. A
  recorded object that was freed never matches (not even a new object at the same
  ``id``), so the call is recorded again, and the record never keeps a per-run
  intermediate alive. Objects without weak references (None, numbers, lists) are held
  as they are; they own no buffer a C call reads.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["UNHELD", "hold", "held_is", "address_span", "relocations", "relocated_address"]

_ref = weakref.ref


class _Unheld:
    """The entry of a slot whose object is not held (its fields are patched each run)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNHELD"


UNHELD: Any = _Unheld()


def hold(x: Any, relocatable: bool) -> Any:
    """What a record keeps of ``x``, read from a slot (see the module doc)."""
    if relocatable:
        return UNHELD
    try:
        return _ref(x)
    except TypeError:
        return x


def held_is(x: Any, h: Any) -> bool:
    """Whether ``x`` is the object entry ``h`` (of :func:`hold`) was made from, alive."""
    if type(h) is _ref:
        h = h()
        return h is not None and h is x
    return h is x and h is not UNHELD


def relocated_address(x: Any, nbytes: int) -> int | None:
    """The address to patch in for ``x`` in a slot recorded with ``nbytes`` (None: not
    relocatable: another size, not contiguous, not a tensor or array)."""
    span = address_span(x)
    return span[0] if span is not None and span[1] == nbytes else None


def address_span(x: Any) -> tuple[int, int] | None:
    """``(address, bytes)`` of a contiguous torch tensor or NumPy array (None: another
    kind, whose address a native run does not read)."""
    if hasattr(x, "data_ptr") and type(x).__module__.startswith("torch"):
        return (x.data_ptr(), x.numel() * x.element_size()) if x.is_contiguous() else None
    if type(x).__name__ == "ndarray" and x.flags.c_contiguous:
        return x.__array_interface__["data"][0], x.nbytes
    return None


def relocations(slots: tuple[int, ...], before: list, rec: list) -> dict:
    """For each of ``slots`` whose object's address the recorded blocks ``rec`` hold
    only as whole fields: slot -> (its bytes, [(pair, byte offset)] of those fields).
    A later object is relocated only when it spans the same bytes (a slot a kernel's
    Python fills is not checked by the program: a tensor of another size is recorded
    again, its call's own checks then see it)."""
    out: dict[int, tuple[int, list[tuple[int, int]]]] = {}
    for i in slots:
        span = address_span(before[i])
        if span is None or span[1] == 0:
            continue
        lo, hi = span[0], span[0] + span[1]
        at: list[tuple[int, int]] | None = []
        for p, (_, args) in enumerate(rec):
            if len(args) % 8:
                at = None
                break
            for k, v in enumerate(memoryview(args).cast("q")):
                if lo <= v < hi:
                    if v != lo:  # an address inside it: not a plain field
                        at = None
                        break
                    at.append((p, 8 * k))
            if at is None:
                break
        if at is not None:
            out[i] = (span[1], at)
    return out
