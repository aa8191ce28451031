"""Hugging Face checkpoint I/O: ``config.json`` + ``model.safetensors`` (or shards with an index).

A directory written by ``save_model`` loads with ``AutoModelForCausalLM.from_pretrained`` (4.x and
5.x), and any Llama / Mistral / Qwen2 / Qwen3 directory saved by transformers loads with
``load_model``. Every problem with the directory is a one-line ``CheckpointError`` naming the file
and, where there is one, the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tether.errors import CheckpointError, unreadable_reason
from tether.models.config import ModelConfig
from tether.models.decoder import Decoder
from tether.models.tokenizer import GENERIC_TOKENIZER_CLASSES, TOKENIZER_FILES

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers older transformers versions saved; not parameters of the model, safe to skip.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
CARRIED_FILES = ("generation_config.json",)  # copied from a trained checkpoint's source (save_checkpoint)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_model_config(path: str | Path) -> ModelConfig:
    """Parse ``path/config.json``."""
    directory = Path(path)
    if directory.is_file():
        raise CheckpointError(f"{directory} is a file; a checkpoint is the directory that holds config.json")
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        if (directory / "final" / CONFIG_FILE).is_file():  # a run directory, not its checkpoint
            raise CheckpointError(f"{directory} is a run directory; its checkpoint is {directory / 'final'}")
        raise CheckpointError(f"{config_path}: file not found")
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{config_path}: not valid JSON ({error})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    return ModelConfig.from_hf(hf, source=str(config_path))


def _weight_files(directory: Path) -> tuple[Path, dict[str, Path]]:
    """(the file that lists the tensors, tensor name -> the safetensors file holding it)."""
    single = directory / WEIGHTS_FILE
    index_path = directory / INDEX_FILE
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as handle:
                return single, dict.fromkeys(handle.keys(), single)
        except Exception as error:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{single}: cannot read safetensors ({unreadable_reason(single, error)})") from None
    if not index_path.is_file():
        pickled = [name for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")
                   if (directory / name).is_file()]
        hint = (f" ({pickled[0]} holds pickled weights, which tether does not load: convert with transformers, "
                "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir))") if pickled else ""
        raise CheckpointError(f"{directory}: neither {WEIGHTS_FILE} nor {INDEX_FILE} found{hint}")
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{index_path}: not a safetensors index ({error!r})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to shard file names")
    files = {name: directory / shard for name, shard in weight_map.items()}
    for shard in sorted(set(files.values())):
        if not shard.is_file():
            raise CheckpointError(f"{index_path}: shard {shard.name} is missing")
    return index_path, files


def _read_tensors(
    listing: Path, files: dict[str, Path], expected: dict[str, torch.Size], dtype: torch.dtype,
    device: str | torch.device,
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    names_by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        names_by_file.setdefault(file, []).append(name)
    for file, names in names_by_file.items():
        try:
            with safe_open(str(file), framework="pt") as handle:
                present = set(handle.keys())
                for name in names:
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name not in expected:
                        raise CheckpointError(f"{file}: unexpected tensor {name!r} for this architecture")
                    if name not in present:
                        raise CheckpointError(f"{file}: has no tensor {name!r}, which {listing.name} places there")
                    tensor = handle.get_tensor(name)
                    if not tensor.is_floating_point():  # a cast would make weights of its integers
                        raise CheckpointError(f"{file}: tensor {name!r} is {tensor.dtype}, not floating point")
                    if tensor.shape != expected[name]:
                        raise CheckpointError(
                            f"{file}: tensor {name!r} has shape {list(tensor.shape)}, "
                            f"expected {list(expected[name])}"
                        )
                    tensors[name] = tensor.to(device=device, dtype=dtype)
        except CheckpointError:
            raise
        except Exception as error:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{file}: cannot read safetensors ({unreadable_reason(file, error)})") from None
    return tensors


def _has_own_head(tensors: dict[str, torch.Tensor]) -> bool:
    head, embedding = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    return head is not None and embedding is not None and not torch.equal(head, embedding)


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Decoder:
    """Build a ``Decoder`` from a Hugging Face checkpoint directory, weights cast to ``dtype``."""
    directory = Path(path)
    config = read_model_config(directory)
    listing, files = _weight_files(directory)
    with torch.device("meta"):  # the shapes each tensor must have
        expected = {name: param.shape for name, param in Decoder(config).state_dict().items()}
    tensors = _read_tensors(listing, files, expected, dtype, device)
    if config.tie_word_embeddings and _has_own_head(tensors):
        # As transformers 5 does: a saved head unlike the embedding is the model's head, untied.
        warnings.warn(f"{listing}: config.json ties the embeddings but lm_head.weight differs from "
                      "model.embed_tokens.weight; loading the saved head, untied, as transformers 5 does "
                      "(transformers 4 and vLLM use the embedding as the head: their logits differ from tether's; "
                      "final/ is saved untied)",
                      stacklevel=2)
        config = dataclasses.replace(config, tie_word_embeddings=False)
    if config.tie_word_embeddings:
        head = tensors.pop("lm_head.weight", None)  # the embedding is the head; a saved copy is redundant
        if "model.embed_tokens.weight" not in tensors and head is not None:
            tensors["model.embed_tokens.weight"] = head  # a tied checkpoint that stored the head alone
    return decoder_from_tensors(config, tensors, str(listing))


def decoder_from_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor], where: str) -> Decoder:
    """A ``Decoder`` of ``config`` whose parameters are ``tensors`` themselves (state-dict names; no
    random init). A tied model's head is its embedding: ``lm_head.weight`` may be absent. A missing
    or unknown tensor is a ``CheckpointError`` naming ``where``."""
    with torch.device("meta"):
        model = Decoder(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # assign=True replaced the shared tensor
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        name, kind, others = (missing[0], "missing", missing) if missing else (unexpected[0], "unexpected", unexpected)
        more = f" (and {len(others) - 1} more)" if len(others) > 1 else ""
        raise CheckpointError(f"{where}: {kind} tensor {name!r}{more}")
    return model


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    """Split in state-dict order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_bytes is None:
        return [tensors]
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        num_bytes = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + num_bytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += num_bytes
    return shards


def _remove_old_weights(directory: Path) -> None:
    """Saving over a checkpoint must not leave the other layout behind: ``load_model`` (and
    transformers) would prefer a stale ``model.safetensors`` over a fresh index."""
    stale = [directory / WEIGHTS_FILE, directory / INDEX_FILE, *directory.glob("model-*-of-*.safetensors")]
    for file in stale:
        file.unlink(missing_ok=True)


def generation_eos_ids(path: str | Path | None) -> tuple[int, ...]:
    """The end-of-sequence ids ``path/generation_config.json`` names (an int or a list: Llama 3's
    instruct models end a turn with ``<|eot_id|>`` beside the tokenizer's ``<|end_of_text|>``, Qwen's
    with ``<|im_end|>`` beside ``<|endoftext|>``), as transformers' ``generate`` and vLLM stop on them;
    () without that file or key. A file that is no JSON object, or ids that are no non-negative
    integers, are a one-line ``CheckpointError``."""
    if path is None or not (Path(path) / "generation_config.json").is_file():
        return ()
    file = Path(path) / "generation_config.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"{file}: not a readable JSON file ({unreadable_reason(file, error)})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    ids = data.get("eos_token_id")
    ids = [] if ids is None else [ids] if not isinstance(ids, list) else ids
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{file}: eos_token_id must be a token id or a list of them, "
                              f"got {data['eos_token_id']!r}")
    return tuple(ids)


def save_checkpoint(model: Decoder, tokenizer: Any, path: str | Path, source: str | Path | None = None) -> Path:
    """A run's checkpoint (``final/``): ``save_model``, the tokenizer, and the files of the ``source``
    checkpoint it was trained from that say how to generate with it (``CARRIED_FILES``:
    generation_config.json holds the end-of-turn ids and sampling defaults that transformers'
    ``generate`` and vLLM read, which config.json's ``eos_token_id`` may lack).

    Written whole into a sibling directory, then renamed into place: a run killed while saving
    leaves no ``path`` that looks complete but holds half its weights."""
    directory = Path(path)
    staging = directory.with_name(f".{directory.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)  # a save killed before this one
    save_model(model, staging)
    if source is not None and any((Path(source) / name).is_file() for name in TOKENIZER_FILES):
        _copy_tokenizer_files(Path(source), staging)
    else:
        _save_built_tokenizer(tokenizer, staging)
    for name in CARRIED_FILES if source is not None else ():
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, staging / name)
    if directory.exists():  # rename() replaces only an empty directory: set the old one aside first
        previous = directory.with_name(f".{directory.name}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        directory.rename(previous)
        staging.rename(directory)
        shutil.rmtree(previous)
    else:
        staging.rename(directory)
    return directory


# A tokenizer's files as checkpoints hold them (fast, sentencepiece, BPE, WordPiece, tiktoken; chat templates).
_TOKENIZER_CARRIED = (*TOKENIZER_FILES, "tokenizer_config.json", "merges.txt", "special_tokens_map.json",
                      "added_tokens.json", "chat_template.jinja", "chat_template.json")


def _copy_tokenizer_files(source: Path, target: Path) -> None:
    """The source checkpoint's tokenizer, byte for byte: tether never changes a tokenizer, and one
    re-saved by the installed transformers differs (transformers 5 writes a tokenizer_config.json
    that transformers 4, vLLM's, cannot load, and drops tokenizer.model, merges.txt, vocab.json)."""
    for name in _TOKENIZER_CARRIED:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    if (source / "additional_chat_templates").is_dir():
        shutil.copytree(source / "additional_chat_templates", target / "additional_chat_templates")


def _save_built_tokenizer(tokenizer: Any, target: Path) -> None:
    """A tokenizer tether built (the character tokenizer of a model from scratch), saved so that
    transformers 4 and 5 both load it: as the generic class (transformers 5 writes its own
    ``TokenizersBackend``, which 4 does not know) and without 5's load-time flags."""
    tokenizer.save_pretrained(target)
    path = target / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES:
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _save_readable(tensors: dict[str, torch.Tensor], file: Path, metadata: dict[str, str]) -> None:
    """``save_file``, then the mode of the ``config.json`` beside it (safetensors writes 0600: another
    user on a cluster, or a vLLM container of another uid, could not read the weights)."""
    save_file(tensors, str(file), metadata=metadata)
    file.chmod((file.parent / CONFIG_FILE).stat().st_mode & 0o777)


def save_model(model: Decoder, path: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` and safetensors (sharded with an index when over ``max_shard_bytes``)."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in model.state_dict().items()
        if not (model.config.tie_word_embeddings and name == "lm_head.weight")
    }
    hf = model.config.to_hf()
    dtype = next(iter(tensors.values())).dtype
    if dtype in _DTYPE_NAMES:
        hf["dtype"] = hf["torch_dtype"] = _DTYPE_NAMES[dtype]
    (directory / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    _remove_old_weights(directory)
    shards = _shards(tensors, max_shard_bytes)
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        _save_readable(shards[0], directory / WEIGHTS_FILE, metadata)
        return directory
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        shard_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_readable(shard, directory / shard_name, metadata)
        weight_map.update(dict.fromkeys(shard, shard_name))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return directory
