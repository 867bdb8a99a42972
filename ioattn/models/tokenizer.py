"""Tokenizers with one small interface: `encode`, `decode`, `bos_token_id`, `eos_token_ids`, `vocab_size`.

`ByteTokenizer` is the built-in one (UTF-8 bytes are the ids, plus BOS/EOS), so the `tiny` model needs no files;
`HFTokenizer` wraps a checkpoint's `tokenizer.json`, or a tokenizer built from a GGUF file's vocabulary, through
the `tokenizers` package. `incremental_detokenizer` turns a growing list of ids into text pieces for streaming
and stop strings, for either of them: a character whose bytes are split across tokens is emitted once all of its
bytes have arrived. It runs once per generated token of every sequence, so its cost is O(1) per token:
`ByteDetokenizer` feeds bytes to an incremental UTF-8 decoder; `IncrementalDetokenizer` (any tokenizer)
re-decodes only a short window of recent ids.
"""

from __future__ import annotations

import codecs
import copy
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
    """A `tokenizers.Tokenizer`: a checkpoint's `tokenizer.json` (a path to it or to its folder), or one built in
    memory (a GGUF file's vocabulary). BOS is added by its own post-processor, as in transformers."""

    def __init__(self, source, bos_token_id: int | None = None, eos_token_ids: Sequence[int] = ()):
        from tokenizers import Tokenizer

        if isinstance(source, Tokenizer):
            self._tokenizer = source
        else:
            path = os.path.join(source, "tokenizer.json") if os.path.isdir(source) else source
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


def incremental_detokenizer(tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
    """The cheapest exact detokenizer for `tokenizer`: `push(id) -> str`, `flush() -> str`, `fork()`."""
    if isinstance(tokenizer, ByteTokenizer):
        return ByteDetokenizer(skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)


class _HeldBackText:
    """Text ending in U+FFFD may be a character whose last bytes have not arrived: hold it until the next piece
    (or the end of the stream) shows otherwise."""

    def __init__(self):
        self.held = ""

    def release(self, text: str, final: bool) -> str:
        text = self.held + text
        if text.endswith(REPLACEMENT_CHAR) and not final:
            self.held = text
            return ""
        self.held = ""
        return text


class ByteDetokenizer(_HeldBackText):
    """`ByteTokenizer`'s ids through Python's incremental UTF-8 decoder: the same text as `ByteTokenizer.decode`
    of the output ids, emitted as `IncrementalDetokenizer` would, without re-decoding anything. The prompt is not
    needed: byte-level text has no context beyond an unfinished character."""

    def __init__(self, skip_special_tokens: bool = True):
        super().__init__()
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if 0 <= token_id < ByteTokenizer.NUM_BYTES:
            return self.release(self._utf8.decode(_SINGLE_BYTES[token_id]), final=False)
        # A special id ends any unfinished character, as in `ByteTokenizer.decode`.
        text = self._utf8.decode(b"", final=True)
        return self.release(text if self.skip_special_tokens else text + REPLACEMENT_CHAR, final=False)

    def flush(self) -> str:
        return self.release(self._utf8.decode(b"", final=True), final=True)

    def fork(self) -> ByteDetokenizer:
        forked = ByteDetokenizer(self.skip_special_tokens)
        forked.held = self.held
        forked._utf8.setstate(self._utf8.getstate())
        return forked


_SINGLE_BYTES = [bytes((b,)) for b in range(ByteTokenizer.NUM_BYTES)]


class IncrementalDetokenizer:
    """Feed generated ids one at a time; get back the text they complete (any tokenizer with `decode`).

    Decoding token by token is wrong for byte-level vocabularies (a character split across tokens) and for
    tokenizers whose decoders look at neighbours (SentencePiece's leading-space rule), so each step decodes a
    short window of recent ids and emits what it adds to the text decoded without the new ones. Text ending in
    U+FFFD is held back until the next token completes the character; `flush` releases what is left.
    """

    # Prompt ids kept as context for the first output tokens' decoding.
    PROMPT_CONTEXT = 6

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only the window is kept: ids[:read] were decoded and emitted already and are re-decoded only as
        # context for the rest, so the cost per token (and per fork) does not grow with the sequence.
        self.ids = list(prompt_ids[-self.PROMPT_CONTEXT :])
        self.read = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def fork(self) -> IncrementalDetokenizer:
        forked = copy.copy(self)
        forked.ids = list(self.ids)
        return forked

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        known = decode(self.ids[: self.read], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(known) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        del self.ids[: self.read]
        self.read = len(self.ids)
        return full[len(known) :]
