"""Text <-> tokens for the rollout's per-group work, on the Rust tokenizer where that is what
transformers would call anyway.

`tokenizer(text).input_ids` and `tokenizer.decode(ids)` on a transformers fast tokenizer end in
`backend_tokenizer.encode` / `.decode` after Python of their own (argument normalisation,
`to_py_obj` walking every id, a BatchEncoding): measured on the tiny Qwen2 tokenizer, an encode
costs 16 µs against 5 direct, a 16-token decode 3.6 µs against 1.3. A group needs one encode
and n decodes. `Codec` calls the backend directly when that gives the same answer (a fast
tokenizer whose encode and decode transformers does not override, no clean-up of tokenization
spaces, no truncation or padding left on the backend) and transformers otherwise.
(`decode_batch` is no cheaper: for a group's few short samples its thread pool costs more CPU
than it saves.)
"""

from __future__ import annotations

from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend as _Fast


class Codec:
    """Encode and decode as `tokenizer` does (no special tokens added, special tokens skipped
    when decoding)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id: int | None = tokenizer.eos_token_id
        cls = type(tokenizer)
        plain = (
            isinstance(tokenizer, _Fast)
            and cls.__call__ is PreTrainedTokenizerBase.__call__
            and cls._encode_plus is _Fast._encode_plus
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is _Fast._decode
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
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)
        return backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self._decode_direct:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)
