"""The reservation invariants (docs/semantics.md section 8), checked the same way by both managers'
``validate()``: a module of its own, so the device manager does not import the reference."""
from __future__ import annotations

from .errors import InvariantError


def check_reservations(reserved, active, total: int, num_free: int) -> None:
    """The reservation invariants (docs/semantics.md section 8): per slot ``>= 0`` and 0 on a free
    slot, their sum ``== total``, ``total <= num_free``. Raises InvariantError."""
    for r, (v, a) in enumerate(zip(reserved, active)):
        if v < 0 or (v and not a):
            raise InvariantError("validate", f"slot {r} has reservation {v}{'' if a else ' but is free'}", r)
    if sum(reserved) != total:
        raise InvariantError("validate", f"reservations sum to {sum(reserved)} but the reserved total is {total}",
                             total)
    if total > num_free:
        raise InvariantError("validate", f"{total} blocks reserved but only {num_free} free", total)
