"""Turn YAML files and `a.b.c=value` overrides into a validated ``ExperimentConfig``.

Every failure becomes one ``ConfigError`` line naming the key: unknown keys get the closest valid
key, literals list the allowed values, ranges say the bound.
"""

from __future__ import annotations

import difflib
import json
import re
import textwrap
from collections.abc import Collection
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from tether.config.schema import ExperimentConfig
from tether.errors import ConfigError
from tether.rewards.loader import reward_file


class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats (``3e-4`` is a number, not a string) and duplicate keys as errors."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: keys written here override it
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                is_duplicate = key in seen
            except TypeError:  # a list or mapping as a key (`? [a, b]`)
                raise yaml.constructor.ConstructorError(
                    None, None, "a key must be a plain value, not a list or mapping", key_node.start_mark) from None
            if is_duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_YAML12_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X)


class _Dumper(yaml.SafeDumper):
    """Quotes a string that ``_Loader`` would read as a number (``name: '1e-4'``), so a saved
    config.yaml loads back to the same config."""


for _yaml_class in (_Loader, _Dumper):  # the same resolver reads and writes
    _yaml_class.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Read ``path`` (YAML; may be None for all defaults), apply overrides, validate. An error in a
    value an override set says "command line", not the file's name."""
    values: dict[str, Any] = read_yaml(path) if path is not None else {}
    given: list[str] = []  # dotted keys the overrides set
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(values, key, value)
        given.append(key)
    return validate(values, source=str(path) if path else "config", overrides=given)


def refuse_repeated_overrides(overrides: list[str] | tuple[str, ...]) -> None:
    """A key given twice on a command line is refused, as Hydra does: which one was meant? (The last
    won silently.) Programs composing overrides (a base list, then changes) call ``load_config``
    without this check: there the last one wins."""
    seen: set[str] = set()
    for item in overrides:
        key = parse_override(item)[0]
        if key in seen:
            raise ConfigError(f"command line: {key} is given twice; give it once")
        seen.add(key)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        hint = f"; did you mean {path / 'config.yaml'}?" if (path / "config.yaml").is_file() else ""
        raise ConfigError(f"{path} is a directory, not a config file{hint}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = _yaml_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """``trainer.lr=3e-4`` -> ("trainer.lr", 0.0003); the value is read as YAML, but a plain text that
    YAML would cut at a `` #`` (a comment) is kept whole: ``name=ablation #3``."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. trainer.lr=3e-4")
    if not all(part.strip() for part in key.split(".")):
        raise ConfigError(f"override {item!r}: an empty part in the key {key.strip()!r}, e.g. trainer.lr=3e-4")
    try:
        value = _yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    text = raw.strip()
    is_cut = (value is None or isinstance(value, str)) and value != text  # YAML read less than was written
    if is_cut and re.search(r"(^|\s)#", raw) and not text.startswith(("'", '"')):
        value = text
    return key.strip(), value


def set_dotted(values: dict[str, Any], key: str, value: Any) -> None:
    """Sets ``values[a][b][c] = value`` for ``key`` "a.b.c", making sections on the way; a numeric
    part indexes a list the config already holds (``rewards.0.weight=2``)."""
    node: Any = values
    parts = key.split(".")
    for i, part in enumerate(parts):
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{where}: {'.'.join(parts[:i])} is a list of {len(node)} (override {key}: "
                                  f"index it 0-{len(node) - 1}, or give the whole list)")
            part = int(part)
        elif not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(parts[:i])}: is a value, not a section (override {key})")
        elif part.isdigit() and node.get(part) is None and i > 0:
            raise ConfigError(f"{where}: the config gives no list {'.'.join(parts[:i])} to index (override "
                              f"{key}); give the whole list, e.g. {'.'.join(parts[:i])}=[...]")
        if i == len(parts) - 1:
            node[part] = value
            return
        child = node[part] if isinstance(node, list) else node.get(part)
        if child is None:
            child = node[part] = {}
        node = child


def validate(values: dict[str, Any], source: str = "config",
             overrides: Collection[str] = ()) -> ExperimentConfig:
    """The config from ``values``; an error in a key an override set (``overrides``: dotted keys)
    says "command line", else names ``source``."""
    try:
        return ExperimentConfig.model_validate(values)
    except ValidationError as exc:
        errors = exc.errors()  # an unknown key first: a misspelt one also leaves its real key missing
        error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        loc = ".".join(str(part) for part in error["loc"])
        message = describe_error(error)
        # A check across keys has no location: its message names the keys, as key=value.
        is_override = any((loc == key or loc.startswith(key + ".") or key.startswith(loc + ".")) if loc
                          else re.search(rf"(^|[\s(]){re.escape(key)}=", message) is not None
                          for key in overrides or ())
        raise ConfigError(f"{'command line' if is_override else source}: {message}") from None


def describe_error(err: dict[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    if len(loc) > 1 and loc[-1] in _UNION_TAGS:  # pydantic names the union member it tried last
        loc = loc[:-1]
    key = ".".join(loc)
    kind = err["type"]
    given = err.get("input")
    if kind == "extra_forbidden":
        hint = closest_key(loc)
        return f"unknown key '{key}'" + (f" (did you mean '{hint}'?)" if hint else "")
    if kind == "literal_error":
        allowed = err.get("ctx", {}).get("expected", "")
        return f"{key}: must be one of {allowed}, got {given!r}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bound = next(iter(err.get("ctx", {}).values()), "?")
        op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
              "less_than_equal": "<="}[kind]
        return f"{key}: must be {op} {bound}, got {given!r}"
    if kind == "missing":
        return f"{key}: required key is missing"
    if kind in _EXPECTED:
        return f"{key}: expected {_EXPECTED[kind]}, got {_short(given)}"
    message = err["msg"].removeprefix("Value error, ")
    if not key or (kind == "value_error" and isinstance(given, dict) and f"{key}." in message):
        return message  # a check across keys (of the config, of a section) that names its keys itself
    return f"{key}: {message}, got {_short(given)}"


_UNION_TAGS = ("int", "float", "str", "bool")
_EXPECTED = {
    "float_parsing": "a number", "float_type": "a number", "int_parsing": "an integer",
    "int_type": "an integer", "int_from_float": "an integer", "bool_parsing": "true or false",
    "bool_type": "true or false", "string_type": "a string", "dict_type": "a mapping of keys",
    "model_type": "a mapping of keys", "list_type": "a list", "tuple_type": "a list",
}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def all_keys(model: type[BaseModel] = ExperimentConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (sections and leaves)."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.extend(all_keys(annotation, dotted + "."))
    return keys


def config_reference(model: type[BaseModel] = ExperimentConfig, prefix: str = "") -> list[str]:
    """Every key of the schema with its default and help, for ``tether train --help``: one
    ``key = default`` line and its help indented beneath (a list's items under ``key.N.field``)."""
    lines: list[str] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.extend(config_reference(annotation, dotted + "."))
            continue
        item = get_args(annotation)[0] if get_origin(annotation) is list else None
        default = "required" if field.is_required() else json.dumps(
            field.get_default(call_default_factory=True), default=lambda value: value.model_dump())
        lines.append(f"  {dotted} = {default}")
        lines.extend(textwrap.wrap(field.description or "", 96, initial_indent="      ",
                                   subsequent_indent="      "))
        if isinstance(item, type) and issubclass(item, BaseModel):
            lines.extend(config_reference(item, dotted + ".N."))
    return lines


# The names TRL, verl and transformers' TrainingArguments give settings tether has under another key
# (a misspelling's nearest key is no help there: learning_rate is not min_lr_ratio).
OTHER_TOOLS_KEYS = {
    "learning_rate": "trainer.lr", "lr": "trainer.lr", "num_generations": "rollout.group_size",
    "n": "rollout.group_size", "rollout_n": "rollout.group_size",
    "max_completion_length": "rollout.max_new_tokens", "max_response_length": "rollout.max_new_tokens",
    "max_tokens": "rollout.max_new_tokens", "max_new_tokens": "rollout.max_new_tokens",
    "beta": "algorithm.kl_coef", "kl_coef": "algorithm.kl_coef", "kl_loss_coef": "algorithm.kl_coef",
    "kl_loss_type": "algorithm.kl_estimator", "max_grad_norm": "trainer.grad_clip",
    "grad_clip": "trainer.grad_clip", "epsilon": "algorithm.clip_low", "clip_ratio": "algorithm.clip_low",
    "clip_ratio_low": "algorithm.clip_low", "epsilon_high": "algorithm.clip_high",
    "clip_ratio_high": "algorithm.clip_high", "num_iterations": "algorithm.epochs_per_batch",
    "ppo_epochs": "algorithm.epochs_per_batch", "loss_type": "algorithm.loss_agg",
    "loss_agg_mode": "algorithm.loss_agg", "adv_estimator": "algorithm.advantage",
    "max_steps": "trainer.max_steps", "total_training_steps": "trainer.max_steps",
    "warmup_steps": "trainer.warmup_steps", "weight_decay": "trainer.weight_decay",
    "lr_scheduler_type": "trainer.schedule", "model_name_or_path": "model.path",
    "temperature": "rollout.temperature", "top_p": "rollout.top_p", "top_k": "rollout.top_k",
    "train_batch_size": "rollout.prompts_per_step",
    # micro-batches are cut by tokens and accumulated into one optimizer step
    "gradient_accumulation_steps": "trainer.micro_batch_tokens",
    "per_device_train_batch_size": "trainer.micro_batch_tokens",
    "ppo_micro_batch_size": "trainer.micro_batch_tokens",
}


def closest_key(loc: list[str]) -> str | None:
    """The valid key closest to an unknown one: another tool's name for a setting
    (``trainer.learning_rate`` -> ``trainer.lr``, ``OTHER_TOOLS_KEYS``); its leaf name among the
    fields of the section it was written in (list items included: ``rewards.0.wieght`` ->
    ``rewards.0.weight``), a prefix match first (``rollout.temp`` -> ``rollout.temperature``), else
    among every key of the schema."""
    parent, section = loc[:-1], _section_model(loc[:-1])
    leaf = loc[-1]
    if leaf in OTHER_TOOLS_KEYS and not any(part.isdigit() for part in loc):
        return OTHER_TOOLS_KEYS[leaf]
    if section is not None:
        names = list(section.model_fields)
        starts = [name for name in names if name.startswith(leaf)]
        match = starts[:1] if len(starts) == 1 else difflib.get_close_matches(leaf, names, n=1, cutoff=0.5)
        if match:
            return ".".join([*parent, match[0]])
    if any(part.isdigit() for part in loc):
        return None
    match = difflib.get_close_matches(".".join(loc), all_keys(), n=1, cutoff=0.6)
    return match[0] if match else None


def _section_model(path: list[str]) -> type[BaseModel] | None:
    """The pydantic model of the section at ``path`` (``["rewards", "0"]`` -> ``RewardSpec``), or None."""
    model: type[BaseModel] = ExperimentConfig
    parts = list(path)
    while parts:
        field = model.model_fields.get(parts.pop(0))
        if field is None:
            return None
        annotation = field.annotation
        if get_origin(annotation) is list and parts and parts[0].isdigit():
            parts.pop(0)
            annotation = get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def save_resolved(config: ExperimentConfig, run_dir: Path) -> Path:
    """Write the resolved config (every default filled in) into the run directory."""
    path = run_dir / "config.yaml"
    data = _with_absolute_paths(json.loads(config.model_dump_json()))
    path.write_text(RESOLVED_HEADER + yaml.dump(data, Dumper=_Dumper, sort_keys=False))
    return path


def _with_absolute_paths(data: dict[str, Any]) -> dict[str, Any]:
    """The config's relative paths that exist here (checkpoints, data files, reward files) made
    absolute, so that ``tether train RUN/config.yaml`` reruns the run from any directory. A name that
    is no local path (a ``datasets`` hub name, a module) is left as written."""
    def absolute(value: Any) -> Any:
        if isinstance(value, str) and value and not Path(value).is_absolute() and Path(value).exists():
            return str(Path(value).resolve())
        return value

    data["init_from"] = absolute(data.get("init_from"))
    data["model"]["path"] = absolute(data["model"].get("path"))
    for key in ("train", "eval"):
        data["data"][key] = absolute(data["data"].get(key))
    for reward in data.get("rewards", []):
        file = reward_file(str(reward.get("fn", "")))
        if file:
            reward["fn"] = f"{absolute(file[0])}:{file[1]}"
    return data


# The first line of every config.yaml tether writes: a run directory's own file, safe to rewrite.
RESOLVED_HEADER = "# resolved config written by tether (every default filled in)\n"


def is_resolved_config(path: Path) -> bool:
    """Whether ``path`` is a config.yaml that tether wrote (not a user's hand-written file)."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return f.readline() == RESOLVED_HEADER
    except OSError:
        return False
