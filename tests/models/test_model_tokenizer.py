"""Byte-level tokenizer round trips, and streaming detokenization across split characters."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_checkpoints import write_word_tokenizer
from ioattn.models.tokenizer import REPLACEMENT_CHAR, ByteTokenizer, HFTokenizer, IncrementalDetokenizer

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
