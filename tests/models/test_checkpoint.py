"""Checkpoint I/O: tether writes what transformers reads, reads what transformers writes, and says
in one line what is wrong with a bad directory."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers.hf_tiny import make_hf_checkpoint
from tether.errors import CheckpointError
from tether.models import load_model, read_model_config, save_model

ATOL = 1e-4
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def tensor_names(directory) -> set[str]:
    names = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            names |= set(handle.keys())
    return names


@torch.no_grad()
def logits_of(model, input_ids):
    if hasattr(model, "compute_logits"):
        return model.compute_logits(model(input_ids))
    return model(input_ids).logits


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [("qwen2", dict(tie=True)), ("llama", dict(bias=True, rope_scaling=YARN)), ("qwen3", dict()),
     ("mistral", dict(sliding_window=4))],
)  # fmt: skip
def test_tether_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path, family, kwargs):
    source = make_hf_checkpoint(tmp_path / "hf", family, with_tokenizer=False, **kwargs)
    model = load_model(source)
    with torch.no_grad():
        for param in model.parameters():  # make sure we save our weights, not copy the source files
            param.add_(0.01)
    saved = save_model(model, tmp_path / "ours")
    hf = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    input_ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits_of(hf, input_ids), logits_of(model, input_ids), atol=ATOL, rtol=0)
    assert read_model_config(saved) == model.config
    if kwargs.get("tie"):
        assert "lm_head.weight" not in tensor_names(saved)  # tied head not saved twice


def test_sharded_checkpoint_round_trips_through_tether_and_transformers(tmp_path):
    source = make_hf_checkpoint(tmp_path / "hf", "qwen3", with_tokenizer=False)
    model = load_model(source)
    saved = save_model(model, tmp_path / "sharded", max_shard_bytes=40_000)
    shards = sorted(saved.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (saved / "model.safetensors").exists()
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert {shard.name for shard in shards} == set(index["weight_map"].values())
    for shard in shards:  # only a tensor above the limit may make its shard larger
        tensors = load_file(str(shard))
        assert len(tensors) == 1 or sum(t.numel() * 4 for t in tensors.values()) <= 40_000
    input_ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(1))
    expected = logits_of(model, input_ids)
    torch.testing.assert_close(logits_of(load_model(saved), input_ids), expected, atol=0, rtol=0)
    hf = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    torch.testing.assert_close(logits_of(hf, input_ids), expected, atol=ATOL, rtol=0)
    save_model(model, saved)  # re-saving unsharded over it must not leave stale shards behind
    assert sorted(p.name for p in saved.glob("*.safetensors")) == ["model.safetensors"]
    assert not (saved / "model.safetensors.index.json").exists()


def test_transformers_sharded_checkpoint_loads(tmp_path):
    source = make_hf_checkpoint(tmp_path / "hf", "llama", with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(source).eval()
    hf.save_pretrained(tmp_path / "hf_sharded", max_shard_size="30KB")
    assert (tmp_path / "hf_sharded" / "model.safetensors.index.json").exists()
    input_ids = torch.randint(0, 100, (1, 8))
    model = load_model(tmp_path / "hf_sharded")
    torch.testing.assert_close(logits_of(model, input_ids), logits_of(hf, input_ids), atol=ATOL, rtol=0)


def test_load_casts_to_the_requested_dtype_and_save_records_it(tmp_path):
    source = make_hf_checkpoint(tmp_path / "hf", "qwen2", with_tokenizer=False, tie=True)
    model = load_model(source, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    saved = save_model(model, tmp_path / "bf16")
    assert json.loads((saved / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_file(str(saved / "model.safetensors"))["model.norm.weight"].dtype == torch.bfloat16


def assert_one_line_error(path, *needles):
    with pytest.raises(CheckpointError) as info:
        load_model(path)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


@pytest.fixture
def checkpoint(tmp_path):
    return make_hf_checkpoint(tmp_path / "ckpt", "qwen2", with_tokenizer=False)


def test_saved_weights_are_as_readable_as_the_config(tmp_path, checkpoint):
    """safetensors writes 0600: another user, or a vLLM container of another uid, could not read them."""
    model = load_model(checkpoint)
    for shard_bytes in (None, 40_000):
        saved = save_model(model, tmp_path / f"out{shard_bytes}", max_shard_bytes=shard_bytes)
        mode = (saved / "config.json").stat().st_mode & 0o777
        assert {f.stat().st_mode & 0o777 for f in saved.glob("*.safetensors")} == {mode}


def test_a_run_directory_given_as_a_checkpoint_names_its_final(tmp_path, checkpoint):
    """`tether generate --model runs/x` said "runs/x/config.json: file not found"."""
    run = tmp_path / "run"
    run.mkdir()
    checkpoint.rename(run / "final")
    assert_one_line_error(run, "run", f"is a run directory; its checkpoint is {run / 'final'}")


def test_missing_directory_or_config(tmp_path, checkpoint):
    assert_one_line_error(tmp_path / "nope", "nope", "does not exist")
    (checkpoint / "config.json").unlink()
    assert_one_line_error(checkpoint, "config.json", "not found")


def test_bad_config_json(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    assert_one_line_error(checkpoint, "config.json", "not valid JSON")


def test_index_whose_weight_map_is_not_a_mapping(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "model.safetensors.index.json").write_text('{"weight_map": ["a", "b"]}')
    assert_one_line_error(checkpoint, "model.safetensors.index.json", "'weight_map' must map")


def test_unsupported_model_type(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    assert_one_line_error(checkpoint, "config.json", "'gemma'")


def test_missing_weights_file(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    assert_one_line_error(checkpoint, "model.safetensors", "found")


def test_pickled_weights_only_say_how_to_convert(checkpoint):
    (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
    assert_one_line_error(checkpoint, "pytorch_model.bin holds pickled weights", "save_pretrained")


def test_a_tied_checkpoint_that_stored_only_the_head_loads_it_as_the_embedding(tmp_path):
    """transformers ties either way round; the logits are the reference's."""
    path = make_hf_checkpoint(tmp_path / "ckpt", "qwen2", tie=True, with_tokenizer=False)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    rewrite_weights(path, lambda t: t.update({"lm_head.weight": t.pop("model.embed_tokens.weight")}))
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    input_ids = torch.tensor([[1, 5, 9, 13, 2]])
    torch.testing.assert_close(logits_of(model, input_ids), logits_of(reference, input_ids))


def rewrite_weights(checkpoint, edit):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.pop("model.layers.1.self_attn.q_proj.bias"))
    name = "'model.layers.1.self_attn.q_proj.bias'"
    assert_one_line_error(checkpoint, "model.safetensors", name, "missing")


def test_misshaped_tensor(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    assert_one_line_error(checkpoint, "model.safetensors", "'model.norm.weight'", "[3]", "[64]")


def test_integer_tensor(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int64)}))
    assert_one_line_error(checkpoint, "model.safetensors", "'model.norm.weight'", "torch.int64", "floating")


@pytest.mark.parametrize("key, value", [("vocab_size", -5), ("intermediate_size", 0), ("num_key_value_heads", -2),
                                        ("num_attention_heads", 0), ("max_position_embeddings", -1)])
def test_sizes_below_one_in_config_json(checkpoint, key, value):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, key: value}))
    assert_one_line_error(checkpoint, "config.json", key)


def test_unexpected_tensor(checkpoint):
    rewrite_weights(checkpoint, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.ones(64)}))
    assert_one_line_error(checkpoint, "model.safetensors", "'model.layers.0.self_attn.o_proj.bias'")


def test_corrupt_safetensors(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"\x00garbage")
    assert_one_line_error(checkpoint, "model.safetensors", "cannot read")


def test_a_truncated_or_lfs_pointer_safetensors_says_which(checkpoint):
    """A clone without `git lfs` leaves pointer files; an interrupted download a truncated file: the
    error says so (it gave only the reader's type name, "SafetensorError")."""
    weights = checkpoint / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    assert_one_line_error(checkpoint, "model.safetensors", "SafetensorError: ")
    weights.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 123456\n")
    assert_one_line_error(checkpoint, "model.safetensors", "a Git LFS pointer, not the file: fetch it with `git lfs")


def test_a_tensor_the_index_places_in_the_wrong_shard(tmp_path, checkpoint):
    saved = save_model(load_model(checkpoint), tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.norm.weight"] = first  # the norm sits in the last shard
    (saved / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_one_line_error(saved, first, "has no tensor 'model.norm.weight'", "model.safetensors.index.json")


def test_a_saved_head_unlike_the_tied_embedding_is_loaded_untied_as_transformers_does(tmp_path):
    """config.json ties the embeddings, yet the file holds a different lm_head.weight: transformers 5
    keeps the saved head (and warns); so does tether, with the same logits."""
    path = make_hf_checkpoint(tmp_path / "ckpt", "qwen2", tie=True, with_tokenizer=False)
    rewrite_weights(path, lambda t: t.update({"lm_head.weight": torch.randn_like(t["model.embed_tokens.weight"])}))
    with pytest.warns(UserWarning, match="lm_head.weight differs from model.embed_tokens.weight"):
        model = load_model(path)
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    input_ids = torch.tensor([[1, 5, 9, 13, 2]])
    torch.testing.assert_close(logits_of(model, input_ids), logits_of(reference, input_ids))


def test_missing_shard(tmp_path, checkpoint):
    saved = save_model(load_model(checkpoint), tmp_path / "sharded", max_shard_bytes=40_000)
    next(iter(saved.glob("model-*-of-*.safetensors"))).unlink()
    assert_one_line_error(saved, "model.safetensors.index.json", "is missing")


def test_a_file_given_as_the_checkpoint(checkpoint):
    assert_one_line_error(checkpoint / "config.json", "config.json is a file", "the directory that holds config.json")


@pytest.mark.parametrize("key, value", [("rms_norm_eps", float("nan")), ("rms_norm_eps", 0), ("rope_theta", -1.0),
                                        ("rope_theta", float("inf"))])
def test_norm_and_rope_constants_that_would_poison_every_logit(checkpoint, key, value):
    config = json.loads((checkpoint / "config.json").read_text())
    config[key] = value
    if key == "rope_theta":  # transformers 5 keeps it in rope_parameters, which wins
        config["rope_parameters"] = {**config["rope_parameters"], key: value}
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert_one_line_error(checkpoint, "config.json", key, "finite number > 0")


def test_a_checkpoint_save_that_fails_leaves_no_half_written_directory(tmp_path):
    """final/ appears whole or not at all: a run killed while saving leaves no directory that looks
    complete but lacks its tokenizer or weights; a later save replaces an earlier one."""
    from tether.models import build_char_tokenizer
    from tether.models.checkpoint import save_checkpoint

    model = load_model(make_hf_checkpoint(tmp_path / "src", "qwen2", hidden_size=32, num_layers=1))
    tokenizer = build_char_tokenizer()

    class Interrupted(Exception):
        pass

    class FailingTokenizer:
        def save_pretrained(self, path):
            raise Interrupted

    with pytest.raises(Interrupted):
        save_checkpoint(model, FailingTokenizer(), tmp_path / "final")
    assert not (tmp_path / "final").exists()
    save_checkpoint(model, tokenizer, tmp_path / "final")
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    save_checkpoint(model, tokenizer, tmp_path / "final")  # over the first
    reloaded = load_model(tmp_path / "final")
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_final_keeps_the_source_tokenizer_files_byte_for_byte(tmp_path):
    """A tokenizer re-saved by the installed transformers differs from the source's (transformers 5
    writes a tokenizer_config.json that transformers 4, vLLM's, cannot load, and drops files): a
    trained checkpoint carries the source's files as they were."""
    from tether.models import load_tokenizer
    from tether.models.checkpoint import save_checkpoint

    source = make_hf_checkpoint(tmp_path / "src", "qwen2", hidden_size=32, num_layers=1)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", legacy=False, written_by="transformers 4.57")
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    (source / "merges.txt").write_text("#version: 0.2\n")
    (source / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<eos>"}))
    tokenizer = load_tokenizer(source)
    final = save_checkpoint(load_model(source), tokenizer, tmp_path / "final", source=source)
    for name in ("tokenizer.json", "tokenizer_config.json", "merges.txt", "special_tokens_map.json"):
        assert (final / name).read_bytes() == (source / name).read_bytes(), name
    assert load_tokenizer(final)("12+3=\n ok")["input_ids"] == tokenizer("12+3=\n ok")["input_ids"]


def test_a_built_tokenizer_is_saved_as_the_generic_class_transformers_4_and_5_load(tmp_path):
    """A model from scratch has no source tokenizer: its character tokenizer is saved with
    tokenizer_class PreTrainedTokenizerFast (transformers 5 writes TokenizersBackend, unknown to 4)."""
    from transformers import AutoTokenizer

    from tether.models import build_char_tokenizer
    from tether.models.checkpoint import save_checkpoint

    model = load_model(make_hf_checkpoint(tmp_path / "src", "qwen2", hidden_size=32, num_layers=1))
    tokenizer = build_char_tokenizer()
    final = save_checkpoint(model, tokenizer, tmp_path / "final")
    config = json.loads((final / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "is_local" not in config
    loaded = AutoTokenizer.from_pretrained(str(final), local_files_only=True)
    assert loaded("a b\n7")["input_ids"] == tokenizer("a b\n7")["input_ids"]
