from __future__ import annotations

import json

import pytest

from tether.data import (
    PreferenceRecord,
    PromptRecord,
    SFTRecord,
    load_sft,
    tokenize_preference,
    tokenize_prompt,
    tokenize_sft,
)
from tether.data.tokenize import encode_prompt
from tether.errors import DataError
from tether.models import build_char_tokenizer

BOS, EOS = 1, 2


def masked_text(tokenizer, example) -> str:
    return tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m])


def test_plain_text_layout_is_bos_prompt_completion_eos(char_tokenizer):
    example = tokenize_sft(SFTRecord("37+485=", "522", index=4), char_tokenizer, max_len=64)
    chars = lambda s: char_tokenizer.encode(s, add_special_tokens=False)
    assert example.input_ids == [BOS] + chars("37+485=") + chars("522") + [EOS]
    assert example.loss_mask == [False] * 8 + [True] * 4
    assert masked_text(char_tokenizer, example) == "522<eos>"
    assert example.num_loss_tokens == 4 and example.index == 4


def test_prompt_ids_are_the_prefix_of_the_sft_example(char_tokenizer):
    record = SFTRecord("12-5=", "7")
    prompt_ids = tokenize_prompt(PromptRecord("12-5="), char_tokenizer)
    example = tokenize_sft(record, char_tokenizer, max_len=64)
    assert example.input_ids[: len(prompt_ids)] == prompt_ids
    assert not any(example.loss_mask[: len(prompt_ids)])
    assert all(example.loss_mask[len(prompt_ids) :])


def test_chat_prompt_matches_transformers_apply_chat_template(char_tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]
    expected = char_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert tokenize_prompt(PromptRecord(messages), char_tokenizer) == expected["input_ids"]


def test_chat_mask_covers_exactly_the_assistant_reply_and_eos(char_tokenizer):
    prompt = [{"role": "user", "content": "2+2="}]
    record = SFTRecord(prompt, [{"role": "assistant", "content": "4"}])
    example = tokenize_sft(record, char_tokenizer, max_len=64)
    # The template writes "<eos>\n" after each turn; the newline after eos is never sampled.
    assert masked_text(char_tokenizer, example) == "4<eos>"
    assert example.input_ids[-1] == EOS
    full = char_tokenizer.apply_chat_template(prompt + record.completion, tokenize=False)
    assert char_tokenizer.decode(example.input_ids) + "\n" == full


def with_template(char_tokenizer, chat_template: str):
    """The char tokenizer with another chat template (a copy: the fixture is shared)."""
    tokenizer = char_tokenizer.__class__(tokenizer_object=char_tokenizer.backend_tokenizer)
    tokenizer.eos_token, tokenizer.bos_token = "<eos>", "<bos>"
    tokenizer.chat_template = chat_template
    return tokenizer


def test_chat_reply_without_eos_in_template_gets_eos_appended(char_tokenizer):
    tokenizer = with_template(char_tokenizer, "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                                              "{% if add_generation_prompt %}[assistant]{% endif %}")
    example = tokenize_sft(SFTRecord([{"role": "user", "content": "hi"}], "yo"), tokenizer, max_len=64)
    assert masked_text(tokenizer, example) == "yo<eos>"


def test_text_record_trains_on_every_token_after_the_first(char_tokenizer):
    example = tokenize_sft(SFTRecord("hello", None), char_tokenizer, max_len=64)
    assert char_tokenizer.decode(example.input_ids) == "<bos>hello<eos>"
    assert example.loss_mask == [False] + [True] * 6


def test_long_completion_is_cut_on_the_right_without_eos(char_tokenizer):
    example = tokenize_sft(SFTRecord("ab=", "0123456789"), char_tokenizer, max_len=8)
    assert len(example.input_ids) == 8
    assert masked_text(char_tokenizer, example) == "0123"
    assert EOS not in example.input_ids


def test_prompt_longer_than_max_len_is_a_data_error(char_tokenizer):
    with pytest.raises(DataError, match=r"^example 3: prompt is 11 tokens, .*max_len=10 \(data.max_seq_len\)$"):
        tokenize_sft(SFTRecord("0123456789", "x", index=3), char_tokenizer, max_len=10)


def test_chat_record_needs_a_chat_template(char_tokenizer):
    tokenizer = char_tokenizer.__class__(tokenizer_object=char_tokenizer.backend_tokenizer)
    tokenizer.eos_token = "<eos>"
    with pytest.raises(DataError, match="chat_template"):
        tokenize_prompt(PromptRecord([{"role": "user", "content": "hi"}]), tokenizer)


def test_a_completion_that_already_ends_with_eos_gets_no_second(char_tokenizer):
    plain = tokenize_sft(SFTRecord("2+2=", "4<eos>"), char_tokenizer, max_len=64)
    assert char_tokenizer.decode(plain.input_ids) == "<bos>2+2=4<eos>"
    assert masked_text(char_tokenizer, plain) == "4<eos>"
    text = tokenize_sft(SFTRecord("hello<eos>", None), char_tokenizer, max_len=64)
    assert char_tokenizer.decode(text.input_ids) == "<bos>hello<eos>"


def test_a_chat_template_that_refuses_the_conversation_names_the_row(char_tokenizer):
    """Mistral / Llama 2 templates raise_exception() on a system turn: one line naming where the row is."""
    tokenizer = with_template(
        char_tokenizer,
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    record = SFTRecord([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "a",
                       where="data.jsonl:7")
    with pytest.raises(DataError) as info:
        tokenize_sft(record, tokenizer, max_len=64)
    assert str(info.value) == ("data.jsonl:7: the chat template refuses this conversation (TemplateError: System role "
                               "not supported)")
    with pytest.raises(DataError, match=r"^the chat template refuses this conversation \(TemplateError: System role"):
        tokenize_prompt(PromptRecord(record.prompt), tokenizer)


def test_a_reply_the_template_cannot_locate_names_the_row(char_tokenizer):
    tokenizer = with_template(char_tokenizer, "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}")
    record = SFTRecord([{"role": "user", "content": "q"}], "a", where="data.jsonl:4")
    with pytest.raises(DataError, match=r"^data.jsonl:4: the chat template does not render the prompt"):
        tokenize_sft(record, tokenizer, max_len=64)


def test_preference_pair_shares_the_prompt(char_tokenizer):
    chosen, rejected = tokenize_preference(PreferenceRecord("1+1=", "2", "3"), char_tokenizer, max_len=32)
    assert chosen.input_ids[:-2] == rejected.input_ids[:-2]
    assert masked_text(char_tokenizer, chosen) == "2<eos>"
    assert masked_text(char_tokenizer, rejected) == "3<eos>"


def test_sft_trains_on_the_prompt_ids_the_engine_is_given():
    # `tether generate` and the RL loop encode prompts with encode_prompt; SFT must train on the same ids.
    tokenizer = build_char_tokenizer()  # the product's own, with its chat template
    for prompt in ["37+485=", [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="}]]:
        record = SFTRecord(prompt, "3")
        expected = encode_prompt(tokenizer, prompt)
        assert tokenize_prompt(record, tokenizer) == expected
        example = tokenize_sft(record, tokenizer, max_len=128)
        assert example.input_ids[: len(expected)] == expected
        assert example.input_ids[-1] == tokenizer.eos_token_id
        assert not any(example.loss_mask[: len(expected)]) and all(example.loss_mask[len(expected) :])


def _sentencepiece_style_tokenizer():
    """A Llama-2/Mistral-style fast tokenizer: Prepend("▁") normalizer, byte-free BPE."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    raw.train_from_iterator(["Q: 2+2=4 the answer is 42 hello world"] * 20,
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_a_completion_gets_no_word_start_space_the_data_lacks():
    """Encoded alone, "4" would become "▁4" under SentencePiece's Prepend("▁"): the model would
    learn to answer "2+2= 4". Its tokens are those of prompt + completion encoded together."""
    tokenizer = _sentencepiece_style_tokenizer()
    example = tokenize_sft(SFTRecord(prompt="Q: 2+2=", completion="4"), tokenizer, 32)
    joint = [tokenizer.bos_token_id, *tokenizer.encode("Q: 2+2=4", add_special_tokens=False)]
    assert example.input_ids == [*joint, tokenizer.eos_token_id]
    assert tokenizer.decode(example.input_ids, skip_special_tokens=True) == "Q: 2+2=4"
    spaced = tokenize_sft(SFTRecord(prompt="Q: 2+2=", completion=" 4"), tokenizer, 32)  # a real space stays
    assert tokenizer.decode(spaced.input_ids, skip_special_tokens=True) == "Q: 2+2= 4"


def test_an_sft_reply_that_only_calls_a_tool_trains_on_the_call(char_tokenizer, tmp_path):
    """Function-calling SFT data: the last assistant turn is OpenAI's {"content": null, "tool_calls": [...]}."""
    tokenizer = with_template(
        char_tokenizer,
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% for c in m.get('tool_calls', []) %}"
        "<call>{{ c['function']['name'] }}</call>{% endfor %}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    row = {"messages": [{"role": "user", "content": "weather in Paris?"},
                        {"role": "assistant", "content": None, "tool_calls": [call]}]}
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(row) + "\n")
    [record] = load_sft(path)
    assert masked_text(tokenizer, tokenize_sft(record, tokenizer, max_len=128)) == "<call>get_weather</call><eos>"
    row["messages"][-1].pop("tool_calls")  # no text and no call: nothing to learn
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match="tools.jsonl:1: .*must be a string"):
        load_sft(path)


def test_a_chat_template_that_does_not_parse_is_the_checkpoints_fault(char_tokenizer):
    """Not the data row's ("the chat template refuses this conversation"): the template is broken."""
    from tether.errors import CheckpointError

    tokenizer = with_template(char_tokenizer, "{% for m in messages %}{{ m['content'] }")
    with pytest.raises(CheckpointError, match=r"the tokenizer's chat template does not parse \(line 1: "):
        tokenize_prompt(PromptRecord([{"role": "user", "content": "hi"}]), tokenizer)
