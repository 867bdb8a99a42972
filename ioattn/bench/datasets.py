"""Where `ioattn bench serve` gets its requests: vLLM's `benchmark_serving` datasets, with its flag names, so that
results compare with published ones.

- `random` (default): prompts of random token ids in the byte range every vocabulary has
  (`workload.PROMPT_ID_RANGE`), sent as ids. Lengths: `--random-input-len L --random-range-ratio r` draws each
  from [int(L(1-r)), int(L(1+r))] (vLLM's rule), `--random-output-len` likewise; without them, `--input-len MIN
  MAX` / `--output-len [MIN] MAX`.
- `sharegpt`: a ShareGPT-format JSON file (`--dataset-path`: a list of {"conversations": [{"from": "human",
  "value": ...}, {"from": "gpt", "value": ...}, ...]}), sampled as vLLM does: shuffled by the seed, the first two
  turns as prompt and completion, the completion's token count as the output length (or
  `--sharegpt-output-len`), pairs with fewer than 4 tokens on either side, a prompt over 1024 or a total over 2048
  tokens skipped; with too few pairs left, some are drawn again (said in the notes).
- `sonnet-like`: vLLM's sonnet workload on generated verse (this module's own word list, not the sonnets): every
  prompt asks to pick lines from a poem, starts with the same `--sonnet-prefix-len` tokens of it (so the prefix
  cache has something to find) and is filled with random lines up to about `--sonnet-input-len` tokens;
  `--sonnet-output-len` tokens each.

Text datasets are tokenized with the model's tokenizer (`--tokenizer`, default `--model`), read without the
weights; their prompts go to a server as text (it tokenizes them itself, as for users) and to the offline systems as
the same ids.
"""

from __future__ import annotations

import argparse
import json
import random

from ioattn.bench.workload import WorkItem
from ioattn.cli_args import positive_int

DATASETS = ("random", "sharegpt", "sonnet-like")
SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048
SONNET_INSTRUCTION = "Pick as many lines as you can from these poem lines:\n"

_WORDS = (
    "amber", "autumn", "bright", "candle", "cloud", "crimson", "dawn", "distant", "dream", "ember", "evening",
    "feather", "field", "frost", "gentle", "golden", "harbor", "heart", "hollow", "hour", "ivory", "lantern",
    "light", "linger", "meadow", "memory", "mirror", "moon", "morning", "night", "ocean", "pale", "quiet", "rain",
    "river", "rose", "shadow", "silver", "slow", "song", "sorrow", "stone", "summer", "sun", "tender", "thorn",
    "tide", "time", "velvet", "whisper", "willow", "wind", "winter", "wonder", "yearning", "young",
)
_JOINERS = ("and", "of", "in", "the", "beneath", "upon", "like", "through", "where", "while")


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset (vLLM's benchmark_serving names)")
    group.add_argument("--dataset-name", default="random", choices=DATASETS)
    group.add_argument("--dataset-path", default=None, help="a ShareGPT-format JSON file (--dataset-name sharegpt)")
    group.add_argument("--tokenizer", default=None, help="whose tokenizer measures text prompts (default: --model)")
    group.add_argument("--random-input-len", type=positive_int, default=None, metavar="L")
    group.add_argument("--random-output-len", type=positive_int, default=None, metavar="L")
    group.add_argument("--random-range-ratio", type=_ratio, default=0.0, metavar="R",
                       help="random lengths uniform in [L(1-R), L(1+R)] (0 <= R < 1)")
    group.add_argument("--sharegpt-output-len", type=positive_int, default=None, help="every request's output length "
                       "(default: the conversation's own reply's)")
    group.add_argument("--sonnet-input-len", type=positive_int, default=550)
    group.add_argument("--sonnet-output-len", type=positive_int, default=150)
    group.add_argument("--sonnet-prefix-len", type=positive_int, default=200)


def check_dataset_args(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str]) -> None:
    """Flags that contradict each other or the dataset, as argparse errors; `given`: flags on the command line."""
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        parser.error("--dataset-name sharegpt needs --dataset-path (a ShareGPT-format JSON file)")
    if args.dataset_path and args.dataset_name != "sharegpt":
        parser.error("--dataset-path is read only with --dataset-name sharegpt")
    for random_flag, range_flag in (("--random-input-len", "--input-len"), ("--random-output-len", "--output-len")):
        if random_flag in given and range_flag in given:
            parser.error(f"{random_flag} and {range_flag} both set the random dataset's lengths: give one")
    if args.dataset_name == "sonnet-like" and args.sonnet_prefix_len >= args.sonnet_input_len:
        parser.error("--sonnet-prefix-len must be below --sonnet-input-len")


def build_workload(args: argparse.Namespace) -> tuple[list[WorkItem], list[str]]:
    """The requests `args` describe, and notes on how they were drawn."""
    if args.dataset_name == "random":
        return random_workload(args), []
    from ioattn.models.loader import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or args.model)
    if args.dataset_name == "sharegpt":
        return sharegpt_workload(args.dataset_path, args.num_requests, tokenizer, args.seed, args.sharegpt_output_len)
    return sonnet_like_workload(args.num_requests, args.sonnet_input_len, args.sonnet_prefix_len,
                                args.sonnet_output_len, tokenizer, args.seed), []


def length_range(length: int | None, ratio: float, fallback: tuple[int, int]) -> tuple[int, int]:
    if length is None:
        return fallback
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))


def random_workload(args: argparse.Namespace) -> list[WorkItem]:
    from ioattn.bench.workload import make_workload

    inputs = length_range(args.random_input_len, args.random_range_ratio, tuple(args.input_len))
    outputs = length_range(args.random_output_len, args.random_range_ratio, tuple(args.output_len))
    return make_workload(args.num_requests, inputs, outputs, args.seed)


def sharegpt_workload(path: str, num_requests: int, tokenizer, seed: int,
                      output_len: int | None = None) -> tuple[list[WorkItem], list[str]]:
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: a ShareGPT file holds a JSON list of conversations, got {type(entries).__name__}")
    pairs = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2]):
            prompt, reply = turns[0].get("value"), turns[1].get("value")
            if isinstance(prompt, str) and isinstance(reply, str):
                pairs.append((prompt, reply))
    random.Random(seed).shuffle(pairs)
    work = []
    for prompt, reply in pairs:
        if len(work) == num_requests:
            break
        ids = tokenizer.encode(prompt)
        length = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if (len(ids) < SHAREGPT_MIN_TOKENS or (output_len is None and length < SHAREGPT_MIN_TOKENS)
                or len(ids) > SHAREGPT_MAX_PROMPT or len(ids) + length > SHAREGPT_MAX_TOTAL):
            continue
        work.append(WorkItem(ids, length, prompt))
    if not work:
        raise ValueError(f"{path}: no conversation passes ShareGPT's filters (two turns, >= {SHAREGPT_MIN_TOKENS} "
                         f"tokens each, prompt <= {SHAREGPT_MAX_PROMPT}, total <= {SHAREGPT_MAX_TOTAL})")
    notes = []
    if len(work) < num_requests:
        notes.append(f"{path}: {len(work)} conversations pass the filters, {num_requests} requested: "
                     f"{num_requests - len(work)} drawn again at random (vLLM's oversampling)")
        rng = random.Random(seed + 1)
        work += [rng.choice(work) for _ in range(num_requests - len(work))]
    return work, notes


def poem_lines(count: int, seed: int) -> list[str]:
    """`count` lines of generated verse (5 to 9 words), the same for a seed."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        words = [rng.choice(_WORDS) if i % 2 == 0 else rng.choice(_JOINERS) for i in range(rng.randint(5, 9))]
        lines.append(" ".join(words).capitalize() + rng.choice((",", ".", ";", "")) + "\n")
    return lines


def sonnet_like_workload(num_requests: int, input_len: int, prefix_len: int, output_len: int, tokenizer,
                         seed: int) -> list[WorkItem]:
    """Every prompt: the instruction, the shared first lines (about `prefix_len` tokens), then lines drawn for it
    until about `input_len` tokens."""
    def tokens(text: str) -> int:
        return len(tokenizer.encode(text))

    shared, poem = SONNET_INSTRUCTION, poem_lines(64, seed)
    for line in poem:
        if tokens(shared + line) > prefix_len:
            break
        shared += line
    rng = random.Random(seed + 1)
    work = []
    for _ in range(num_requests):
        prompt = shared
        while True:
            line = rng.choice(poem)
            if tokens(prompt + line) > input_len:
                break
            prompt += line
        work.append(WorkItem(tokenizer.encode(prompt), output_len, prompt))
    return work


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value
