import pytest
from transformers import AutoTokenizer

from tether.data.tokenize import encode_prompt
from tether.errors import CheckpointError
from tether.models import build_char_tokenizer, load_tokenizer

TEXT = "Hello, world!\n  x = (1 + 2) * 3 .  ~`{}|"


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_vocabulary_layout(tokenizer):
    assert len(tokenizer) == 100  # 4 specials + 95 printable ASCII + newline
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.encode("ab\n", add_special_tokens=False) == [14, 15, 99]


def test_every_character_is_one_token_and_decoding_round_trips(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode([1, *ids, 2], skip_special_tokens=True) == TEXT


def test_unknown_characters_map_to_unk(tokenizer):
    # ids: 4 specials, 10 digits, then "a"
    assert tokenizer.encode("aéb", add_special_tokens=False) == [14, 3, 15]


def test_custom_alphabet():
    tokenizer = build_char_tokenizer("abca")
    assert len(tokenizer) == 7
    assert tokenizer.decode(tokenizer.encode("cab", add_special_tokens=False)) == "cab"
    accented = build_char_tokenizer("é a\n")  # a character of two UTF-8 bytes is still one token
    assert accented.encode("a é\nà", add_special_tokens=False) == [6, 5, 4, 7, 3]
    assert accented.decode(accented.encode("a é\n", add_special_tokens=False)) == "a é\n"


def test_save_and_load_with_auto_tokenizer(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").exists() and (tmp_path / "tokenizer_config.json").exists()
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = loaded.encode(TEXT, add_special_tokens=False)
    assert ids == tokenizer.encode(TEXT, add_special_tokens=False)
    assert loaded.decode(ids) == TEXT
    assert encode_prompt(load_tokenizer(tmp_path), [{"role": "user", "content": "hi"}]) == encode_prompt(
        tokenizer, [{"role": "user", "content": "hi"}]
    )


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3", "mistral"])
def test_a_checkpoints_char_tokenizer_reloads_exactly_whatever_the_model_family(tmp_path, tokenizer, model_type):
    """``tether train`` saves the character tokenizer next to the model's config.json; reloaded, it
    keeps spaces and newlines (transformers 5's ``AutoTokenizer`` picks ``Qwen2Tokenizer`` for a qwen2
    model, which dropped them)."""
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    loaded = load_tokenizer(tmp_path)
    assert encode_prompt(loaded, TEXT) == encode_prompt(tokenizer, TEXT)
    assert loaded.decode(loaded.encode(TEXT, add_special_tokens=False)) == TEXT
    assert loaded.chat_template == tokenizer.chat_template and loaded.eos_token_id == tokenizer.eos_token_id
    # transformers' own AutoTokenizer too (final/ is for any user of transformers): for qwen2 it rebuilds
    # the tokenizer as Qwen2Tokenizer, whose byte-level pipeline reads the byte-level spellings alike
    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert auto.encode(TEXT, add_special_tokens=False) == tokenizer.encode(TEXT, add_special_tokens=False)
    assert auto.decode(auto.encode(TEXT, add_special_tokens=False)) == TEXT
    # A prompt as transformers' generate and vLLM encode it is the prompt tether generates from (bos first).
    assert auto(TEXT).input_ids == encode_prompt(loaded, TEXT)


def test_encode_prompt_plain_text_gets_bos_only(tokenizer):
    assert encode_prompt(tokenizer, "ab") == [1, 14, 15]


def test_encode_prompt_chat_uses_template_with_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    ids = encode_prompt(tokenizer, messages)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids) == "<bos>system: Be brief.\nuser: 2+2?\nassistant: "


def test_load_tokenizer_errors_are_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(tmp_path)  # exists but holds no tokenizer
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')  # a model dir without tokenizer files
    with pytest.raises(CheckpointError, match="no tokenizer files"):  # not an empty 1-token tokenizer
        load_tokenizer(tmp_path)


def test_a_broken_tokenizer_json_file_is_named_with_where(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"model_max_length": 512,')
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json: not valid JSON at line 1 column 26"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:01\n")
    with pytest.raises(CheckpointError, match=r"tokenizer.json: a Git LFS pointer, not the file"):
        load_tokenizer(tmp_path)
