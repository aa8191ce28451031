"""Typed dataset records and the checks that turn raw rows into them.

A row from any source (JSONL line, Parquet row, ``datasets`` example, built-in task) becomes one of:

* ``PromptRecord``     -- an RL prompt plus every extra column (``answer``, ...), which the rollout
                          passes to reward functions as ``**fields``;
* ``SFTRecord``        -- a prompt and the completion to imitate;
* ``PreferenceRecord`` -- a prompt with a chosen and a rejected completion (DPO and friends).

A prompt or completion is either plain text or a list of chat messages (``{"role", "content"}``).
Checks raise ``tether.errors.DataError`` with a one-line message that starts with ``where`` (the
caller's "file:line" or "file:row N"), so the user can go straight to the bad row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tether.errors import DataError

Message = dict[str, Any]
Text = str | list[Message]  # plain text, or chat messages

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(slots=True)
class PromptRecord:
    prompt: Text
    fields: dict[str, Any] = field(default_factory=dict)  # every extra column, e.g. ``answer``
    index: int = 0  # position in the loaded dataset (0-based)
    where: str = field(default="", compare=False)  # where the row was read ("file.jsonl:4"), for errors

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass(slots=True)
class SFTRecord:
    """``completion=None`` means a plain ``text`` row: the loss covers every token of ``prompt``."""

    prompt: Text
    completion: Text | None
    index: int = 0
    where: str = field(default="", compare=False)  # where the row was read ("file.jsonl:4"), for errors

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass(slots=True)
class PreferenceRecord:
    prompt: Text
    chosen: Text
    rejected: Text
    index: int = 0

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list)


def type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def check_messages(value: list[Any], where: str, name: str) -> list[Message]:
    """Validate a chat message list; returns copies with ``None``-valued keys dropped.

    ``None`` values appear when a Parquet/Arrow struct column has optional keys (``tool_calls``)
    that most rows leave empty; they are not part of the message.
    """
    if not value:
        raise DataError(f"{where}: field '{name}' is an empty list of chat messages")
    messages: list[Message] = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise DataError(
                f"{where}: field '{name}' message {i} must be an object, got {type_name(message)}"
            )
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise DataError(
                f"{where}: field '{name}' message {i} has role {role!r}; "
                f"expected one of {', '.join(CHAT_ROLES)}"
            )
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            content = ""  # OpenAI's form of a turn that only calls tools; the templates render it so
        if not isinstance(content, str):
            got = "missing" if "content" not in message else type_name(content)
            raise DataError(f"{where}: field '{name}' message {i} content must be a string, got {got}")
        _check_encodable(content, where, f"field '{name}' message {i} content")
        messages.append({**{k: v for k, v in message.items() if v is not None}, "content": content})
    return messages


def _check_encodable(text: str, where: str, what: str) -> None:
    """A string a tokenizer can take: JSON's ``"\ud800"`` escape loads as a lone surrogate, which
    no UTF-8 tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise DataError(f"{where}: {what} holds an unpaired surrogate at character {error.start}") from None


def check_text(value: Any, where: str, name: str, *, allow_empty: bool = False) -> Text:
    """A non-empty string (or an empty one, ``allow_empty``) or a valid chat message list."""
    if isinstance(value, str):
        if not value and not allow_empty:
            raise DataError(f"{where}: field '{name}' is an empty string")
        _check_encodable(value, where, f"field '{name}'")
        return value
    if isinstance(value, list):
        return check_messages(value, where, name)
    raise DataError(
        f"{where}: field '{name}' must be a string or a list of chat messages, got {type_name(value)}"
    )


def check_reply(value: Any, prompt: Text, where: str, name: str) -> Text:
    """A completion (``completion``, ``chosen``, ``rejected``) that matches the prompt's kind.

    A string reply to a chat prompt becomes one assistant message; a chat reply must end with an
    assistant message, and a plain-text prompt cannot take a chat reply.
    """
    reply = check_text(value, where, name)
    if isinstance(prompt, list) and isinstance(reply, str):
        return [{"role": "assistant", "content": reply}]
    if isinstance(reply, list):
        if isinstance(prompt, str):
            raise DataError(f"{where}: field '{name}' is a list of chat messages but 'prompt' is a string")
        if reply[-1]["role"] != "assistant":
            raise DataError(
                f"{where}: field '{name}' must end with an assistant message, got role '{reply[-1]['role']}'"
            )
    return reply


def check_sft_reply(messages: Text, where: str, name: str) -> None:
    """An SFT target's last (assistant) message has text to learn: an empty one would train only the
    turn's end, as an empty string ``completion`` is refused. A turn that only calls tools (no text,
    ``tool_calls``) has its calls to learn. (A preference pair's rejected answer may be empty: a bad
    answer is what it shows.)"""
    if isinstance(messages, list) and not messages[-1]["content"] and not messages[-1].get("tool_calls"):
        raise DataError(f"{where}: field '{name}' ends with an empty assistant message")


def split_conversation(messages: list[Message], where: str, name: str) -> tuple[list[Message], list[Message]]:
    """Split a conversation into (prompt, [last assistant message]).

    Everything before the last message is the prompt; the last message must be the assistant's,
    otherwise trailing turns would be silently dropped from training.
    """
    if messages[-1]["role"] != "assistant":
        raise DataError(
            f"{where}: field '{name}' must end with an assistant message, got role '{messages[-1]['role']}'"
        )
    if len(messages) < 2:
        raise DataError(f"{where}: field '{name}' needs at least one message before the assistant reply")
    return messages[:-1], messages[-1:]
