"""What the command-line front ends share (`ioattn.cli` and the subcommands' own modules): the default model, the
argparse types, and argparse's way out for errors found after parsing."""

from __future__ import annotations

import argparse
import sys

DEFAULT_MODEL = "smollm2"
MODEL_HELP = ("a preset (smollm2: SmolLM2-135M-Instruct, the default; tiny; tiny-mla; llama3-8b-shape; "
              "deepseek-v2-lite-shape; llama3.2-3b-shape), a llama GGUF file or a local Hugging Face checkpoint folder")


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def fail(command: str, message: str) -> int:
    """argparse's way out: the message on stderr, exit status 2."""
    print(f"ioattn {command}: error: {message}", file=sys.stderr)
    return 2


KV_CACHE_DTYPE_CHOICES = ("auto", "fp8_e4m3", "fp8_e5m2")


def kv_cache_scales(text: str) -> float | str:
    """argparse type of --kv-cache-scales: a number (every layer and head), or 'checkpoint' / 'calibrate' / a JSON
    file path (passed on as text; the engine checks it)."""
    try:
        return float(text)
    except ValueError:
        return text


def add_kv_cache_flags(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype and --kv-cache-scales, as every engine-building command takes them."""
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                        help="the KV cache's element type: auto (the model's dtype) or an fp8 format (one byte per "
                        "element: the pool holds twice the tokens of a 16-bit cache)")
    parser.add_argument("--kv-cache-scales", type=kv_cache_scales, default=None, metavar="SCALES",
                        help="fp8 only: 'checkpoint', 'calibrate' (a short pass at start-up; the cache then holds "
                        "K and V rotated, which rounds them with less loss), a number for every layer and head (1.0 "
                        "warns: uncalibrated) or a JSON file {k_scale, v_scale[, rotation]}; default: the "
                        "checkpoint's, else calibrated")
