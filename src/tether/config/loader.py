"""Turn YAML files and `a.b.c=value` overrides into a validated ``ExperimentConfig``.

Every failure becomes one ``ConfigError`` line naming the key: unknown keys get the closest valid
key, literals list the allowed values, ranges say the bound.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any

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
    """Read ``path`` (YAML; may be None for all defaults), apply overrides, validate."""
    values: dict[str, Any] = read_yaml(path) if path is not None else {}
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(values, key, value)
    return validate(values, source=str(path) if path else "config")


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
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
    """``trainer.lr=3e-4`` -> ("trainer.lr", 0.0003); the value is read as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. trainer.lr=3e-4")
    try:
        value = _yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def set_dotted(values: dict[str, Any], key: str, value: Any) -> None:
    node = values
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, not a section (override {key})")
        node = child
    node[parts[-1]] = value


def validate(values: dict[str, Any], source: str = "config") -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {describe_error(exc.errors()[0])}") from None


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
    if not key:  # a check across sections names its keys itself; the input is the whole config
        return message
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


def closest_key(loc: list[str]) -> str | None:
    if any(part.isdigit() for part in loc):  # inside a list (e.g. rewards.0.fnn): compare leaf names
        return None
    wanted = ".".join(loc)
    parent = ".".join(loc[:-1])
    keys = all_keys()
    siblings = [k for k in keys if k.rsplit(".", 1)[0] == parent] if parent else \
        [k for k in keys if "." not in k]
    match = difflib.get_close_matches(wanted, siblings, n=1, cutoff=0.5) or \
        difflib.get_close_matches(wanted, keys, n=1, cutoff=0.6)
    return match[0] if match else None


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
