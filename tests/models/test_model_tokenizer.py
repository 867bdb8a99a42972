"""Byte-level tokenizer round trips, and streaming detokenization across split characters."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_checkpoints import write_word_tokenizer
from ioattn.models.tokenizer import (
    REPLACEMENT_CHAR,
    ByteDetokenizer,
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    incremental_detokenizer,
)

TOKENIZER = ByteTokenizer()


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_unicode(text):
    ids = TOKENIZER.encode(text)
    assert ids[0] == TOKENIZER.bos_token_id
    assert all(0 <= i < TOKENIZER.vocab_size for i in ids)
    assert TOKENIZER.decode(ids) == text
    assert TOKENIZER.decode(TOKENIZER.encode(text, add_special_tokens=False) + list(TOKENIZER.eos_token_ids)) == text


@settings(max_examples=60, deadline=None)
@given(st.text(), st.text())
def test_streaming_emits_whole_characters_and_the_exact_text(prompt, completion):
    detok = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode(prompt))
    pieces = [detok.push(i) for i in TOKENIZER.encode(completion, add_special_tokens=False)]
    pieces.append(detok.flush())
    assert "".join(pieces) == completion
    if REPLACEMENT_CHAR not in completion:  # no piece ever shows half a character
        assert all(REPLACEMENT_CHAR not in p for p in pieces)


def test_split_multibyte_character_decodes_without_error():
    euro = list("€".encode())  # three bytes
    assert TOKENIZER.decode(euro[:2]) == REPLACEMENT_CHAR
    detok = IncrementalDetokenizer(TOKENIZER)
    assert [detok.push(b) for b in euro] == ["", "", "€"]
    # An invalid byte is shown as U+FFFD once the stream ends; ids past the byte range never raise.
    assert detok.push(0xFF) == "" and detok.flush() == REPLACEMENT_CHAR
    assert TOKENIZER.decode([104, 105, 300, 257]) == "hi"
    assert TOKENIZER.decode([104, 300], skip_special_tokens=False) == "h" + REPLACEMENT_CHAR


def test_streaming_with_a_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers")
    write_word_tokenizer(tmp_path, 40)
    tokenizer = HFTokenizer(tmp_path, bos_token_id=1, eos_token_ids=[2])
    prompt = tokenizer.encode("w3 w4")
    completion = tokenizer.encode("w10 w11 w12", add_special_tokens=False) + [2]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detok.push(i) for i in completion) + detok.flush()
    assert tokenizer.decode(prompt + completion) == "w3 w4 w10 w11 w12"
    assert text == " w10 w11 w12"


# Byte ids, a few multibyte characters' bytes (so characters do complete), BOS/EOS and an id past the byte range.
STREAM_IDS = st.lists(st.one_of(st.integers(0, 257), st.sampled_from([*"é€😀".encode(), 300])), max_size=24)


@settings(max_examples=150, deadline=None)
@given(st.text(), STREAM_IDS, st.booleans(), st.integers(0, 24))
def test_byte_fast_path_streams_exactly_like_the_window_detokenizer(prompt, ids, skip_special_tokens, fork_at):
    """Same pieces at the same steps (a fork mid-stream included), and the pieces add up to `decode`."""
    window = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode(prompt), skip_special_tokens)
    fast = incremental_detokenizer(TOKENIZER, TOKENIZER.encode(prompt), skip_special_tokens)
    assert isinstance(fast, ByteDetokenizer)
    streams = [[], []]
    for step, token in enumerate(ids):
        if step == fork_at:
            window, fast = window.fork(), fast.fork()
        streams[0].append(window.push(token))
        streams[1].append(fast.push(token))
    streams[0].append(window.flush())
    streams[1].append(fast.flush())
    assert streams[0] == streams[1]
    assert "".join(streams[1]) == TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)


def test_window_detokenizer_keeps_only_a_short_window(tmp_path):
    """Any tokenizer: O(1) ids kept however long the prompt and output, and the text of a full decode."""
    pytest.importorskip("tokenizers")
    write_word_tokenizer(tmp_path, 40)
    tokenizer = HFTokenizer(tmp_path, bos_token_id=1, eos_token_ids=[2])
    prompt = tokenizer.encode(" ".join(f"w{3 + i % 37}" for i in range(500)))
    outputs = [3 + (7 * i) % 37 for i in range(300)] + [2]
    detok = incremental_detokenizer(tokenizer, prompt)
    pieces = []
    for token in outputs:
        pieces.append(detok.push(token))
        assert len(detok.ids) <= IncrementalDetokenizer.PROMPT_CONTEXT + 1
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(prompt + outputs)[len(tokenizer.decode(prompt)) :]
