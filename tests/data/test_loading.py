from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tether.data import PreferenceRecord, PromptRecord, SFTRecord, load_preferences, load_prompts, load_sft
from tether.errors import ConfigError, DataError

# tether depends on datasets (so CI has it); a GPU machine's image that runs only the gpu-marked tests
# (bench/device_check.sh) may not, and a module that fails to import stops pytest's whole collection.
datasets = pytest.importorskip("datasets")

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]
PROMPT_ROWS = [
    {"prompt": "37+485=", "answer": "522", "level": 2},
    {"prompt": "1+1=", "answer": "2", "level": 1},
    {"prompt": "9-3=", "answer": "6", "level": 1},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)  # so error messages show the relative paths a user would type
    return tmp_path


def all_sources(tmp_path: Path, rows: list[dict]) -> dict[str, object]:
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    saved_dict = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(saved_dict))
    return {
        "jsonl": write_jsonl(tmp_path / "d.jsonl", rows),
        "parquet": write_parquet(tmp_path / "d.parquet", rows),
        "save_to_disk": saved,
        "save_to_disk_dict": saved_dict,
        "rows": rows,
    }


def test_a_data_file_suffix_in_capitals_is_read(tmp_path):
    """data.JSONL or data.Parquet (a Windows export) was an unsupported data file type."""
    upper = write_jsonl(tmp_path / "d.JSONL", PROMPT_ROWS)
    assert load_prompts(upper) == load_prompts(write_jsonl(tmp_path / "d.jsonl", PROMPT_ROWS))
    assert load_prompts(write_parquet(tmp_path / "d.Parquet", PROMPT_ROWS)) == load_prompts(upper)


def test_prompt_sources_load_the_same_records(tmp_path):
    expected = [
        PromptRecord(r["prompt"], {"answer": r["answer"], "level": r["level"]}, i)
        for i, r in enumerate(PROMPT_ROWS)
    ]
    for kind, source in all_sources(tmp_path, PROMPT_ROWS).items():
        assert load_prompts(source) == expected, kind


def test_local_dataset_directory_via_load_dataset(tmp_path):
    write_jsonl(tmp_path / "local" / "train.jsonl", PROMPT_ROWS)
    records = load_prompts(tmp_path / "local")
    assert [r.prompt for r in records] == [r["prompt"] for r in PROMPT_ROWS]
    assert records[0].fields == {"answer": "522", "level": 2}


def test_chat_prompts_through_every_format(tmp_path):
    rows = [{"prompt": CHAT, "answer": "4"}, {"prompt": CHAT[1:], "answer": "4"}]
    for kind, source in all_sources(tmp_path, rows).items():
        records = load_prompts(source)
        assert records[0].prompt == CHAT and records[0].is_chat, kind
        assert records[1].prompt == CHAT[1:], kind


def test_limit(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", PROMPT_ROWS + ["not an object"])
    assert [r.index for r in load_prompts(path, limit=2)] == [0, 1]
    with pytest.raises(ConfigError):
        load_prompts(path, limit=0)


def test_blank_lines_are_skipped_but_line_numbers_stay_true(in_tmp):
    path = Path("data/train.jsonl")
    path.parent.mkdir()
    path.write_text('{"prompt": "a"}\n\n{"prompt": 5}\n')
    with pytest.raises(DataError, match=r"^data/train.jsonl:3: "):
        load_prompts(path)


def test_split_of_a_dataset_dict(tmp_path):
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(PROMPT_ROWS),
            "test": datasets.Dataset.from_list(PROMPT_ROWS[:1]),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(load_prompts(tmp_path / "dd", split="test")) == 1
    with pytest.raises(DataError, match=r"no split 'validation' \(available: train, test\)"):
        load_prompts(tmp_path / "dd", split="validation")
    # One DatasetDict for both: the run trains on data.train_split and evaluates on data.eval_split.
    from tether.builders import build_prompt_data
    from tether.config import load_config

    config = load_config(None, ["recipe=sft", f"data.train={tmp_path / 'dd'}", f"data.eval={tmp_path / 'dd'}"])
    data = build_prompt_data(config.data, seed=0)
    assert (len(data.train), len(data.eval)) == (len(PROMPT_ROWS), 1)


def test_sft_formats(tmp_path):
    rows = [
        {"prompt": "1+1=", "completion": "2"},
        {"messages": CHAT + [{"role": "assistant", "content": "4"}]},
        {"prompt": CHAT, "completion": "4"},
        {"text": "just text"},
    ]
    assert load_sft(write_jsonl(tmp_path / "s.jsonl", rows)) == [
        SFTRecord("1+1=", "2", 0),
        SFTRecord(CHAT, [{"role": "assistant", "content": "4"}], 1),
        SFTRecord(CHAT, [{"role": "assistant", "content": "4"}], 2),
        SFTRecord("just text", None, 3),
    ]


def test_sft_parquet_messages(tmp_path):
    rows = [{"messages": CHAT + [{"role": "assistant", "content": "4"}]}]
    assert load_sft(write_parquet(tmp_path / "s.parquet", rows)) == [
        SFTRecord(CHAT, [{"role": "assistant", "content": "4"}], 0)
    ]


def test_preference_formats(tmp_path):
    reply = lambda text: [{"role": "assistant", "content": text}]
    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
        {"chosen": CHAT + reply("4"), "rejected": CHAT + reply("5")},  # implicit prompt
    ]
    assert load_preferences(write_jsonl(tmp_path / "p.jsonl", rows)) == [
        PreferenceRecord("1+1=", "2", "3", 0),
        PreferenceRecord(CHAT, reply("4"), reply("5"), 1),
    ]
    assert load_preferences(write_parquet(tmp_path / "p.parquet", rows[:1])) == [
        PreferenceRecord("1+1=", "2", "3", 0)
    ]


# --- the error catalogue: one line, naming file, line/row and field --------------------------------

BAD_PROMPT_ROWS = [
    ({"prompt": 5}, "field 'prompt' must be a string or a list of chat messages, got int"),
    ({"answer": "1"}, "missing field 'prompt'"),
    ({"prompt": None}, "missing field 'prompt'"),
    ({"prompt": ""}, "field 'prompt' is an empty string"),
    ({"prompt": []}, "field 'prompt' is an empty list of chat messages"),
    (
        {"prompt": [{"role": "bot", "content": "hi"}]},
        "field 'prompt' message 0 has role 'bot'; expected one of",
    ),
    ({"prompt": [{"role": "user"}]}, "field 'prompt' message 0 content must be a string, got missing"),
    ({"prompt": [{"role": "user", "content": None}]}, "field 'prompt' message 0 content must be a string, got null"),
    ({"prompt": [{"role": "system", "content": "Be brief."}]}, "field 'prompt' ends with a 'system' message"),
    (
        {"prompt": [{"role": "user", "content": "a"}, "hi"]},
        "field 'prompt' message 1 must be an object, got str",
    ),
    (["prompt"], "row must be a JSON object, got list"),
    ({"prompt": "a\ud800b"}, "field 'prompt' holds an unpaired surrogate at character 1"),
    (
        {"prompt": [{"role": "user", "content": "\udc00"}]},
        "field 'prompt' message 0 content holds an unpaired surrogate at character 0",
    ),
]


@pytest.mark.parametrize(("row", "message"), BAD_PROMPT_ROWS)
def test_bad_prompt_row_names_file_line_and_field(in_tmp, row, message):
    write_jsonl(Path("data/train.jsonl"), [PROMPT_ROWS[0]] * 16 + [row])
    with pytest.raises(DataError) as info:
        load_prompts("data/train.jsonl")
    assert str(info.value).startswith(f"data/train.jsonl:17: {message}")
    assert "\n" not in str(info.value)


def test_bad_parquet_row_names_the_row(in_tmp):
    write_parquet(Path("data/train.parquet"), [{"prompt": "a"}, {"prompt": None}])
    with pytest.raises(DataError, match=r"^data/train.parquet:row 1: missing field 'prompt'$"):
        load_prompts("data/train.parquet")


def test_bad_saved_dataset_row_names_the_row(in_tmp):
    datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": ""}]).save_to_disk("ds")
    with pytest.raises(DataError, match=r"^ds:row 1: field 'prompt' is an empty string$"):
        load_prompts("ds")


def test_invalid_json(in_tmp):
    Path("data").mkdir()
    Path("data/train.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c" "answer": 1}\n')
    with pytest.raises(DataError) as info:
        load_prompts("data/train.jsonl")
    # 1-based column of `"answer"`, where the comma is missing
    assert str(info.value) == "data/train.jsonl:3: invalid JSON (Expecting ',' delimiter at column 16)"


def test_json_that_python_refuses_is_one_line(in_tmp):
    """Valid JSON beyond Python's limits (a 5,000-digit integer, nesting past the recursion limit)."""
    Path("big.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b", "n": ' + "9" * 5000 + "}\n")
    with pytest.raises(DataError, match=r"^big.jsonl:2: unreadable JSON \(Exceeds the limit"):
        load_prompts("big.jsonl")
    Path("deep.jsonl").write_text('{"prompt": "a", "n": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(DataError, match=r"^deep.jsonl:1: unreadable JSON \(maximum recursion depth"):
        load_prompts("deep.jsonl")


def test_a_corrupt_parquet_page_is_one_line(in_tmp):
    """The footer reads, a data page does not: the error comes while rows are read, not at open."""
    rows = [{"prompt": f"prompt number {i} " * 4} for i in range(64)]
    pq.write_table(pa.Table.from_pylist(rows), "bad.parquet", compression="none", use_dictionary=False)
    data = bytearray(Path("bad.parquet").read_bytes())
    start = data.index(b"prompt number 10")
    data[start - 4 : start] = b"\xff\xff\xff\x7f"  # the length prefix of a BYTE_ARRAY value
    Path("bad.parquet").write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"^bad.parquet: cannot read Parquet file at row 0 \("):
        load_prompts("bad.parquet")


def test_missing_and_empty_files(in_tmp):
    with pytest.raises(DataError, match=r"^data file not found: data/x.jsonl$"):
        load_prompts("data/x.jsonl")
    with pytest.raises(DataError, match=r"^data file not found: data/x.parquet$"):
        load_prompts("data/x.parquet")
    Path("empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"^empty.jsonl: dataset is empty \(no rows\)$"):
        load_prompts("empty.jsonl")
    Path("rows.csv").write_text("prompt\na\n")
    with pytest.raises(DataError, match="unsupported data file type '.csv'"):
        load_prompts("rows.csv")
    Path("broken.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"^broken.parquet: cannot read Parquet file"):
        load_prompts("broken.parquet")


@pytest.mark.parametrize("name", ["surely_not_a_cached_dataset_name", "some-org/surely_not_cached-v1.5"])
def test_unknown_dataset_name_fails_offline_in_one_line(in_tmp, name):
    """A Hub name, ``org/name`` as most are, is looked up in the local cache, not taken for a file."""
    with pytest.raises(DataError) as info:
        load_prompts(name)
    assert str(info.value).startswith(f"no data file or directory '{name}', and no dataset of that name in the "
                                      "local `datasets` cache (")
    assert "\n" not in str(info.value)


def test_a_bad_row_in_a_directory_of_jsonl_files_is_named_by_file_and_line(in_tmp):
    write_jsonl(Path("folder/train.jsonl"), [{"prompt": "1+1="}, {"prompt": "2+2="}])
    with Path("folder/train.jsonl").open("a") as f:
        f.write('{"prompt":\n')
    with pytest.raises(DataError, match=r"^folder/train.jsonl:3: invalid JSON \(Expecting value at column 1\)$"):
        load_prompts("folder")


BAD_SFT_ROWS = [
    ({"prompt": "a"}, "missing field 'completion' (SFT rows need"),
    ({"completion": "a"}, "missing field 'prompt' (SFT rows need"),
    (
        {"prompt": "a", "completion": 3},
        "field 'completion' must be a string or a list of chat messages, got int",
    ),
    ({"messages": [{"role": "user", "content": "a"}]}, "field 'messages' must end with an assistant message"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "field 'messages' needs at least one message"),
    ({"messages": "hi"}, "field 'messages' must be a list of chat messages, got str"),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
        "field 'messages' ends with an empty assistant message",
    ),
    (
        {"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "assistant", "content": ""}]},
        "field 'completion' ends with an empty assistant message",
    ),
    (
        {"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]},
        "field 'completion' is a list of chat messages but 'prompt' is a string",
    ),
]


@pytest.mark.parametrize(("row", "message"), BAD_SFT_ROWS)
def test_bad_sft_rows(in_tmp, row, message):
    write_jsonl(Path("sft.jsonl"), [row])
    with pytest.raises(DataError) as info:
        load_sft("sft.jsonl")
    assert str(info.value).startswith(f"sft.jsonl:1: {message}")


def test_chat_rows_with_a_prompt_column_beside_their_messages(tmp_path):
    """ultrachat_200k / no_robots (SFT) and ultrafeedback_binarized (preferences) carry the first user
    turn as a text 'prompt' beside the full conversations; the conversations are the example."""
    user, reply = {"role": "user", "content": "2+2?"}, lambda text: [{"role": "assistant", "content": text}]
    sft = load_sft(write_jsonl(tmp_path / "s.jsonl", [{"prompt": "2+2?", "prompt_id": "x",
                                                         "messages": [user, *reply("4")]}]))
    assert (sft[0].prompt, sft[0].completion) == ([user], reply("4"))
    pairs = load_preferences(write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "2+2?", "chosen": [user, *reply("4")], "rejected": [user, *reply("5")], "score_chosen": 9.0}]))
    assert pairs == [PreferenceRecord([user], reply("4"), reply("5"), 0)]
    # messages beside a completion column only (no prompt): still the messages
    other = load_sft(write_jsonl(tmp_path / "o.jsonl", [{"messages": [user, *reply("4")], "completion": "x"}]))
    assert (other[0].prompt, other[0].completion) == ([user], reply("4"))


def test_an_empty_rejected_answer_is_a_preference_not_an_error(tmp_path):
    """Only an SFT target must have text to learn; a preference pair's rejected answer may be empty."""
    user, reply = {"role": "user", "content": "2+2?"}, lambda text: [{"role": "assistant", "content": text}]
    rows = [{"chosen": [user, *reply("4")], "rejected": [user, *reply("")]},
            {"prompt": [user], "chosen": reply("4"), "rejected": reply("")}]
    assert [p.rejected for p in load_preferences(write_jsonl(tmp_path / "p.jsonl", rows))] == [reply("")] * 2


def test_bad_preference_rows(in_tmp):
    write_jsonl(Path("p.jsonl"), [{"prompt": "a", "chosen": "b"}])
    with pytest.raises(DataError, match=r"^p.jsonl:1: missing field 'rejected'$"):
        load_preferences("p.jsonl")
    user = {"role": "user", "content": "x"}
    write_jsonl(
        Path("p.jsonl"),
        [
            {
                "chosen": [user, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "assistant", "content": "b"}],
            }
        ],
    )
    with pytest.raises(DataError, match=r"^p.jsonl:1: field 'rejected' needs at least one message"):
        load_preferences("p.jsonl")


def test_a_utf8_byte_order_mark_is_not_data(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [r.prompt for r in load_prompts(path)] == ["a", "b"]


def test_null_columns_of_another_format_are_absent(tmp_path):
    """Files merged from sources of different formats carry every column in every row, null where unused."""
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
             "prompt": None, "completion": None, "text": None},
            {"messages": None, "prompt": "2+2=", "completion": "4", "text": None}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_sft(path)
    assert records[0].completion == [{"role": "assistant", "content": "yo"}]
    assert (records[1].prompt, records[1].completion) == ("2+2=", "4")


def test_a_missing_split_of_a_data_directory_names_the_setting(in_tmp):
    """A folder of JSONL files has only a 'train' split; data.eval pointing at it asks for 'test'."""
    from tether.builders import build_sft_data
    from tether.config.schema import DataSection

    write_jsonl(Path("folder/train.jsonl"), [{"prompt": "1+1=", "completion": "2"}])
    section = DataSection(train="folder", eval="folder")
    with pytest.raises(DataError, match=r"Unknown split \"test\".*\(data.eval_split\)$"):
        build_sft_data(section, seed=0)


def test_an_assistant_turn_that_only_calls_tools_may_have_null_content(tmp_path):
    """OpenAI's form: {"role": "assistant", "content": null, "tool_calls": [...]}; chat templates render it."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    rows = [{"prompt": [{"role": "user", "content": "1+2?"},
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "content": "3"}]}]
    [record] = load_prompts(rows)
    assert record.prompt[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
