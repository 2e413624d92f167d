"""Requests' sampling defaults from the model's `generation_config.json`, as vLLM applies them.

A model's creator often recommends sampling settings (Qwen3: temperature 0.6, top_p
0.95, top_k 20) in the folder's `generation_config.json`. vLLM (`--generation-config
auto`, its default) uses six of its fields as the defaults of requests that leave them
out; `--generation-config vllm` ignores the file. spur does the same:

    engine.model.generation_config           "auto" (the file) | "vllm" (neutral defaults)
    engine.model.override_generation_config  the same keys, set over the file's

The fields: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens (the
default of max_tokens). Others (do_sample, ...) are not sampling defaults and are ignored,
as vLLM ignores them. `eos_token_id` is not a default either but, as in vLLM
(`SamplingParams.update_from_generation_config`), every id it lists ends a request that
does not set ignore_eos (`more_eos_token_ids`, `with_eos`): Llama 3.1 Instruct's
`<|eot_id|>` and Qwen2.5's `<|endoftext|>` are listed there, not as the model's first EOS.
The tokenizer's own EOS ends requests too, under either mode (`eos_ids`): as in vLLM it is
the request's EOS, so a folder whose configs name another id, or none, still ends a chat
turn where its tokenizer says it ends.
A request's own value always wins, except that an override's max_new_tokens caps every
request's max_tokens (vLLM's rule too). Values are checked where the engine is built
(`check_defaults`), so a bad file stops the engine at start with its path, not each request.

Pure: the standard library only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spur.actors.step import SamplingParams, SamplingParamsError

FILE_NAME = "generation_config.json"

FIELDS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json key -> SamplingParams field."""

MODES = ("auto", "vllm")


@dataclass(frozen=True)
class SamplingDefaults:
    """What a lane's requests take when they leave a field out.

    `values`: SamplingParams field -> value (temperature, top_p, top_k, min_p,
    repetition_penalty, max_tokens), only those the model or the override sets.
    `max_tokens_cap`: the override's max_new_tokens, which bounds every request's
    max_tokens, explicit ones included; None: no cap."""

    values: dict[str, Any] = field(default_factory=dict)
    max_tokens_cap: int | None = None

    def fill(self, params: dict[str, Any]) -> dict[str, Any]:
        """`params` (SamplingParams keyword arguments, a request's own) with the
        defaults added where the request left a field out (absent or None)."""
        out = dict(params)
        for name, value in self.values.items():
            if name != "max_tokens" and out.get(name) is None:
                out[name] = value
        return out

    def max_tokens(self, requested: int | None, fallback: int) -> int:
        """A request's max_tokens: its own (`requested`), else the model's default,
        else the server's `fallback`; then at most `max_tokens_cap`."""
        value = requested if requested is not None else self.values.get("max_tokens", fallback)
        if self.max_tokens_cap is not None:
            value = min(value, self.max_tokens_cap)
        return value

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the engine replica's stats); `from_dict` reads it back."""
        return {"values": dict(self.values), "max_tokens_cap": self.max_tokens_cap}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> SamplingDefaults:
        if not data:
            return cls()
        return cls(dict(data.get("values") or {}), data.get("max_tokens_cap"))


def read_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """The folder's generation_config.json as a dict; {} when there is none.

    Raises:
        ValueError: the file is not a JSON object (the message names the file and the
            way to ignore it).
    """
    path = Path(model_dir) / FILE_NAME
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{path} cannot be read as JSON ({exc}): fix the file, or set "
            "engine.model.generation_config: vllm to ignore it"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{path} holds a {type(data).__name__}, not a JSON object: fix the file, or set "
            "engine.model.generation_config: vllm to ignore it"
        )
    return data


def sampling_defaults(
    file_config: Mapping[str, Any], mode: str, overrides: Mapping[str, Any]
) -> SamplingDefaults:
    """The defaults of `mode` ("auto": the file's fields; "vllm": none) with `overrides`
    set over them. Keys other than FIELDS' are ignored in the file (it holds others:
    eos_token_id, do_sample, ...) and refused in `overrides` (the schema refuses them
    first; this guards the path without pydantic). A whole-number float where an integer
    is meant (top_k, max_new_tokens: `512.0`) is taken as that integer.

    Raises:
        ValueError: an unknown mode or override key (the message lists the valid ones).
    """
    if mode not in MODES:
        raise ValueError(f"generation_config={mode!r}: use one of {', '.join(MODES)}")
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise ValueError(
            f"override_generation_config: unknown key(s) {', '.join(unknown)}: "
            f"valid ones are {', '.join(FIELDS)}"
        )
    merged = {} if mode == "vllm" else dict(file_config)
    merged.update(overrides)
    values = {FIELDS[k]: _whole(v) for k, v in merged.items() if k in FIELDS and v is not None}
    cap = overrides.get("max_new_tokens")
    return SamplingDefaults(values, None if cap is None else _whole(cap))


def more_eos_token_ids(
    file_config: Mapping[str, Any] | None,
    model_config: Mapping[str, Any],
    mode: str,
    primary: int | None,
    source: str,
) -> tuple[int, ...]:
    """EOS ids beyond `primary` (the one every request stops at): under "auto" those of
    generation_config.json (`file_config`; None when the folder has no file, and then
    config.json's, `model_config`, as transformers' GenerationConfig.from_model_config
    takes them); under "vllm" none (vLLM's `--generation-config vllm` reads no file).

    Raises:
        ValueError: an eos_token_id that is not an id or a list of ids (names `source`).
    """
    if mode == "vllm":
        return ()
    config = model_config if file_config is None else file_config
    value = config.get("eos_token_id")
    if value is None:
        return ()
    ids = [value] if not isinstance(value, list) else value
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(
            f"{source}: eos_token_id {value!r} is not a token id or a list of them: fix it, "
            "or set engine.model.generation_config: vllm to ignore the model's file"
        )
    return tuple(dict.fromkeys(i for i in ids if i != primary))


def eos_ids(
    primary: int | None, more: tuple[int, ...], tokenizer: Any | None
) -> tuple[int | None, tuple[int, ...]]:
    """(the request's EOS id, the other EOS ids) as vLLM sets them: the tokenizer's
    `eos_token_id` is the request's own EOS (`InputPreprocessor.get_eos_token_id`: it
    ends a request with stop_reason None, and min_tokens masks it even under
    ignore_eos); the model's first EOS (`primary`, config.json's) joins `more` (the
    generation config's) when it differs. Without a tokenizer EOS, `primary` stays."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if not isinstance(eos, int) or isinstance(eos, bool) or eos < 0 or eos == primary:
        return primary, more
    others = (*more, primary) if primary is not None else more
    return eos, tuple(dict.fromkeys(i for i in others if i != eos))


def with_eos(params: SamplingParams, eos_ids: tuple[int, ...]) -> SamplingParams:
    """`params` stopping at `eos_ids` too (added to stop_token_ids, so min_tokens masks
    them and their text stays out of the output), unless it sets ignore_eos: then they
    stop nothing, and min_tokens masks them all the same (`masked_eos_token_ids`), as
    vLLM's min_tokens masks every stop id and EOS whatever ignore_eos says."""
    if not eos_ids:
        return params
    if params.ignore_eos:
        if params.min_tokens == 0 or params.masked_eos_token_ids == tuple(eos_ids):
            return params
        return dataclasses.replace(params, masked_eos_token_ids=tuple(eos_ids))
    merged = tuple(dict.fromkeys((*params.stop_token_ids, *eos_ids)))
    if merged == params.stop_token_ids:
        return params
    return dataclasses.replace(params, stop_token_ids=merged)


def _whole(value: Any) -> Any:
    """512.0 -> 512 (JSON writers differ); anything else unchanged."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def check_defaults(defaults: SamplingDefaults, source: str, from_file: bool = True) -> None:
    """Raise ValueError, naming `source` (where the values came from), the key (as the
    file spells it) and the fix, when a default is not a number or is out of
    SamplingParams' range. `from_file`: the model's generation_config.json is among the
    sources (the fix may be to ignore it)."""
    keys = {param: key for key, param in FIELDS.items()}
    fix = (
        "fix them, or set engine.model.generation_config: vllm to ignore the model's file"
        if from_file
        else "fix engine.model.override_generation_config"
    )

    def invalid(param: str, why: str) -> ValueError:
        return ValueError(
            f"the sampling defaults from {source} are invalid: {keys.get(param, param)}: {why}; "
            + fix
        )

    values = dict(defaults.values)
    for param, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid(param, f"{value!r} is not a number")
    try:
        SamplingParams(**values)
        if defaults.max_tokens_cap is not None:
            SamplingParams(max_tokens=defaults.max_tokens_cap)
    except SamplingParamsError as exc:
        raise invalid(exc.param, str(exc)) from None


def describe(defaults: SamplingDefaults) -> str:
    """What requests that leave fields out get, for a log line."""
    if not defaults.values:
        return "none (the neutral defaults: temperature 1, no top-p / top-k / min-p, no penalty)"
    parts = [f"{k}={v}" for k, v in sorted(defaults.values.items())]
    if defaults.max_tokens_cap is not None:
        parts.append(f"every request's max_tokens at most {defaults.max_tokens_cap}")
    return ", ".join(parts)


def startup_message(defaults: SamplingDefaults, mode: str, model: str) -> tuple[int, str]:
    """(logging level, message) the engine logs once it is built: a WARNING when there
    are defaults (they change what a request that leaves fields out gets; vLLM warns
    too, and a replica's INFO lines do not reach `spur serve`'s output), else INFO."""
    if not defaults.values:
        return logging.INFO, f"{model}: no sampling defaults (generation_config {mode})"
    where = (
        "the model's generation_config.json and engine.model.override_generation_config"
        if mode == "auto"
        else "engine.model.override_generation_config (the model's file is ignored)"
    )
    fix = " (set engine.model.generation_config: vllm to ignore the file)" if mode == "auto" else ""
    return (
        logging.WARNING,
        f"{model}: requests that leave them out get the sampling defaults "
        f"{describe(defaults)}, from {where}{fix}",
    )
