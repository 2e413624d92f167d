"""The README's config reference, generated from the pydantic tree and its docstrings.

    python -m spur.configs.reference                 print the markdown
    python -m spur.configs.reference --write README.md   replace the marked section
    python -m spur.configs.reference --check README.md   exit 1 when it is stale

The README holds the reference between `BEGIN_MARKER` and `END_MARKER`; the field
descriptions are the attribute docstrings in `spur.configs.schema`, so a field
documented there is documented in the README after one `--write`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from spur.configs.schema import (
    PATTERN_HINTS,
    SpurConfig,
    format_size,
    is_size,
    is_size_field,
)

BEGIN_MARKER = (
    "<!-- BEGIN CONFIG REFERENCE (python -m spur.configs.reference --write README.md) -->"
)
END_MARKER = "<!-- END CONFIG REFERENCE -->"


def models_in_order(root: type[BaseModel] = SpurConfig) -> dict[type[BaseModel], list[str]]:
    """Every model reachable from `root`, depth first in field order, with the paths where
    it appears ("lanes[].engine.cache")."""
    found: dict[type[BaseModel], list[str]] = {}

    def visit(model: type[BaseModel], path: str) -> None:
        first = model not in found
        found.setdefault(model, []).append(path)
        for name, field in model.model_fields.items():
            for child, suffix in _nested_models(field.annotation):
                sub = f"{path}.{name}{suffix}" if path else f"{name}{suffix}"
                if first or child not in found:
                    visit(child, sub)
                else:
                    found[child].append(sub)

    visit(root, "")
    return found


def _nested_models(annotation: Any, suffix: str = "") -> Iterator[tuple[type[BaseModel], str]]:
    annotation = _strip(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, suffix
        return
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is list:
        yield from _nested_models(args[0], suffix + "[]")
    elif origin is dict:
        yield from _nested_models(args[1], suffix + "[*]")
    elif _is_union(annotation):
        for arg in args:
            yield from _nested_models(arg, suffix)


def _strip(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _metadata(annotation: Any) -> list[Any]:
    """Constraint objects attached to `annotation` through Annotated / FieldInfo."""
    out: list[Any] = []
    while get_origin(annotation) is Annotated:
        annotation, *extra = get_args(annotation)
        for item in extra:
            out.extend(item.metadata if isinstance(item, FieldInfo) else [item])
    return out


SIZE_TYPE = 'size (bytes or `"2GiB"`)'


def render_type(annotation: Any) -> str:
    """Markdown for a field's type: `int`, `"a" \\| "b"`, `list of str`, a link to a model."""
    if get_origin(annotation) is Annotated and is_size(annotation):
        return SIZE_TYPE
    annotation = _strip(annotation)
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(f"`{json.dumps(a)}`" for a in args)
    if origin is list:
        return f"list of {render_type(args[0])}"
    if origin is dict:
        return f"map of {render_type(args[0])} to {render_type(args[1])}"
    if _is_union(annotation):
        return " or ".join(render_type(a) for a in args)
    return f"`{getattr(annotation, '__name__', str(annotation))}`"


def _bounds(metadata: list[Any], size: bool = False) -> list[str]:
    def show(value: Any) -> str:
        return format_size(value) if size and isinstance(value, int) else f"{value:,}"

    out = []
    for item in metadata:
        if isinstance(item, at.Ge):
            out.append(f"≥ {show(item.ge)}")
        elif isinstance(item, at.Gt):
            out.append(f"> {show(item.gt)}")
        elif isinstance(item, at.Le):
            out.append(f"≤ {show(item.le)}")
        elif isinstance(item, at.Lt):
            out.append(f"< {show(item.lt)}")
        elif isinstance(item, at.MinLen) and item.min_length > 0:
            out.append(f"length ≥ {item.min_length}")
        elif isinstance(item, at.MaxLen):
            out.append(f"length ≤ {item.max_length}")
        elif getattr(item, "pattern", None):
            out.append(PATTERN_HINTS.get(item.pattern, f"matches `{item.pattern}`"))
    return out


def render_constraints(field: FieldInfo) -> str:
    """Bounds of the field itself and of its items, keys and values."""
    parts = _bounds(field.metadata, size=is_size_field(field))
    annotation = field.annotation
    if _is_union(annotation):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        annotation = inner[0] if len(inner) == 1 else annotation
    parts += _bounds(_metadata(annotation))
    base = _strip(annotation)
    origin, args = get_origin(base), get_args(base)
    inner = []
    if origin is list:
        inner = [("items", args[0])]
    elif origin is dict:
        inner = [("keys", args[0]), ("values", args[1])]
    for label, arg in inner:
        bounds = _bounds(_metadata(arg))
        if bounds:
            parts.append(f"{label}: {', '.join(bounds)}")
    return "; ".join(parts)


def render_default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        factory = field.default_factory
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            return "(its defaults)"
        if field.default_factory_takes_validated_data:
            return "(derived, see description)"
        return f"`{json.dumps(factory())}`"  # type: ignore[call-arg]
    if field.default is PydanticUndefined:
        return "**required**"
    if is_size_field(field) and isinstance(field.default, int):
        return f"`{format_size(field.default)}`"
    return f"`{json.dumps(field.default)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def model_table(model: type[BaseModel]) -> str:
    """One markdown table: field, type, default, constraints, description."""
    rows = [
        "| field | type | default | constraints | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, field in model.model_fields.items():
        # A bounded plain ByteSize keeps only `int` as its annotation (`is_size_field`).
        bare_size = is_size_field(field) and not is_size(field.annotation)
        kind = SIZE_TYPE if bare_size else render_type(field.annotation)
        rows.append(
            f"| `{name}` | {_cell(kind)} | "
            f"{_cell(render_default(field))} | {_cell(render_constraints(field))} | "
            f"{_cell(field.description or '')} |"
        )
    return "\n".join(rows)


def markdown_reference(root: type[BaseModel] = SpurConfig) -> str:
    """The config reference as markdown: per model, where it appears, its docstring and
    its table. Deterministic (the README check compares it byte for byte)."""
    out = [
        "Generated from `configs/schema.py`; every key below can appear in a config file. "
        "Unknown keys are errors. `spur config show FILE` prints a file with every "
        "default filled in.",
    ]
    for model, paths in models_in_order(root).items():
        out.append(f"### {model.__name__}")
        if paths != [""]:
            out.append("At " + ", ".join(f"`{p}`" for p in paths) + ".")
        doc = inspect.cleandoc(model.__doc__ or "")
        if doc:
            out.append(doc)
        out.append(model_table(model))
    return "\n\n".join(out) + "\n"


def replace_section(text: str, reference: str) -> str:
    """`text` with what lies between the markers replaced by `reference`.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    start, end = text.find(BEGIN_MARKER), text.find(END_MARKER)
    if start < 0 or end < start:
        raise ValueError(
            f"the file has no config reference section: add the lines\n{BEGIN_MARKER}\n"
            f"{END_MARKER}\nwhere the reference belongs"
        )
    head = text[: start + len(BEGIN_MARKER)]
    return f"{head}\n\n{reference}\n{text[end:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spur.configs.reference")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="README", help="replace the marked section")
    group.add_argument("--check", metavar="README", help="exit 1 if the section is stale")
    args = parser.parse_args(argv)
    reference = markdown_reference()
    target = args.write or args.check
    if target is None:
        sys.stdout.write(reference)
        return 0
    path = Path(target)
    try:
        text = path.read_text(encoding="utf-8")
        updated = replace_section(text, reference)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"{path}: {exc}\n")
        return 2
    if args.check:
        if updated != text:
            sys.stderr.write(
                f"{path}: the config reference is stale; run "
                f"python -m spur.configs.reference --write {path}\n"
            )
            return 1
        return 0
    path.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
