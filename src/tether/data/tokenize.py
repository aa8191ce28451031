"""Records -> token ids, with the loss mask that says which tokens the model is trained to produce.

Prompt convention (``tokenize_prompt``; the rollout engine and SFT share it, so a policy sees at
generation exactly the prefix it was trained on):

* plain text: ``[bos] + encode(prompt)`` (bos only if the tokenizer has one);
* chat: ``encode(apply_chat_template(messages, add_generation_prompt=True))``; the template
  decides about bos. Text is encoded with ``add_special_tokens=False`` so bos is never doubled.

SFT example (``tokenize_sft``): ``prompt_ids + completion_ids`` where

* plain text: ``completion_ids = encode(completion) + [eos]`` (no second eos when the completion
  already ends with it), where ``encode(completion)`` means
  its tokens as they follow the prompt (``_continuation_ids``: the prompt and the completion
  encoded together, cut after the prompt's tokens, so no word-start space is invented);
* chat: the conversation with the reply is rendered by the template; its text must start with the
  prompt's text (true of every sane template), and the rest is the reply. If the reply's tokens
  contain eos (templates close a turn with it, often followed by a newline), they are cut just
  after the last eos -- generation stops there, so later tokens are never sampled; otherwise eos
  is appended. The mask covers exactly these reply tokens.
* ``completion=None`` (a ``text`` row): every token after the first is a target, then eos (unless
  the text ends with it).

Mask convention: ``loss_mask[t]`` is True when token ``t`` is a *target*, predicted from the
logits at position ``t - 1``; ``loss_mask[0]`` is always False.

Length: a prompt of ``max_len`` tokens or more raises ``DataError`` (nothing left to learn);
otherwise the completion is cut on the right to fit ``max_len``. A cut completion loses its eos,
on purpose: the model must not learn to stop at an arbitrary truncation point.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from tether.data.records import PreferenceRecord, SFTRecord, Text
from tether.errors import CheckpointError, DataError, one_line


class Tokenizer(Protocol):
    """The slice of the Hugging Face tokenizer API this module relies on."""

    eos_token_id: int | None
    bos_token_id: int | None
    pad_token_id: int | None
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...


class HasPrompt(Protocol):
    prompt: Text


@dataclass(slots=True)
class SFTExample:
    input_ids: list[int]  # [T]
    loss_mask: list[bool]  # [T]; loss_mask[t]: token t is a target predicted from position t-1
    index: int = 0  # the record's index, to trace an example back to its row
    is_cut: bool = False  # tokens past ``max_len`` were dropped (the completion's end and its eos)

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(f"input_ids has {len(self.input_ids)} tokens, loss_mask {len(self.loss_mask)}")
        if not self.input_ids:
            raise ValueError("an example needs at least one token")
        if self.loss_mask[0]:
            raise ValueError("loss_mask[0] must be False: the first token has no preceding position")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def tokenize_prompt(record: HasPrompt, tokenizer: Tokenizer) -> list[int]:
    """Prompt token ids, ending where generation (or the completion) starts (``encode_prompt``)."""
    return encode_prompt(tokenizer, record.prompt)


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict[str, Any]]) -> list[int]:
    """Token ids for a prompt, the one definition the engine's prompts and training's share.

    Chat messages go through the tokenizer's chat template with ``add_generation_prompt=True``; the
    rendered text already holds any special tokens, so it is encoded without adding more. Plain text is
    encoded without special tokens and prefixed with bos when the tokenizer has one. A template that
    refuses the conversation, or a tokenizer without one, is a one-line ``DataError``.
    """
    if isinstance(prompt, str):
        bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        return bos + _encode(tokenizer, prompt)
    return _encode(tokenizer, _render_chat(tokenizer, prompt, add_generation_prompt=True))


def _where(record: SFTRecord) -> str:
    """Where a record was read (``file.jsonl:4``), else its 0-based index in its dataset."""
    return record.where or f"example {record.index}"


def tokenize_sft(record: SFTRecord, tokenizer: Tokenizer, max_len: int,
                 limit: str = "data.max_seq_len") -> SFTExample:
    """Token ids and loss mask for one SFT record; see the module docstring for the conventions.
    ``limit`` names what sets ``max_len`` in the error for a prompt that leaves no room."""
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    eos = _eos_id(tokenizer)
    if record.completion is None:
        if not isinstance(record.prompt, str):
            raise DataError(f"{_where(record)}: a record without completion must be plain text")
        full = _with_eos(tokenize_prompt(record, tokenizer), eos)
        ids = full[:max_len]
        return SFTExample(ids, [False] + [True] * (len(ids) - 1), record.index, is_cut=len(full) > max_len)
    try:
        prompt_ids = tokenize_prompt(record, tokenizer)
        completion_ids = _completion_ids(record, tokenizer, eos, prompt_ids)
    except DataError as error:  # the chat template's own errors: name the row
        raise DataError(f"{_where(record)}: {error}") from None
    if len(prompt_ids) >= max_len:
        raise DataError(
            f"{_where(record)}: prompt is {len(prompt_ids)} tokens, "
            f"leaving no room for the completion within max_len={max_len} ({limit})"
        )
    is_cut = len(prompt_ids) + len(completion_ids) > max_len
    completion_ids = completion_ids[: max_len - len(prompt_ids)]
    loss_mask = [False] * len(prompt_ids) + [True] * len(completion_ids)
    loss_mask[0] = False  # only reachable with an empty prompt and no bos
    return SFTExample(prompt_ids + completion_ids, loss_mask, record.index, is_cut)


def tokenize_preference(
    record: PreferenceRecord, tokenizer: Tokenizer, max_len: int
) -> tuple[SFTExample, SFTExample]:
    """(chosen, rejected) examples sharing the same prompt tokens."""
    chosen = tokenize_sft(SFTRecord(record.prompt, record.chosen, record.index), tokenizer, max_len)
    rejected = tokenize_sft(SFTRecord(record.prompt, record.rejected, record.index), tokenizer, max_len)
    return chosen, rejected


def _completion_ids(record: SFTRecord, tokenizer: Tokenizer, eos: int, prompt_ids: list[int]) -> list[int]:
    """The completion's tokens (``prompt_ids``: the record's ``tokenize_prompt``)."""
    if isinstance(record.prompt, str):
        if not isinstance(record.completion, str):
            raise DataError("a plain-text prompt needs a plain-text completion")
        joint = tokenize_prompt(dataclasses.replace(record, prompt=record.prompt + record.completion), tokenizer)
        return _with_eos(_continuation_ids(tokenizer, prompt_ids, joint, record.completion), eos)
    assert record.completion is not None
    reply = record.completion
    if isinstance(reply, str):
        reply = [{"role": "assistant", "content": reply}]
    prompt_text = _render_chat(tokenizer, record.prompt, add_generation_prompt=True)
    full_text = _render_chat(tokenizer, record.prompt + reply, add_generation_prompt=False)
    if not full_text.startswith(prompt_text):
        raise DataError(
            "the chat template does not render the prompt as a prefix of the conversation, so the "
            "assistant reply cannot be located"
        )
    ids = _continuation_ids(tokenizer, prompt_ids, _encode(tokenizer, full_text), full_text[len(prompt_text) :])
    if eos in ids:
        last_eos = len(ids) - 1 - ids[::-1].index(eos)
        return ids[: last_eos + 1]
    return ids + [eos]


def _continuation_ids(tokenizer: Tokenizer, prompt_ids: list[int], joint_ids: list[int], text: str) -> list[int]:
    """The tokens of ``text`` as they follow the prompt: ``joint_ids`` (prompt + text encoded in
    one piece) cut after ``prompt_ids``, when those are a prefix of it. Encoded alone, a
    SentencePiece-style tokenizer (Llama 2, Mistral: ``Prepend("▁")``) would begin ``text`` with a
    word-start space the data does not have (``"2+2=" + "4"`` -> ``"2+2= 4"``). When the prompt's
    tokens merge with the text's across the boundary (BPE), the prompt must stay as the engine
    sees it at generation, so ``text`` is encoded alone."""
    if joint_ids[: len(prompt_ids)] == prompt_ids:
        return joint_ids[len(prompt_ids) :]
    return _encode(tokenizer, text)


def _with_eos(ids: list[int], eos: int) -> list[int]:
    """``ids`` ending with one eos: text that already ends with it (``"...</s>"``) gets no second."""
    return ids if ids and ids[-1] == eos else ids + [eos]


def _render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("chat prompts need a tokenizer with a chat template (chat_template); this tokenizer has "
                        "no chat template")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as error:  # a template's raise_exception(...) ("System role not supported"), a missing key
        if type(error).__name__ == "TemplateSyntaxError":  # jinja2's: the checkpoint's template, not the row
            line = getattr(error, "lineno", "?")
            raise CheckpointError(f"the tokenizer's chat template does not parse (line {line}: {one_line(error)}); "
                                  "fix chat_template in the checkpoint") from None
        raise DataError(f"the chat template refuses this conversation ({type(error).__name__}: {one_line(error)})"
                        ) from None
    assert isinstance(text, str)
    return text


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _eos_id(tokenizer: Tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token_id; SFT needs one to teach the model where to stop")
    return tokenizer.eos_token_id
