"""Read datasets from local files and validate every row into typed records.

Sources (never the network):

* ``*.jsonl`` -- one JSON object per line; blank lines are skipped; rows are named ``file:LINE``
  with 1-based line numbers, as an editor shows them;
* ``*.parquet`` -- rows named ``file:row N`` with the 0-based row number (``table.slice(N, 1)``);
* a directory written by ``datasets``' ``save_to_disk`` (a ``Dataset`` or a ``DatasetDict``, from
  which ``split`` is taken) -- rows named ``dir:row N`` (0-based, ``ds[N]``);
* any other local directory or dataset name, through ``datasets.load_dataset(source, split=split)``
  with ``HF_DATASETS_OFFLINE=1`` and ``HF_HUB_OFFLINE=1`` so it only reads what is on disk;
* an in-memory sequence of dicts (tests, built-in tasks), named ``<rows>:row N``.

Row formats:

* prompts: ``prompt`` (text or chat messages) plus any other columns, kept as ``fields``;
* SFT: ``prompt`` + ``completion``, or ``messages`` (the last, assistant, message is the
  completion; another column such as ``prompt`` beside it is kept out), or ``text`` (loss on all
  of it);
* preferences: ``prompt`` + ``chosen`` + ``rejected``; ``chosen`` and ``rejected`` may instead be
  full conversations that share everything but the last assistant message (a text ``prompt``
  beside them, as ultrafeedback_binarized has, is then ignored).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tether.data.records import (
    PreferenceRecord,
    PromptRecord,
    SFTRecord,
    check_reply,
    check_sft_reply,
    check_text,
    split_conversation,
    type_name,
)
from tether.errors import ConfigError, DataError, one_line

Source = str | os.PathLike[str] | Sequence[Mapping[str, Any]]
Row = tuple[str, Any]  # (where, raw row): "data/train.jsonl:17", {...}
RecordT = TypeVar("RecordT")


def load_prompts(source: Source, *, split: str = "train", limit: int | None = None,
                 allow_empty: bool = False) -> list[PromptRecord]:
    """RL prompts; every column other than ``prompt`` is kept in ``fields`` for the reward. An empty
    prompt is a ``DataError`` unless ``allow_empty`` (``tether generate``: the engine then serves it
    from the tokenizer's bos alone, or fails that request alone)."""
    return _load(source, split, limit, functools.partial(_prompt_from_row, allow_empty=allow_empty))


def load_sft(source: Source, *, split: str = "train", limit: int | None = None) -> list[SFTRecord]:
    """SFT examples from ``prompt``/``completion``, ``messages`` or ``text`` rows."""
    return _load(source, split, limit, _sft_from_row)


def load_preferences(
    source: Source, *, split: str = "train", limit: int | None = None
) -> list[PreferenceRecord]:
    """Preference pairs from ``prompt``/``chosen``/``rejected`` rows."""
    return _load(source, split, limit, _preference_from_row)


def _load(
    source: Source, split: str, limit: int | None, parse: Callable[[dict[str, Any], str, int], RecordT]
) -> list[RecordT]:
    if limit is not None and limit < 1:
        raise ConfigError(f"data limit must be >= 1 or None, got {limit}")
    records: list[RecordT] = []
    for where, row in read_rows(source, split=split):
        if limit is not None and len(records) >= limit:
            break
        if not isinstance(row, dict):
            raise DataError(f"{where}: row must be a JSON object, got {type_name(row)}")
        records.append(parse(row, where, len(records)))
    if not records:
        raise DataError(f"{_display(source)}: dataset is empty (no rows)")
    return records


# --- row -> record -------------------------------------------------------------------------------


def _require(row: dict[str, Any], name: str, where: str, hint: str = "") -> Any:
    if name not in row or row[name] is None:
        raise DataError(f"{where}: missing field '{name}'{hint}")
    return row[name]


def _prompt_from_row(row: dict[str, Any], where: str, index: int, *, allow_empty: bool = False) -> PromptRecord:
    hint = ""
    if "prompt" not in row:  # a dataset's own column name (gsm8k's "question", a chat "messages")
        chat = " (a chat prompt goes in 'prompt' as its list of messages)" if "messages" in row else ""
        hint = f"; the row has {', '.join(repr(k) for k in list(row)[:8])}{chat}" if row else ""
    prompt = check_text(_require(row, "prompt", where, hint), where, "prompt", allow_empty=allow_empty)
    if isinstance(prompt, list) and prompt[-1]["role"] in ("assistant", "system"):
        # Rendered with the generation prompt, it would close that turn and open a new, empty one.
        raise DataError(f"{where}: field 'prompt' ends with a {prompt[-1]['role']!r} message; a prompt to "
                        "generate from ends with a 'user' or 'tool' turn")
    fields = {k: v for k, v in row.items() if k != "prompt"}
    return PromptRecord(prompt=prompt, fields=fields, index=index, where=where)


def _sft_from_row(row: dict[str, Any], where: str, index: int) -> SFTRecord:
    # A column that is null in this row is absent from it (Parquet / datasets files merged from
    # sources of different formats carry every column in every row).
    row = {key: value for key, value in row.items() if value is not None}
    # A chat row may carry a 'prompt' or a 'completion' column beside its messages (ultrachat, no_robots
    # carry the first user turn): unless the row has both, the messages are the example.
    is_pair = "prompt" in row and "completion" in row
    if "messages" in row and not is_pair:
        messages = check_text(row["messages"], where, "messages")
        if isinstance(messages, str):
            raise DataError(f"{where}: field 'messages' must be a list of chat messages, got str")
        prompt, completion = split_conversation(messages, where, "messages")
        check_sft_reply(completion, where, "messages")
        return SFTRecord(prompt=prompt, completion=completion, index=index, where=where)
    if "text" in row and not is_pair:
        text = check_text(row["text"], where, "text")
        if not isinstance(text, str):
            raise DataError(f"{where}: field 'text' must be a string, got list")
        return SFTRecord(prompt=text, completion=None, index=index, where=where)
    hint = " (SFT rows need 'prompt' and 'completion', or 'messages', or 'text')"
    prompt = check_text(_require(row, "prompt", where, hint), where, "prompt")
    completion = check_reply(_require(row, "completion", where, hint), prompt, where, "completion")
    check_sft_reply(completion, where, "completion")
    return SFTRecord(prompt=prompt, completion=completion, index=index, where=where)


def _preference_from_row(row: dict[str, Any], where: str, index: int) -> PreferenceRecord:
    chosen_raw = _require(row, "chosen", where)
    rejected_raw = _require(row, "rejected", where)
    # Both sides full conversations: the prompt is their shared messages, whatever a 'prompt' column
    # holds beside them (ultrafeedback_binarized carries the first user turn there as a string).
    is_chat_pair = isinstance(chosen_raw, list) and isinstance(rejected_raw, list)
    if is_chat_pair and (row.get("prompt") is None or (isinstance(row["prompt"], str) and len(chosen_raw) > 1)):
        return _implicit_prompt_pair(chosen_raw, rejected_raw, where, index)
    prompt = check_text(_require(row, "prompt", where), where, "prompt")
    chosen = check_reply(chosen_raw, prompt, where, "chosen")
    rejected = check_reply(rejected_raw, prompt, where, "rejected")
    return PreferenceRecord(prompt=prompt, chosen=chosen, rejected=rejected, index=index)


def _implicit_prompt_pair(chosen_raw: list, rejected_raw: list, where: str, index: int) -> PreferenceRecord:
    chosen_chat = check_text(chosen_raw, where, "chosen")
    rejected_chat = check_text(rejected_raw, where, "rejected")
    assert isinstance(chosen_chat, list) and isinstance(rejected_chat, list)
    prompt, chosen = split_conversation(chosen_chat, where, "chosen")
    rejected_prompt, rejected = split_conversation(rejected_chat, where, "rejected")
    if prompt != rejected_prompt:
        raise DataError(
            f"{where}: fields 'chosen' and 'rejected' must share every message but the last "
            "when there is no 'prompt' field"
        )
    return PreferenceRecord(prompt=prompt, chosen=chosen, rejected=rejected, index=index)


# --- sources -> raw rows -------------------------------------------------------------------------


def read_rows(source: Source, *, split: str = "train") -> Iterator[Row]:
    """Yield ``(where, row)`` for every row of ``source``; rows are not validated here."""
    if isinstance(source, Sequence) and not isinstance(source, str):
        yield from ((f"<rows>:row {i}", row) for i, row in enumerate(source))
        return
    path = Path(source)
    if path.is_dir():
        yield from _read_datasets_dir(path, split)
    elif path.suffix.lower() == ".jsonl":  # data.JSONL too
        yield from _read_jsonl(path)
    elif path.suffix.lower() == ".parquet":
        yield from _read_parquet(path)
    elif path.exists():
        raise DataError(
            f"unsupported data file type '{path.suffix}': {path} (use .jsonl, .parquet or a directory)"
        )
    elif _is_file_path(str(source)):
        raise DataError(f"data file not found: {path}")
    else:  # a Hub name, ``org/name`` or ``name``, read from the local cache
        yield from _read_named_dataset(str(source), split)


# Suffixes that make a missing source a missing file, not a dataset name (Hub names may hold dots:
# ``org/Dataset-v1.5``).
_FILE_SUFFIXES = {".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".gz", ".zst", ".arrow", ".yaml", ".yml"}


def _is_file_path(source: str) -> bool:
    """A missing ``source`` that can only be a path: absolute, relative to ``.``/``~``, deeper than
    ``org/name``, or with a data file's suffix."""
    return (source.startswith((".", "/", "~")) or source.count("/") > 1 or os.sep != "/" and os.sep in source
            or Path(source).suffix.lower() in _FILE_SUFFIXES)


def _read_jsonl(path: Path) -> Iterator[Row]:
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")  # a BOM is not data
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{line_number}: not valid UTF-8 (byte {exc.start} of the line)") from None
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            except (ValueError, RecursionError) as e:  # valid JSON Python refuses: a huge int, deep nesting
                raise DataError(f"{where}: unreadable JSON ({one_line(e)})") from None
            yield where, row


def _read_parquet(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several unrelated types for a bad file
        raise DataError(f"{path}: cannot read Parquet file ({one_line(e)})") from None
    row_number = 0
    batches = parquet.iter_batches()  # streamed so a `limit` does not read the whole file
    while True:
        try:
            batch = next(batches, None)
            if batch is None:
                return
            rows = batch.to_pylist()
        except Exception as e:  # a corrupt page shows only when its batch is read
            raise DataError(f"{path}: cannot read Parquet file at row {row_number} ({one_line(e)})") from None
        for row in rows:
            yield f"{path}:row {row_number}", row
            row_number += 1


def _read_datasets_dir(path: Path, split: str) -> Iterator[Row]:
    datasets = _offline_datasets()
    is_saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
    try:
        dataset = (
            datasets.load_from_disk(str(path)) if is_saved else datasets.load_dataset(str(path), split=split)
        )
    except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ...)
        if not is_saved:
            _find_bad_row(path)  # a JSONL or Parquet file's bad row, by file and line, where there is one
        raise DataError(f"{path}: cannot load dataset ({_reason(e)})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise DataError(f"{path}: no split '{split}' (available: {', '.join(dataset)})")
        dataset = dataset[split]
    yield from ((f"{path}:row {i}", row) for i, row in enumerate(dataset))


def _read_named_dataset(name: str, split: str) -> Iterator[Row]:
    datasets = _offline_datasets()
    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as e:
        raise DataError(f"no data file or directory '{name}', and no dataset of that name in the local `datasets` "
                        f"cache ({_reason(e)})") from None
    yield from ((f"{name}:row {i}", row) for i, row in enumerate(dataset))


def _find_bad_row(directory: Path) -> None:
    """Reads the JSONL and Parquet files under a directory ``datasets`` failed on with tether's own
    readers, whose errors name the file and line (``datasets`` names neither)."""
    readers = {".jsonl": _read_jsonl, ".parquet": _read_parquet}
    for file in sorted(directory.rglob("*")):
        if file.suffix.lower() in readers and file.is_file():
            for _ in readers[file.suffix.lower()](file):
                pass


def _reason(error: BaseException) -> str:
    """``datasets``' error and, where it wraps another, the innermost one: "An error occurred while
    generating the dataset" says nothing; the JSON parse error with its row under it does."""
    root = error
    while (inner := root.__cause__ or root.__context__) is not None and inner is not root:
        root = inner
    return one_line(error) if root is error else f"{one_line(error)}: {one_line(root)}"


def _offline_datasets() -> Any:
    """Import ``datasets`` so that it can only read local files and its cache.

    ``datasets`` reads the variable once, at import; if something imported it earlier, the flag
    on its config module is set as well (the only supported switch it has).
    """
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True
    return datasets


def _display(source: Source) -> str:
    if isinstance(source, Sequence) and not isinstance(source, str):
        return "<rows>"
    return str(source)
