"""A character-level tokenizer built in-process (no downloads) for the data tests."""

from __future__ import annotations

import string

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Minimal chat format: every turn is closed by <eos> then a newline, as many real templates do.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_test_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character; <pad>=0, <bos>=1, <eos>=2, <unk>=3."""
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in string.printable:
        vocab.setdefault(char, len(vocab))
    # BPE without merges over the whole string = one token per character.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def char_tokenizer() -> PreTrainedTokenizerFast:
    return build_test_char_tokenizer()
