"""The released FoX checkpoints' tokenizer for transformers (their tokenizer_config.json's `JSONGPT2Tokenizer`):
GPT-2's byte-level BPE over text JSON-escaped first, and decoded text unescaped after, as LongCrawl64 was
tokenized. The escaping is runtime/text/tokenizer.py's, which the torch-free runtime applies the same way.
"""

from __future__ import annotations

from transformers import GPT2Tokenizer, PretrainedConfig

from runtime.text.tokenizer import json_escape, json_unescape


class JSONGPT2Tokenizer(GPT2Tokenizer):
    def prepare_for_tokenization(self, text: str, is_split_into_words: bool = False, **kwargs):
        text, kwargs = super().prepare_for_tokenization(text, is_split_into_words, **kwargs)
        return json_escape(text), kwargs

    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs) -> str:
        text = super().decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs)
        return json_unescape(text)


class JSONGPT2TokenizerKey(PretrainedConfig):
    """What AutoTokenizer files the class under: it finds a tokenizer_config.json's tokenizer_class by name among the
    classes registered to any configuration, and FoX models' own may use other tokenizers."""
