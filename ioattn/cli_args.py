"""What the command-line front ends share (`ioattn.cli` and the subcommands' own modules): the default model, the
argparse types, and argparse's way out for errors found after parsing."""

from __future__ import annotations

import argparse
import sys

DEFAULT_MODEL = "smollm2"
MODEL_HELP = ("a preset (smollm2: SmolLM2-135M-Instruct, the default; tiny; llama3-8b-shape), a llama GGUF file or "
              "a local Hugging Face checkpoint folder")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def fail(command: str, message: str) -> int:
    """argparse's way out: the message on stderr, exit status 2."""
    print(f"ioattn {command}: error: {message}", file=sys.stderr)
    return 2
