"""Tokenizers with one small interface: `encode`, `decode`, `bos_token_id`, `eos_token_ids`, `vocab_size`.

`ByteTokenizer` is the built-in one (UTF-8 bytes are the ids, plus BOS/EOS), so the `tiny` model needs no files;
`HFTokenizer` wraps a checkpoint's `tokenizer.json` through the `tokenizers` package. `IncrementalDetokenizer`
turns a growing list of ids into text pieces for streaming and stop strings, for either of them: a character
whose bytes are split across tokens is emitted once all of its bytes have arrived.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; BOS and EOS follow. Every string round-trips."""

    NUM_BYTES = 256

    def __init__(self):
        self.bos_token_id = self.NUM_BYTES
        self.eos_token_ids = (self.NUM_BYTES + 1,)
        self.vocab_size = self.NUM_BYTES + 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Bytes -> text; an incomplete or invalid UTF-8 sequence decodes to U+FFFD instead of raising. Ids past
        the byte range (BOS/EOS, or any id a larger-vocabulary model such as `llama3-8b-shape` samples) are
        dropped, or shown as U+FFFD when `skip_special_tokens` is False."""
        out, pending = [], bytearray()
        for token in ids:
            if 0 <= token < self.NUM_BYTES:
                pending.append(token)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special_tokens:
                out.append(REPLACEMENT_CHAR)
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A checkpoint's `tokenizer.json` (BOS is added by its own post-processor, as in transformers)."""

    def __init__(self, path: str | os.PathLike, bos_token_id: int | None = None, eos_token_ids: Sequence[int] = ()):
        from tokenizers import Tokenizer

        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self._tokenizer = Tokenizer.from_file(str(path))
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Feed generated ids one at a time; get back the text they complete.

    Decoding token by token is wrong for byte-level vocabularies (a character split across tokens) and for
    tokenizers whose decoders look at neighbours (SentencePiece's leading-space rule), so each step decodes a
    short window of recent ids and emits what it adds to the text decoded without the new ones. Text ending in
    U+FFFD is held back until the next token completes the character; `flush` releases what is left.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        # ids[prefix:read] were decoded and emitted already; they are re-decoded only as context for the rest.
        self.read = len(self.ids)
        self.prefix = max(0, self.read - 6)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        known = decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids[self.prefix :], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(known) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(known) :]
