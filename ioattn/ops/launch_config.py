"""The launch configurations every kernel family takes (`FwdConfig`, `BwdConfig`, `PagedConfig`, `MLAConfig`) are
public (`config=`): each checks itself when built, so a value no kernel can build fails naming its field instead of
deep inside Triton (or, under the interpreter, running where the GPU would refuse it)."""

from __future__ import annotations

import dataclasses

WARPS = (1, 2, 4, 8, 16)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_launch_config(config) -> None:
    """Fields by name: tile sizes (`*block*`) powers of two in 16..256 (a dot's smallest tile is 16), warps
    (`*num_warps`) a power of two up to 16, stages (`*_stages`) 1..8, `maxnreg` 32..255, `programs_per_sm` and
    `sms_per_program` >= 1, bool fields bools; a field whose default is None may be None."""
    owner = type(config).__name__
    for field in dataclasses.fields(config):
        name, value = field.name, getattr(config, field.name)
        if value is None and field.default is None:
            continue
        if isinstance(field.default, bool) or field.type in ("bool", bool):
            ok, allowed = isinstance(value, bool), "a bool"
        elif "block" in name:
            ok, allowed = _whole(value) and 16 <= value <= 256 and value & (value - 1) == 0, "a power of two in 16..256"
        elif name.endswith("num_warps"):
            ok, allowed = _whole(value) and value in WARPS, "1, 2, 4, 8 or 16"
        elif name.endswith("_stages"):
            ok, allowed = _whole(value) and 1 <= value <= 8, "an int in 1..8"
        elif name == "maxnreg":
            ok, allowed = _whole(value) and 32 <= value <= 255, "an int in 32..255"
        elif name in ("programs_per_sm", "sms_per_program"):
            ok, allowed = _whole(value) and value >= 1, "an int >= 1"
        else:
            continue
        if not ok:
            optional = " (or None)" if field.default is None else ""
            raise ValueError(f"{owner}.{name} must be {allowed}{optional}, got {value!r}")
