"""Tokenizers: load a checkpoint's tokenizer, encode prompts, and build a character-level tokenizer.

The character tokenizer is for tests, examples and toy tasks that cannot download anything: every
printable ASCII character and ``\\n`` is one token, so decoding returns the text exactly. It is an
ordinary ``tokenizer.json`` + ``tokenizer_config.json`` pair that ``AutoTokenizer`` loads.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from tether.errors import LFS_POINTER_REASON, CheckpointError, is_lfs_pointer, unreadable_reason

if TYPE_CHECKING:  # transformers is imported where it is used: ~1 s that most imports of tether skip
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3
DEFAULT_ALPHABET = "".join(ch for ch in string.printable if ch.isprintable() or ch == "\n")
# One line per message, then the assistant's turn; every character is in the default alphabet.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def build_char_tokenizer(alphabet: str | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then one
    token per character of ``alphabet`` (default: printable ASCII and ``\\n``, 100 tokens in all)."""
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(DEFAULT_ALPHABET if alphabet is None else alphabet))
    # Each character's token is its GPT-2 byte-level spelling (" " is "Ġ", "\n" is "Ċ"): transformers 5's
    # AutoTokenizer loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer whatever tokenizer_config.json
    # says, rebuilt as byte-level BPE over this vocabulary; with plain spellings it dropped every space
    # and newline of the text it encoded.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    spelled = [byte_level.pre_tokenize_str(char)[0][0] for char in chars]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *spelled])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # "[\s\S]" (any character, newline included) splits every character into its own word (one
    # <unk> for a character outside the alphabet), then spelled byte-level; decoding spells it back.
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),
                                                     byte_level])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    # ``tokenizer(text)`` (transformers' generate, vLLM) gives ``<bos> + text``, the ids tether prompts
    # with (``data.tokenize.encode_prompt``); tether itself encodes with add_special_tokens=False.
    backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B:1",
                                                           special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,  # would rewrite " ." as "." and break the round trip
        model_max_length=1 << 30,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# Files from which transformers can build a tokenizer (fast, sentencepiece, BPE, WordPiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer.tiktoken",
                   "spiece.model")


# ``tokenizer_class`` values that mean "exactly the pipeline in tokenizer.json" (transformers 5, 4).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(path)`` from local files only, errors as ``CheckpointError``.

    A tokenizer saved as the generic class (``tokenizer_class`` ``TokenizersBackend`` or
    ``PreTrainedTokenizerFast``: the character tokenizer, any ``tokenizer.json`` saved as is) loads as
    that class: ``AutoTokenizer`` in transformers 5 picks a class from the model's ``model_type``
    instead, and ``Qwen2Tokenizer`` rebuilt the character tokenizer's pipeline so that it dropped
    spaces, newlines and non-ASCII characters from every prompt."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"tokenizer directory {directory} does not exist")
    # Without these, AutoTokenizer builds an empty tokenizer from config.json alone (vocabulary of 1).
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{directory}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        _check_json(directory / name)  # a broken one named, not "cannot load tokenizer (Expecting value...)"
    loader = PreTrainedTokenizerFast if _saved_class(directory) in GENERIC_TOKENIZER_CLASSES else AutoTokenizer
    try:
        return loader.from_pretrained(str(directory), local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError, ... here
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{directory}: cannot load tokenizer ({reason})") from None


def _check_json(file: Path) -> None:
    """A tokenizer's JSON file, if there, must parse: else a one-line error naming it and where."""
    if not file.is_file():
        return
    try:
        json.loads(file.read_bytes())
    except json.JSONDecodeError as error:
        reason = (LFS_POINTER_REASON if is_lfs_pointer(file)
                  else f"not valid JSON at line {error.lineno} column {error.colno}: {error.msg}")
        raise CheckpointError(f"{file}: {reason}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{file}: not a readable JSON file ({unreadable_reason(file, error)})") from None


def check_tokenizer_fits(tokenizer: PreTrainedTokenizerBase, vocab_size: int, where: str | Path) -> None:
    """The tokenizer's ids (added tokens included) must index the model's embedding: one that makes
    an id past ``vocab_size`` would fail deep in a forward, or in the engine, prompt by prompt."""
    num_tokens = len(tokenizer)
    if num_tokens > vocab_size:
        raise CheckpointError(f"{where}: the tokenizer has {num_tokens} tokens but config.json's vocab_size is "
                              f"{vocab_size}: ids {vocab_size}-{num_tokens - 1} have no embedding")


def _saved_class(directory: Path) -> str | None:
    """``tokenizer_class`` of the directory's tokenizer_config.json, or None (absent, unreadable)."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None
