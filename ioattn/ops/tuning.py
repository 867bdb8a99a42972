"""One protocol for the launch configurations of every kernel family, so tuning and tables read alike.

Each family module — `ioattn.ops.forward`, `ioattn.ops.backward`, `ioattn.ops.paged` — holds its config type,
its tuned table (every entry naming the committed tuning run under bench/results/ it came from), its launcher,
and these two functions with one signature:

    candidate_configs(head_dim, dtype, **variant) -> list[Config]   # what `ioattn bench tune` times
    default_config(head_dim, dtype, **variant) -> Config            # the rule where the table has no entry

`variant` is the family's own distinction: the forward's `mask_dtype` (a dense mask's dtype, None without one),
the paged family's `decode` (one query per sequence, or multi-token), none for the backward.
"""

from __future__ import annotations

from ioattn.ops import backward, forward, paged

FAMILIES = {"fwd": forward, "bwd": backward, "paged": paged}


def candidate_configs(family: str, head_dim: int, dtype, **variant) -> list:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    return FAMILIES[family].candidate_configs(head_dim, dtype, **variant)
