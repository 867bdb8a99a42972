"""Chained content hash of full KV blocks, the identity under which prefix caching finds a block.

Decisions:

- **Which hash.** BLAKE2b with a 32-byte digest (`hashlib`, C speed, ~0.5 µs per 16-token block). Python's
  `hash()` is salted per process for str and only 64 bits wide; a cryptographic digest is stable across
  processes and machines (a CPU offload tier or another engine may share the cache later) and collision
  resistant, so a parent link of 256 bits is as good as the parent's full content.
- **What is hashed.** A canonical byte encoding of (parent digest, the block's token ids, extra_key): the
  parent digest is always 32 bytes (`ROOT`, all zeros, for the first block), then the token count as 4
  little-endian bytes, the token ids as little-endian int64, then the length-prefixed `repr` of extra_key.
  Fixed widths and length prefixes make the encoding prefix-free: two different triples never give the same
  bytes. Chaining through the parent digest makes a block's identity depend on every token before it, which
  is what attention needs (the same 16 tokens after a different prefix have different keys and values).
- **Token ids compared on a hit.** The prefix cache is a dict keyed by `BlockKey` = (parent digest, token ids,
  extra_key) itself, not by the digest alone, so a lookup compares the block's token ids and extra_key
  exactly; only the parent link rests on the digest.
- **extra_key** separates caches that must not share KV although the tokens agree (a LoRA adapter, a
  multimodal input's hash, a per-tenant cache salt). It must have a stable `repr`: None, bool, int, str,
  bytes, or tuples of these.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Hashable, Sequence

DIGEST_SIZE = 32
ROOT = bytes(DIGEST_SIZE)

# (parent digest, the block's token ids, extra_key): the exact identity of one full block's content.
BlockKey = tuple[bytes, tuple[int, ...], Hashable]

_EXTRA_KEY_TYPES = (bool, int, str, bytes)


def check_extra_key(extra_key: object) -> None:
    """Raise ValueError unless extra_key has a stable, canonical repr."""
    if extra_key is None or isinstance(extra_key, _EXTRA_KEY_TYPES):
        return
    if isinstance(extra_key, tuple):
        for item in extra_key:
            check_extra_key(item)
        return
    raise ValueError(
        f"extra_key must be None, bool, int, str, bytes or a tuple of these (a stable repr), "
        f"got {type(extra_key).__name__}"
    )


def block_digest(key: BlockKey) -> bytes:
    """The 32-byte chained digest of one full block; the parent digest of the next block."""
    parent, token_ids, extra_key = key
    tokens = array("q", token_ids)
    if sys.byteorder != "little":
        tokens.byteswap()
    extra = b"" if extra_key is None else repr(extra_key).encode()
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(tokens.tobytes())
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    return h.digest()


def block_key(parent: bytes, token_ids: Sequence[int], extra_key: Hashable) -> BlockKey:
    return (parent, tuple(token_ids), extra_key)
