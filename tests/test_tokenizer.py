"""Demo tokenizer training and loading of tokenizer.json files written by transformers."""

from __future__ import annotations

import json

import pytest

from rhyme_jax.model.tokenizer import Tokenizer, TokenizerError, train_demo_tokenizer

CORPUS = [
    f"Q: Tom has {a} apples and buys {b} more, then gives away {c}. How many?\n"
    f"A: {a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}. The answer is {a + b - c}.\n"
    for a in range(3, 40, 3) for b in range(1, 25, 4) for c in (1, 2)
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_demo_tokenizer(CORPUS, 160, path), path


def test_round_trip(demo):
    tok, _ = demo
    for text in CORPUS[::7] + ["  has   many \n\n  more  ", "123 + 4567 = 4690"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text


def test_digits_are_single_tokens(demo):
    tok, _ = demo
    ids = tok.encode("The answer is 9081726354.")
    pieces = [tok.decode([i]) for i in ids]
    digits = [p for p in pieces if any(ch.isdigit() for ch in p)]
    assert digits == list("9081726354")
    # merges did learn multi-character words, so the digit split is not a side effect of no merges
    assert any(len(p.strip()) > 3 for p in pieces)


def test_special_ids_and_decode_skips_them(demo):
    tok, path = demo
    assert (tok.pad_id, tok.eos_id, tok.eos_ids) == (0, 1, (1,))
    assert tok.token_to_id("<pad>") == 0 and tok.token_to_id("<eos>") == 1
    vocab = json.loads(path.read_text())["model"]["vocab"]
    assert tok.vocab_size == len(vocab) <= 160
    text = "The answer is 12."
    assert tok.decode(tok.encode(text) + [tok.eos_id, tok.pad_id, tok.pad_id]) == text
    assert tok.decode([tok.pad_id] + tok.encode(text)) == text
    reloaded = Tokenizer.from_file(path)
    assert (reloaded.pad_id, reloaded.eos_id, reloaded.vocab_size) == (0, 1, tok.vocab_size)
    assert reloaded.encode(CORPUS[3]) == tok.encode(CORPUS[3])


def test_training_is_deterministic(tmp_path):
    a = train_demo_tokenizer(CORPUS, 160, tmp_path / "a.json")
    b = train_demo_tokenizer(CORPUS, 160, tmp_path / "b.json")
    ja, jb = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert ja["model"]["vocab"] == jb["model"]["vocab"] and ja["model"]["merges"] == jb["model"]["merges"]
    assert len(ja["model"]["merges"]) > 10
    assert a.encode(CORPUS[0]) == b.encode(CORPUS[0])


def test_unknown_characters_raise(demo):
    tok, _ = demo
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.encode("Tom has 3 \u00e9clairs")


def test_bad_inputs(tmp_path):
    with pytest.raises(TokenizerError, match="below"):
        train_demo_tokenizer(CORPUS, 8, tmp_path / "x.json")
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="bad.json"):
        Tokenizer.from_file(tmp_path / "bad.json")


def test_format_prompt(demo):
    tok, _ = demo
    assert tok.format_prompt("Q: {question}\nA:", "2+2?") == "Q: 2+2?\nA:"
    with pytest.raises(TokenizerError, match="question"):
        tok.format_prompt("{q}", "x")


def _hf_tokenizer(tmp_path, eos_token, pad_token, specials):
    """A tiny byte-level BPE saved by transformers' PreTrainedTokenizerFast.save_pretrained."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(CORPUS, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=eos_token, pad_token=pad_token)
    hf.save_pretrained(str(tmp_path))
    return hf


def test_from_file_on_transformers_tokenizer(tmp_path):
    hf = _hf_tokenizer(tmp_path, "<|im_end|>", "<|endoftext|>", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.eos_id == hf.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.pad_id == hf.convert_tokens_to_ids("<|endoftext|>") == 0
    assert tok.vocab_size == len(hf)
    text = "Q: Tom has 21 apples. \u00e9t\u00e9 \u2211 caf\u00e9!\n"  # byte-level: any text works
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode([1] + ids + [2]) == hf.decode([1] + ids + [2], skip_special_tokens=True)


def test_eos_from_generation_config_and_explicit(tmp_path):
    _hf_tokenizer(tmp_path, "</s>", None, ["<s>", "</s>", "<|eot_id|>"])
    assert Tokenizer.from_file(tmp_path).eos_ids == (1,)
    assert Tokenizer.from_file(tmp_path).pad_id == 1  # no pad token -> eos
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    assert Tokenizer.from_file(tmp_path).eos_ids == (2, 1)
    assert Tokenizer.from_file(tmp_path, eos_ids=(0,)).eos_id == 0
