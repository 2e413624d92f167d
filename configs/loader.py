"""YAML files and dicts -> `SpurConfig`, with errors a person can act on.

    load_config("configs/local.yaml")      file (or preset name) -> SpurConfig
    parse_config({...}, source="...")       mapping -> SpurConfig
    apply_overrides(cfg, {"server.port": 9000})   CLI flags -> new SpurConfig
    config_to_dict(cfg)                      JSON-safe dict, every default filled
    show(path)                               the resolved config as YAML text
    diff(file_config, live_dict)             where a file and a running app differ

Every failure is a `ConfigError` (a ValueError) listing each problem on its own
line with its full path:

    lanes[0].engine.cache.blok_size: unknown key 'blok_size'; did you mean 'block_size'?
    lanes[0].engine.cache.block_size: must be >= 1 (got 0)
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Hashable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from spur.configs.schema import PATTERN_HINTS, SpurConfig, format_size, is_size_field

PRESETS = ("local", "two-lanes", "gpu-h200-tp2")
"""Config files shipped inside the package (configs/<name>.yaml)."""

DEFAULT_PRESET = "local"
"""What `spur serve` runs without a config argument."""


class ConfigError(ValueError):
    """An invalid or unreadable configuration.

    `problems` holds one line per problem, each starting with the path it concerns;
    `str(error)` is the whole report, ready to print.
    """

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        if source is None:
            text = "\n".join(self.problems)
        elif len(self.problems) == 1:
            text = f"{source}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  {p}" for p in self.problems)
            text = f"{source}: {len(self.problems)} problems:\n{lines}"
        super().__init__(text)


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------


def preset_path(name: str) -> Path:
    """Path of the shipped preset `name` ("local", "two-lanes", "gpu-h200-tp2"; a
    trailing ".yaml" is accepted). Works from a checkout, an editable install and a wheel.

    Raises:
        ConfigError: unknown preset (the message lists them).
    """
    stem = name.removesuffix(".yaml")
    if stem not in PRESETS:
        raise ConfigError(
            [f"no preset is named {name!r} (presets: {', '.join(PRESETS)}){_hint(stem, PRESETS)}"]
        )
    return Path(str(resources.files("spur.configs").joinpath(f"{stem}.yaml")))


def resolve_path(path: str | Path) -> Path:
    """`path` itself when it exists, else the preset of that name ("local"); so
    `spur serve two-lanes` works from any directory.

    Raises:
        ConfigError: neither a file nor a preset.
    """
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    if candidate.exists():
        raise ConfigError([f"config file {path} is not a file"])
    if candidate.name.removesuffix(".yaml") in PRESETS and str(candidate.parent) == ".":
        return preset_path(candidate.name)
    raise ConfigError(
        [f"config file {path} does not exist (shipped presets: {', '.join(PRESETS)})"]
    )


class _DuplicateKey(yaml.constructor.ConstructorError):
    """A mapping key given twice."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML silently keeps
    the last, which hides stale values)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    # Keys written in this mapping must be unique; keys a merge (`<<: *base`) brings
    # in may be overridden by them, so the check runs before the merge is flattened.
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        line = key_node.start_mark.line + 1
        if not isinstance(key, Hashable):
            break  # construct_mapping reports unhashable keys with their position
        if key in seen:
            raise _DuplicateKey(
                None,
                None,
                f"key {key!r} appears twice (first on line {seen[key]}); keep one",
                key_node.start_mark,
            )
        seen[key] = line
    loader.flatten_mapping(node)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(text: str, source: str) -> Any:
    """Parse YAML text; duplicate keys are errors.

    Raises:
        ConfigError: a syntax error, with its line and column.
    """
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown place"
        what = exc.problem or exc.context or "invalid YAML"
        kind = "YAML error" if isinstance(exc, _DuplicateKey) else "YAML syntax error"
        raise ConfigError([f"{kind} at {where}: {what}"], source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"YAML error: {exc}"], source) from None


def load_config(path: str | Path) -> SpurConfig:
    """Read and validate a config file (or a preset name, see `resolve_path`).

    Raises:
        ConfigError: missing file, YAML syntax error, or invalid values (all listed).
    """
    resolved = resolve_path(path)
    try:
        text = resolved.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"config file {path} cannot be read: {exc}"]) from None
    return parse_config(read_yaml(text, str(path)), source=str(path))


def parse_config(data: Any, source: str = "config") -> SpurConfig:
    """Validate a mapping (parsed YAML or JSON) into a SpurConfig. An empty document
    (None) counts as an empty mapping. Does not mutate `data`.

    Raises:
        ConfigError: every problem, each with its full path, prefixed by `source`.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        sections = ", ".join(SpurConfig.model_fields)
        raise ConfigError(
            [
                f"the top level must be a mapping of sections ({sections}), not a "
                f"{type(data).__name__}"
            ],
            source,
        )
    try:
        return SpurConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(format_errors(exc), source) from None


# --------------------------------------------------------------------------------------
# Error messages
# --------------------------------------------------------------------------------------


def format_path(loc: tuple[Any, ...]) -> str:
    """("lanes", 0, "engine", "cache") -> "lanes[0].engine.cache"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", str(part)):
            out += f".{part}" if out else str(part)
        else:
            out += f"[{json.dumps(str(part))}]"
    return out


def _hint(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The config model found by following `loc` from the root, or None."""
    annotation: Any = SpurConfig
    for part in loc:
        model = _as_model(annotation)
        if model is not None:
            field = model.model_fields.get(str(part))
            if field is None:
                return None
            annotation = field.annotation
            continue
        args = [a for a in get_args(annotation) if a is not type(None)]
        origin = get_origin(annotation)
        if origin is list and args:
            annotation = args[0]
        elif origin is dict and len(args) == 2:
            annotation = args[1]
        else:
            return None
    return _as_model(annotation)


def _as_model(annotation: Any) -> type[BaseModel] | None:
    """`annotation` as a model class, looking through `X | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, type(int | None)):
        models = [a for a in get_args(annotation) if _as_model(a) is not None]
        if len(models) == 1:
            return _as_model(models[0])
    return None


def _is_size_field(loc: tuple[Any, ...]) -> bool:
    parent = _model_at(loc[:-1]) if loc else None
    field = parent.model_fields.get(str(loc[-1])) if parent else None
    return field is not None and is_size_field(field)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)


_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "string": "a string",
    "list": "a list",
    "dict": "a mapping",
    "model": "a mapping",
}

_BOUND_OPS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def _describe(err: Any, size: bool, secret: bool = False) -> Iterator[str]:
    """The message(s) for one pydantic error, without the path; `size`: the field is a
    byte size, so bounds show as "1MiB"; `secret`: the value may be a key pasted in the
    wrong place, so it is never shown."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    value = err.get("input")
    got = "" if secret else f" (got {_show(value)})"
    if kind in _BOUND_OPS:
        op, key = _BOUND_OPS[kind]
        bound = ctx[key]
        if size and isinstance(bound, int):
            shown = f"{value:,} bytes" if isinstance(value, int) else _show(value)
            yield f"must be {op} {format_size(bound)} (got {shown})"
        else:
            yield f"must be {op} {bound}{got}"
    elif kind == "missing":
        yield "required, but missing"
    elif kind == "literal_error":
        yield f"must be one of {ctx['expected']}{got}"
    elif kind in ("too_short", "string_too_short"):
        unit = "item" if kind == "too_short" else "character"
        n = ctx.get("min_length")
        if kind == "too_short" and "actual_length" in ctx:
            got = f" (got {ctx['actual_length']})"
        yield f"needs at least {n} {unit}{'s' if n != 1 else ''}{got}"
    elif kind in ("too_long", "string_too_long"):
        unit = "items" if kind == "too_long" else "characters"
        yield f"allows at most {ctx.get('max_length')} {unit}{got}"
    elif kind == "string_pattern_mismatch":
        pattern = ctx.get("pattern", "")
        yield f"must be {PATTERN_HINTS.get(pattern, f'a string matching {pattern}')}{got}"
    elif kind in ("value_error", "assertion_error"):
        error = ctx.get("error")
        yield from str(error).splitlines() if error is not None else [err["msg"]]
    elif kind == "int_from_float":
        yield f"must be a whole number{got}"
    elif kind.endswith(("_type", "_parsing")):
        word = _TYPE_WORDS.get(kind.split("_")[0], kind.split("_")[0])
        yield f"must be {word}{got}"
    else:
        yield f"{err['msg'][0].lower()}{err['msg'][1:]}{got}"


_NUMBER_BRANCHES = ("int", "float", "none")
"""pydantic's names of the branches of an `int | float | None` union in an error's path."""


def format_errors(exc: ValidationError) -> list[str]:
    """One line per problem of a SpurConfig validation, each "PATH: what is wrong".
    A value that fits no branch of a number union (int | float) is one problem, "must be
    a number", not one per branch under the branch's name."""
    lines = []
    numbers: set[tuple[Any, ...]] = set()
    for err in exc.errors(include_url=False):
        kind = err["type"]
        if kind == "default_factory_not_called":  # a consequence of another error
            continue
        loc = tuple(err["loc"])
        if loc and loc[-1] in _NUMBER_BRANCHES and kind.endswith("_type"):
            loc = loc[:-1]
            if loc in numbers:
                continue
            numbers.add(loc)
            err = {**err, "type": "float_type"}
        is_key = bool(loc) and loc[-1] == "[key]"
        if is_key:
            loc = loc[:-1]
        path = format_path(loc)
        if kind == "extra_forbidden":
            key = loc[-1]
            parent = _model_at(loc[:-1])
            fields = list(parent.model_fields) if parent else []
            hint = _hint(str(key), fields) or (
                f"; known keys: {', '.join(fields)}" if fields else ""
            )
            lines.append(f"{path}: unknown key {str(key)!r}{hint}")
            continue
        secret = loc[:2] == ("server", "auth")  # its values are named, never shown
        for message in _describe(err, size=_is_size_field(loc), secret=secret):
            if is_key:
                message = f"key {message}"
            if not path:
                lines.append(message)  # root validators write their own paths
            elif message.startswith("["):  # an index inside a list field: "[2]: ..."
                lines.append(f"{path}{message}")
            else:
                lines.append(f"{path}: {message}")
    return lines


# --------------------------------------------------------------------------------------
# Overrides, dumping, diffing
# --------------------------------------------------------------------------------------

_OVERRIDE_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)")


def apply_overrides(cfg: SpurConfig, overrides: Mapping[str, Any]) -> SpurConfig:
    """A new config with dotted-path values replaced, validated as a whole (cross-field
    rules included). Paths look like "server.port" or "lanes[0].replicas"; a value of
    None sets the field to null. `cfg` is not modified.

    Raises:
        ConfigError: a path that does not exist, or an invalid result.
    """
    data = config_to_dict(cfg)
    for dotted, value in overrides.items():
        node: Any = data
        steps: list[str | int] = []
        for piece in dotted.split("."):
            match = _OVERRIDE_PART.fullmatch(piece)
            if match is None:
                raise ConfigError([f"{dotted}: not a config path"], "overrides")
            steps.append(match.group(1))
            steps.extend(int(i) for i in re.findall(r"\d+", match.group(2)))
        for i, step in enumerate(steps):
            last = i == len(steps) - 1
            where = format_path(tuple(steps[: i + 1]))
            if isinstance(step, int):
                if not isinstance(node, list) or step >= len(node):
                    raise ConfigError([f"{where}: no such item"], "overrides")
            elif not isinstance(node, dict):
                raise ConfigError(
                    [f"{where}: {format_path(tuple(steps[:i]))} is not a section"], "overrides"
                )
            elif not last and node.get(step) is None:
                # An unset optional section (spare: null) gets filled from scratch.
                node[step] = {}
            if last:
                node[step] = value
            else:
                node = node[step]
    return parse_config(data, source="overrides")


def config_to_dict(cfg: SpurConfig) -> dict[str, Any]:
    """The config as JSON-safe data with every default filled in (what GET
    /admin/config serves). `parse_config(config_to_dict(cfg)) == cfg`: a lane with
    autoscaling has no `replicas` (a set `replicas` beside `autoscaling` is refused)."""
    data = cfg.model_dump(mode="json")
    for lane in data.get("lanes", ()):
        if lane.get("autoscaling") is not None:
            lane.pop("replicas", None)
    return data


def to_yaml(cfg: SpurConfig) -> str:
    """The config as YAML text in field order, every default filled in."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def show(path: str | Path) -> str:
    """`spur config show`: the resolved config of `path` as YAML, every default
    filled in, preceded by a comment naming the file. Loadable as a config itself.

    Raises:
        ConfigError: as `load_config`.
    """
    cfg = load_config(path)
    return f"# resolved from {path}\n{to_yaml(cfg)}"


_ABSENT = object()


def diff(file_config: SpurConfig | Mapping[str, Any], live_dict: Mapping[str, Any]) -> list[str]:
    """`spur config diff`: where a config (from a file) and a running deployment's
    GET /admin/config answer differ, one line each, in field order:

        lanes[0].engine.cache.block_size: file 16, running 32
        lanes[1]: file {"name": "reasoning", ...}, running (absent)

    `file_config` may be a SpurConfig or a dict already in `config_to_dict` form.
    Numbers compare by value (1 == 1.0). Empty when they agree. Mutates nothing.
    """
    left = config_to_dict(file_config) if isinstance(file_config, SpurConfig) else file_config
    lines: list[str] = []
    _diff(left, live_dict, (), lines)
    return lines


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def _brief(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = json.dumps(value, sort_keys=False, separators=(", ", ": "))
    return text if len(text) <= 80 else text[:76] + " ..."


def _diff(a: Any, b: Any, loc: tuple[Any, ...], out: list[str]) -> None:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in [*a, *(k for k in b if k not in a)]:
            _diff(a.get(key, _ABSENT), b.get(key, _ABSENT), (*loc, key), out)
    elif isinstance(a, list) and isinstance(b, list) and any(isinstance(x, Mapping) for x in a + b):
        for i in range(max(len(a), len(b))):
            _diff(a[i] if i < len(a) else _ABSENT, b[i] if i < len(b) else _ABSENT, (*loc, i), out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b) or not all(_same(x, y) for x, y in zip(a, b, strict=True)):
            out.append(f"{format_path(loc)}: file {_brief(a)}, running {_brief(b)}")
    elif not _same(a, b):
        out.append(f"{format_path(loc)}: file {_brief(a)}, running {_brief(b)}")
