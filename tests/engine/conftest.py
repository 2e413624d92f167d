"""Tokenizers the engine shell's tests share: SmolLM2's (byte-level BPE) and a tiny
Llama-2 style SentencePiece one with byte fallback (`helpers.sp_ids` spells text in it)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="session")
def smol():
    """The SmolLM2 tokenizer (GPT-2 style byte-level BPE)."""
    from spur.actors.worker.loader import resolve_model_dir

    path = resolve_model_dir("SmolLM2-135M-Instruct")
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def sentencepiece():
    """A tiny Llama-style tokenizer: '\u2581' marks spaces, characters missing from
    the vocabulary fall back to <0xNN> byte tokens, decode strips one leading
    space. Ids are built by hand (no merges): `sp.vocab_map` maps pieces to ids."""
    vocab = {"<unk>": 0, "</s>": 1}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in [
        "\u2581Hello",
        "\u2581world",
        "!",
        "\u2581The",
        "\u2581end",
        "\u2581word",
        "\u2581is",
        "\u2581and",
        "\u2581",
    ]:
        vocab[piece] = len(vocab)
    model = tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    tok = tokenizers.Tokenizer(model)
    d = tokenizers.decoders
    tok.decoder = d.Sequence(
        [d.Replace("\u2581", " "), d.ByteFallback(), d.Fuse(), d.Strip(" ", 1, 0)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    fast.vocab_map = vocab
    return fast
