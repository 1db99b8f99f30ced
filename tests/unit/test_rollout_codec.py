"""The rollout's Codec answers as the transformers tokenizer does, on the Rust tokenizer
directly only where that is the same."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from asyncrl.tiny import build_char_tokenizer
from services.rollout.codec import Codec

TEXTS = ["1+1=", "", "  spaced  out ", "a . b , c !", "<eos>x"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("char")
    build_char_tokenizer(out)
    return out


def test_codec_encode_decode_on_the_backend_match_transformers(tok_dir):
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    codec = Codec(tok)
    assert codec._backend is not None and codec._decode_direct  # the direct path is tested
    for text in TEXTS:
        assert codec.encode(text) == tok(text, add_special_tokens=False).input_ids
    eos, pad = tok.eos_token_id, tok.pad_token_id
    for ids in ([], [10, 11, eos], [pad, 20, eos, eos], tok("a . b")["input_ids"]):
        assert codec.decode(ids) == tok.decode(ids, skip_special_tokens=True)
    assert codec.eos_token_id == eos


def test_codec_encode_after_a_truncating_call_is_not_truncated(tok_dir):
    """A workflow's `ctx.tokenizer(..., truncation=True)` leaves truncation on the backend;
    transformers switches it off for the next plain call, and so must the codec."""
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    codec = Codec(tok)
    assert len(tok("abcdefgh", truncation=True, max_length=3).input_ids) == 3
    assert tok.backend_tokenizer.truncation is not None
    assert codec.encode("abcdefgh") == tok("abcdefgh", add_special_tokens=False).input_ids
    assert len(codec.encode("abcdefgh")) == 8


def test_codec_decode_with_clean_up_of_spaces_is_transformers(tok_dir):
    tok = AutoTokenizer.from_pretrained(str(tok_dir), clean_up_tokenization_spaces=True)
    codec = Codec(tok)
    ids = tok("a . b , c", add_special_tokens=False).input_ids
    assert tok.backend_tokenizer.decode(ids) == "a . b , c"  # what the backend alone gives
    assert codec.decode(ids) == tok.decode(ids, skip_special_tokens=True) == "a. b, c"
