"""The flat keyword view of `EngineConfig`: `LLM(model, max_num_seqs=...)`'s keywords
and the fields of `spur.actors.builder.EngineArgs`.

The schema (`spur.configs.schema`) is the one source of every engine setting's name,
default, bounds and docs. This module only *derives* the flat view from it, by
walking `EngineConfig`'s sections, so a field added to the schema appears here
without an edit:

```
EngineConfig                     flat keyword
  model.path                 ->  model              (the one rename: FLAT_RENAMES)
  model.dtype                ->  dtype
  cache.block_size           ->  block_size
  scheduler.max_num_seqs     ->  max_num_seqs
  ...                             (every leaf: its own name)
  speculative: None          ->  num_speculative_tokens=0 (off), prompt_lookup_* defaults
```

Two rules are not one-to-one, and both are here:

- `speculative` is optional in the tree; flat, `num_speculative_tokens=0` means off.
- `parallelism.device = "auto"` resolves to "cpu" (`resolve_device`): "auto" reserves
  no GPU in Ray, so there it means CPU; the workers need a real torch device.

Pure pydantic: no torch, no Ray.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from spur.configs.schema import EngineConfig, SpeculativeConfig

FLAT_RENAMES: dict[str, str] = {"model.path": "model"}
"""Schema path -> flat name, where the leaf's own name would not do ("path" says
nothing once the section is gone; vLLM and `LLM(model=...)` call it `model`)."""

SPECULATIVE = "speculative"
SPEC_SWITCH = "num_speculative_tokens"
"""Flat, the optional `speculative` section is on when this is above 0."""


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The model class of a section field (`X` or `X | None`), else None for a leaf."""
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def engine_paths() -> dict[str, tuple[str, str]]:
    """flat name -> (section, field) of every leaf of `EngineConfig`, in schema order.

    Raises:
        TypeError: two leaves would share a flat name (add one to FLAT_RENAMES), or the
            tree grew a level this flat view cannot show.
    """
    out: dict[str, tuple[str, str]] = {}
    for section, info in EngineConfig.model_fields.items():
        model = _section_type(info.annotation)
        if model is None:
            raise TypeError(f"EngineConfig.{section} is a leaf: engine settings live in sections")
        for name, leaf in model.model_fields.items():
            if _section_type(leaf.annotation) is not None:
                raise TypeError(f"EngineConfig.{section}.{name} nests a section: flatten it")
            flat = FLAT_RENAMES.get(f"{section}.{name}", name)
            if flat in out:
                raise TypeError(
                    f"{section}.{name} and {'.'.join(out[flat])} are both {flat!r} flat: "
                    "add one of them to FLAT_RENAMES"
                )
            out[flat] = (section, name)
    return out


def resolve_device(device: str) -> str:
    """The torch device type workers use: "auto" is CPU (see the module docstring)."""
    return "cpu" if device == "auto" else device


def flat_engine_args(engine: EngineConfig) -> dict[str, Any]:
    """Every engine setting of `engine` under its flat name (`engine_paths`): the
    keyword arguments of `spur.actors.builder.EngineArgs`. Does not mutate `engine`."""
    spec = engine.speculative
    out: dict[str, Any] = {}
    for flat, (section, name) in engine_paths().items():
        if section == SPECULATIVE:
            value = getattr(spec, name) if spec is not None else _spec_default(name)
        else:
            value = getattr(getattr(engine, section), name)
        out[flat] = value
    out["device"] = resolve_device(out["device"])
    return out


def _spec_default(name: str) -> Any:
    if name == SPEC_SWITCH:
        return 0  # off
    return SpeculativeConfig.model_fields[name].get_default(call_default_factory=True)


def engine_config(**flat: Any) -> EngineConfig:
    """The `EngineConfig` of flat keyword arguments (those of `LLM(...)`): each goes to
    its section, the rest keep the schema's defaults; `num_speculative_tokens` > 0 turns
    speculation on. Validated as a config file would be.

    Raises:
        ValueError: an unknown keyword (the message lists the valid ones), or a value the
            schema refuses (the message names the field and the bound).
    """
    paths = engine_paths()
    unknown = sorted(set(flat) - set(paths))
    if unknown:
        raise ValueError(
            f"unknown engine argument(s) {', '.join(unknown)}: valid ones are "
            f"{', '.join(paths)} (spur.configs.schema.EngineConfig, flattened)"
        )
    tree: dict[str, dict[str, Any]] = {}
    for flat_name, value in flat.items():
        section, name = paths[flat_name]
        tree.setdefault(section, {})[name] = value
    spec = tree.pop(SPECULATIVE, None)
    if spec is not None and spec.get(SPEC_SWITCH, 0):
        tree[SPECULATIVE] = spec
    try:
        return EngineConfig.model_validate(tree)
    except ValidationError as exc:
        from spur.configs.loader import format_errors  # the config file's wording

        raise ValueError(f"invalid engine arguments: {'; '.join(format_errors(exc))}") from None


DEFAULTS_FILE = Path(__file__).resolve().parent / "engine_defaults.json"
"""The flat defaults, generated from the schema (`python -m spur.configs.engine_args
--write`; a test keeps it fresh). Read only where pydantic is missing (the bare GPU
machine: `spur.actors.builder.EngineArgs.of`), never edited by hand."""


def flat_defaults() -> dict[str, Any]:
    """Every flat engine argument's schema default (`EngineConfig()` flattened)."""
    return flat_engine_args(EngineConfig())


def defaults_json() -> str:
    return json.dumps(flat_defaults(), indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`--write`: regenerate DEFAULTS_FILE; `--check`: exit 1 when it is stale."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--write"]:
        DEFAULTS_FILE.write_text(defaults_json())
        return 0
    if args == ["--check"]:
        fresh = DEFAULTS_FILE.exists() and DEFAULTS_FILE.read_text() == defaults_json()
        if not fresh:
            print(f"{DEFAULTS_FILE} is stale: run python -m spur.configs.engine_args --write")
        return 0 if fresh else 1
    print("usage: python -m spur.configs.engine_args --write | --check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
