"""The scales of an FP8 KV cache: one float32 per (layer, KV head) for K and one for V, and where they came from.

The cache holds K / k_scale and V / v_scale (`ioattn.ops.fp8`). `resolve_kv_scales` takes them, by the engine's
`kv_cache_scales` setting:

- a number: that scale everywhere, given by the user (1.0 is the uncalibrated default of other engines: it is
  honoured only when asked for, with a warning, since values under 2^-6 then lose precision in e4m3 and values
  over 448 saturate);
- a path to a JSON file `{"k_scale": [[...]], "v_scale": [[...]]}`: one row per layer, one entry per KV head
  (or one number per layer for every head), given by the user;
- "checkpoint": the checkpoint's `model.layers.{i}.self_attn.k_scale` / `v_scale` tensors, as llm-compressor
  writes them (per tensor, shape () or (1,), or per KV head, (num_kv_heads,));
- "calibrate": a calibration pass at start-up (below);
- None ("auto"): the checkpoint's when it carries them, else calibrated.

Scales whose shape does not match the model's layers or KV heads, or that are not finite and > 0, raise
ValueError at start-up, naming the tensor or entry.

**Calibration.** The model runs once over a short text (dense attention, no cache, the model's dtype) and each
layer records amax, the largest |K| (after RoPE: what the cache stores) and |V| per KV head. The scale is

    scale = 2 ** ceil(log2(amax * HEADROOM / fp8_max)),   HEADROOM = 4

so amax lands between fp8_max / 8 and fp8_max / 4: a later value up to 4-8x the calibration's largest still fits
before saturating. A short pass underestimates amax (on smollm2 the seeds' text reached 1.26x the pass's K amax
and 1.67x its V amax; at a headroom of 1.25 two heads' V saturated and perplexity rose by 1.79% against 1.59% at
scale 1.0, bench/results/2026-12-02-fp8-kv-smollm2-cpu.md), while the headroom costs almost no precision: an fp8
format's relative spacing is the same over its whole normal range, and the headroom only moves values below
amax x 1.4e-4 .. 2.8e-4 (e4m3's smallest normal, 2^-6 of the scale) into its subnormals.
Powers of two make dequantization exact in every dtype (the gathered path's K and V are then exactly the
cached values) and make the scales' identity, which the prefix-cache key holds, stable to the last bits of amax.
A head whose amax is 0 gets scale 1. The text: a few built-in passages (prose, dialogue, code, numbers; none of
them the evaluation text `ioattn eval` scores) in the model's tokenizer; for random-weight presets (a byte
tokenizer: their weights model no language, so no text is more typical than any other) seeded random token ids.

**Rotation.** With calibrated scales and a power-of-two head dim, the cache stores K and V rotated by a fixed
orthogonal matrix (`ioattn.ops.fp8.kv_rotation`: a Hadamard matrix with random signs) and the queries and the
output are rotated to match, which changes no score and no output at full precision. The rounding does change:
e4m3 rounds every element to about the same relative error, so a score's error, sum_i q_i k_i e_i, is largest
when q and k put their weight on the same few channels (RoPE's slow pairs, outlier channels), and the rotation
spreads every vector over all channels. On smollm2 (8192 tokens of the seeds' text) the e4m3 cache's perplexity
cost fell from +1.50% to +0.29% through the engine (bench/results/2026-12-06-fp8-kv-smollm2-cpu.md), and from
+1.50% to +0.10% in a dense pass rounding K and V the same way; the random signs matter (a plain Hadamard matrix:
+0.47%; bench/results/2026-12-06-fp8-rotation-smollm2-cpu.md). Other head dims are not rotated. Scales from a
checkpoint, a number or a file are for the unrotated values, so those caches are not rotated, unless a file says
`"rotation": "hadamard-signed"` (scales of the rotated values); `calibrate(..., rotate=False)` gives calibrated
scales without it. The rotation is part of the scales' identity, hence of the prefix-cache key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass

import torch

from ioattn.ops.fp8 import KV_ROTATION, fp8_max, kv_cache_dtype_name, kv_rotation, scale_for_amax

HEADROOM = 4.0
CALIBRATION_SOURCES = ("checkpoint", "calibrate")
RANDOM_CALIBRATION = (4, 256)  # sequences x tokens of random ids for models without a language tokenizer
CALIBRATION_TEXTS = (
    "The history of the printing press begins long before Gutenberg. Woodblock printing spread across East Asia "
    "centuries earlier, and movable type made of ceramic and later metal appeared in China and Korea. What changed "
    "in fifteenth-century Europe was the combination of an adjustable type mould, oil-based ink and a screw press.",
    "User: Can you help me plan a three-day trip to Lisbon on a small budget?\nAssistant: Of course. On the first "
    "day, walk through Alfama and take tram 28 early, before the crowds. On the second, visit Belem: the monastery "
    "is free on Sunday mornings for residents, and the pastries are worth the queue.",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    out, i, j = [], 0, 0\n    while i < len(a) and "
    "j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n            "
    "out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "Quarterly results: revenue rose 12.4% to $3.81 billion, operating margin was 17.9% against 16.2% a year "
    "earlier, and the company raised its full-year guidance to between $15.2 and $15.6 billion. Shares gained 4% "
    "in after-hours trading on 2,315,000 volume.",
    "Photosynthesis converts light energy into chemical energy. In the light-dependent reactions, water is split "
    "and oxygen released; the Calvin cycle then fixes carbon dioxide into three-carbon sugars using ATP and NADPH.",
    "Dear Ms. Alvarez, thank you for your letter of 14 March. We have reviewed the invoice and agree that the "
    "second delivery was charged twice. A credit note for the full amount will follow within five working days.",
    "Q: What is the capital of Australia?\nA: Canberra.\nQ: How many sides does a hexagon have?\nA: Six.\nQ: Who "
    "wrote 'Pride and Prejudice'?\nA: Jane Austen.\nQ: What is 17 times 23?\nA: 391.",
    "Il pleuvait depuis le matin sur la petite ville. Dans le cafe de la place, trois hommes jouaient aux cartes "
    "en silence, tandis que la patronne essuyait les verres en regardant passer les rares voitures.",
)


@dataclass(frozen=True)
class KVScales:
    """k, v: float32 (num_layers, num_kv_heads) on the CPU; source: "user", "checkpoint", "calibrated" or
    "unit"; detail: one line on how they were obtained; rotation: None (the cache holds K and V as the model
    computes them) or KV_ROTATION (rotated by `kv_rotation`, and the scales are those of the rotated values)."""

    k: torch.Tensor
    v: torch.Tensor
    source: str
    detail: str
    rotation: str | None = None

    def identity(self) -> str:
        """A short digest of the exact values: part of the prefix-cache key of blocks written with them."""
        digest = hashlib.blake2b(digest_size=8)
        for t in (self.k, self.v):
            digest.update(t.to(torch.float32).contiguous().numpy().tobytes())
        if self.rotation is not None:  # absent for unrotated scales: their identity is what it was before rotations
            digest.update(f"rotation={self.rotation}".encode())
        return digest.hexdigest()

    def describe(self) -> dict:
        return {"source": self.source, "detail": self.detail, "rotation": self.rotation,
                "k_scale_range": [float(self.k.min()), float(self.k.max())],
                "v_scale_range": [float(self.v.min()), float(self.v.max())], "identity": self.identity()}


def check_kv_cache_scales_setting(value) -> None:
    """ValueError unless `kv_cache_scales` is None, "checkpoint", "calibrate", a positive finite number, a path or
    resolved `KVScales` (e.g. `calibrate(loaded, dtype, rotate=False)`)."""
    if value is None or isinstance(value, KVScales) or value in CALIBRATION_SOURCES:
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isfinite(value) and value > 0:
            return
    elif isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return
    raise ValueError(f"kv_cache_scales must be None (the checkpoint's, else calibrated), 'checkpoint', 'calibrate', "
                     f"a number > 0, a JSON file path or KVScales, got {value!r}")


def resolve_kv_scales(loaded, cache_dtype: torch.dtype, setting) -> KVScales:
    """The scales an fp8 engine serving `loaded` uses with this `kv_cache_scales` setting (see the docstring)."""
    config = loaded.config
    layers, heads = config.num_layers, config.num_kv_heads
    if isinstance(setting, KVScales):
        for name, t in (("k", setting.k), ("v", setting.v)):
            if not isinstance(t, torch.Tensor) or t.shape != (layers, heads):
                raise ValueError(f"kv_cache_scales.{name} must be (num_layers, num_kv_heads) = ({layers}, {heads}), "
                                 f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            check_values(f"kv_cache_scales.{name}", t.to(torch.float32))
        if setting.rotation not in (None, KV_ROTATION) or (setting.rotation and kv_rotation(config.head_dim) is None):
            raise ValueError(f"kv_cache_scales.rotation must be None or {KV_ROTATION!r} (power-of-two head dims; "
                             f"the model's is {config.head_dim}), got {setting.rotation!r}")
        return setting
    if isinstance(setting, (int, float)) and not isinstance(setting, bool):
        if setting == 1.0:
            warnings.warn("kv_cache_scales=1.0: an uncalibrated fp8 KV cache (values under 2^-6 of the format lose "
                          "precision, values over its max saturate); leave kv_cache_scales unset to calibrate",
                          stacklevel=3)
        full = torch.full((layers, heads), float(setting))
        return KVScales(full, full.clone(), "unit" if setting == 1.0 else "user", f"{float(setting)!r} everywhere")
    found = getattr(loaded, "kv_scales", None) or {}
    if (setting is None and found) or setting == "checkpoint":
        if not found:
            raise ValueError("kv_cache_scales='checkpoint': the checkpoint carries no self_attn.k_scale / v_scale "
                             "tensors")
        return checkpoint_scales(found, layers, heads)
    if setting is None or setting == "calibrate":
        return calibrate(loaded, cache_dtype)
    return file_scales(os.fspath(setting), layers, heads, config.head_dim)


def _rows(name: str, value, layers: int, heads: int) -> torch.Tensor:
    """(layers, heads) float32 from per-layer entries, each a number (all heads) or a list of `heads` numbers."""
    if not isinstance(value, list) or len(value) != layers:
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise ValueError(f"{name} must hold one entry per layer ({layers}), got {got}")
    rows = []
    for i, entry in enumerate(value):
        row = [entry] * heads if isinstance(entry, (int, float)) and not isinstance(entry, bool) else entry
        if not isinstance(row, list) or len(row) != heads or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in row):
            raise ValueError(f"{name}[{i}] must be a number or a list of {heads} numbers (one per KV head), got "
                             f"{entry!r}")
        rows.append(row)
    return check_values(name, torch.tensor(rows, dtype=torch.float32))


def check_values(name: str, scales: torch.Tensor) -> torch.Tensor:
    bad = ~(torch.isfinite(scales) & (scales > 0))
    if bad.any():
        layer, head = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: the scale of layer {layer}, KV head {head} is {float(scales[layer, head])!r}; "
                         "scales must be finite and > 0")
    return scales


def file_scales(path: str, layers: int, heads: int, head_dim: int | None = None) -> KVScales:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"kv_cache_scales file {path}: {error}") from None
    if not isinstance(data, dict) or not {"k_scale", "v_scale"} <= data.keys():
        raise ValueError(f"kv_cache_scales file {path} must be a JSON object with 'k_scale' and 'v_scale'")
    rotation = data.get("rotation")
    if rotation not in (None, KV_ROTATION):
        raise ValueError(f"kv_cache_scales file {path}: 'rotation' must be null or {KV_ROTATION!r} (the scales are "
                         f"those of K and V rotated by ioattn.ops.fp8.kv_rotation), got {rotation!r}")
    if rotation is not None and head_dim is not None and kv_rotation(head_dim) is None:
        raise ValueError(f"kv_cache_scales file {path}: rotation {rotation!r} needs a power-of-two head dim, the "
                         f"model's is {head_dim}")
    k = _rows(f"{path}: k_scale", data["k_scale"], layers, heads)
    v = _rows(f"{path}: v_scale", data["v_scale"], layers, heads)
    return KVScales(k, v, "user", f"from {path}", rotation)


def checkpoint_scales(tensors: dict[str, torch.Tensor], layers: int, heads: int) -> KVScales:
    """(layers, heads) K and V scales from the checkpoint's per-layer tensors; every layer must have both, each
    per tensor (one value) or per KV head."""
    out = {"k_scale": torch.empty(layers, heads), "v_scale": torch.empty(layers, heads)}
    expected = {f"model.layers.{i}.self_attn.{kind}" for i in range(layers) for kind in out}
    unknown = sorted(set(tensors) - expected)
    missing = sorted(expected - set(tensors))
    if unknown or missing:
        raise ValueError(f"the checkpoint's KV cache scales do not match the model's {layers} layers: missing "
                         f"{missing[:4]}, unexpected {unknown[:4]}")
    for name, value in tensors.items():
        layer, kind = int(name.split(".")[2]), name.rsplit(".", 1)[1]
        flat = value.detach().to(torch.float32).reshape(-1)
        if flat.numel() not in (1, heads):
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(value.shape)}: a KV cache scale must be per "
                             f"tensor (one value) or per KV head ({heads} values)")
        out[kind][layer] = flat.expand(heads)
    k = check_values("checkpoint k_scale", out["k_scale"])
    v = check_values("checkpoint v_scale", out["v_scale"])
    per = "per KV head" if any(t.numel() > 1 for t in tensors.values()) else "per tensor"
    return KVScales(k, v, "checkpoint", f"self_attn.k_scale / v_scale tensors ({per})")


class _Recorder:
    """An attention context that records per-(layer, KV head) amax of K and V, then attends densely."""

    def __init__(self, inner, layers: int, heads: int, rotation: torch.Tensor | None = None):
        self.inner = inner
        self.k_amax = torch.zeros(layers, heads)
        self.v_amax = torch.zeros(layers, heads)
        self.rotation = rotation  # amax of the values the cache would hold: x M / D (see kv_rotation)

    def attend(self, q, k, v, layer_idx: int):
        for amax, t in ((self.k_amax, k), (self.v_amax, v)):
            t = t.detach().float()
            if self.rotation is not None:
                t = t @ self.rotation.to(t.device) / t.shape[-1]
            amax[layer_idx] = torch.maximum(amax[layer_idx], t.abs().amax(dim=(0, 2)).cpu())
        return self.inner.attend(q, k, v, layer_idx)


def calibration_tokens(loaded, max_len: int) -> tuple[list[list[int]], str]:
    """The calibration pass's sequences (each at most max_len tokens) and a line saying what they are."""
    from ioattn.models.tokenizer import ByteTokenizer

    if isinstance(loaded.tokenizer, ByteTokenizer):
        count, length = RANDOM_CALIBRATION
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, loaded.config.vocab_size, (count, min(length, max_len)), generator=generator)
        return ids.tolist(), f"{count} x {min(length, max_len)} random token ids (seed 0; a random-weight model)"
    sequences = [loaded.tokenizer.encode(text)[:max_len] for text in CALIBRATION_TEXTS]
    sequences = [s for s in sequences if s]
    return sequences, f"{len(sequences)} built-in passages, {sum(map(len, sequences))} tokens"


@torch.inference_mode()
def calibrate(loaded, cache_dtype: torch.dtype, headroom: float = HEADROOM, rotate: bool = True) -> KVScales:
    """Scales from one dense pass over `calibration_tokens` (see the module docstring for the rule), of K and V
    rotated by `kv_rotation` where the head dim allows it (`rotate`=False and `headroom` other than HEADROOM are
    for experiments)."""
    from ioattn.models.llama import DenseCausalAttention

    model, config = loaded.model, loaded.config
    device = model.inv_freq.device
    sequences, what = calibration_tokens(loaded, loaded.max_model_len)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(len(s), device=device) for s in sequences])
    # Dense attention by PyTorch's SDPA off CUDA (exact, and quick where Triton would be interpreted).
    dense = DenseCausalAttention.build([len(s) for s in sequences], config, device,
                                       backend="auto" if device.type == "cuda" else "torch")
    rotation = kv_rotation(config.head_dim) if rotate else None
    recorder = _Recorder(dense, config.num_layers, config.num_kv_heads, rotation)
    model(ids, positions, recorder)
    limit = fp8_max(cache_dtype)
    scales = []
    for name, amax in (("K", recorder.k_amax), ("V", recorder.v_amax)):
        if not torch.isfinite(amax).all():
            layer = int((~torch.isfinite(amax)).nonzero()[0, 0])
            raise ValueError(f"calibration: the model produced non-finite {name} values in layer {layer}")
        scales.append(scale_for_amax(amax, cache_dtype, headroom))
    detail = (f"amax over {what}{'' if rotation is None else ' of K and V rotated'}; scale = "
              f"2^ceil(log2(amax x {headroom:g} / {limit:g})) ({kv_cache_dtype_name(cache_dtype)})")
    return KVScales(scales[0], scales[1], "calibrated", detail, None if rotation is None else KV_ROTATION)
