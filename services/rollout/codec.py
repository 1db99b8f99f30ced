"""Text <-> tokens for the rollout's per-group work, on the Rust tokenizer where that is what
transformers would call anyway.

On a transformers fast tokenizer, `tokenizer.encode(text)` and `tokenizer.decode(ids)` end in
`backend_tokenizer.encode` / `.decode` after Python of their own (argument normalisation,
`to_py_obj` walking every id, a BatchEncoding). Measured on the bench's tiny Qwen2 tokenizer
(transformers 5.23, CPU time, 2026-11-26): an encode of a short prompt 38.6 µs against 9.8
direct, a 16-token decode 7.1 µs against 2.3. A group of n = 8 needs one encode and n decodes:
95 against 28 CPU-µs, 11 % of the rollout's per-group cost on `bench control_plane` (B = 32),
which is why this module exists (the project's rule: an optimisation stays when it cuts at
least 5 % of a per-group cost). `Codec` calls the backend only when that gives the same answer
(a fast tokenizer whose encode and decode transformers does not override, no clean-up of
tokenization spaces, no truncation or padding left on the backend); transformers otherwise.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


class Codec:
    """Encode and decode as `tokenizer` does (no special tokens added, special tokens skipped
    when decoding)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_token_id: int | None = tokenizer.eos_token_id
        """Read once: a transformers property costs ~5 µs a read."""
        cls = type(tokenizer)
        plain = (
            isinstance(tokenizer, PreTrainedTokenizerFast)
            and cls.encode is PreTrainedTokenizerBase.encode
            and cls._encode_plus is PreTrainedTokenizerFast._encode_plus
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode
        )
        self._backend = tokenizer.backend_tokenizer if plain else None
        self._decode_direct = plain and not tokenizer.clean_up_tokenization_spaces

    def encode(self, text: str) -> list[int]:
        backend = self._backend
        if (  # a workflow's tokenizer call may have left truncation or padding on it
            backend is None
            or backend.truncation is not None
            or backend.padding is not None
            or backend.encode_special_tokens != self.tokenizer.split_special_tokens
        ):
            return self.tokenizer.encode(text, add_special_tokens=False)
        return backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self._decode_direct:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)
