"""An engine's tokenizer folder copied to the ingress's node (`builder.tokenizer_files`
on the engine, `tokenizer_cache.local_tokenizer_dir` on the ingress)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spur.actors import builder
from spur.actors.builder import load_tokenizer, tokenizer_files
from spur.cluster.tokenizer_cache import local_tokenizer_dir


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model folder: a word-level tokenizer with a chat template, weights, config."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(30)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    folder = tmp_path / "model"
    fast.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / ".cache").mkdir()
    return folder


def test_the_copy_loads_the_same_tokenizer_without_the_weights(
    model_dir: Path, tmp_path: Path
) -> None:
    files = tokenizer_files(str(model_dir))
    assert "model.safetensors" not in files and "config.json" in files
    assert "tokenizer.json" in files
    copy = local_tokenizer_dir(files, tmp_path / "cache")
    assert copy.parent == tmp_path / "cache"
    original, copied = load_tokenizer(str(model_dir)), load_tokenizer(str(copy))
    assert copied("w3 w4 w29")["input_ids"] == original("w3 w4 w29")["input_ids"] == [5, 6, 31]
    chat = [{"role": "user", "content": "w3"}]
    assert copied.apply_chat_template(chat, tokenize=False) == "w3 "
    # Written once per content: the same files give the same folder, others another.
    assert local_tokenizer_dir(files, tmp_path / "cache") == copy
    other = local_tokenizer_dir({**files, "config.json": b"{}"}, tmp_path / "cache")
    assert other != copy
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [copy.name, other.name]
    )  # no partial folder left behind


def test_bad_file_names_and_oversized_folders_are_refused(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("../evil.json", "sub/tokenizer.json", ".hidden"):
        with pytest.raises(ValueError, match="plain file name"):
            local_tokenizer_dir({name: b"{}"}, tmp_path / "cache")
    with pytest.raises(ValueError, match="no tokenizer files"):
        local_tokenizer_dir({}, tmp_path / "cache")
    assert not (tmp_path / "cache" / "..").joinpath("evil.json").exists()
    monkeypatch.setattr(builder, "TOKENIZER_FILES_MAX_BYTES", 1024)
    with pytest.raises(ValueError, match=r"engine\.model\.tokenizer"):
        tokenizer_files(str(model_dir))
