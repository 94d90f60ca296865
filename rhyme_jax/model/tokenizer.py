"""Tokenizer wrapper over HF ``tokenizers`` (tokenizer.json) and the demo BPE trainer.

Real checkpoints: ``Tokenizer.from_file(<dir>/tokenizer.json)``; EOS comes from an explicit
argument, else ``generation_config.json`` / ``config.json`` / ``tokenizer_config.json`` next to the
file, else the first known end-of-text special token in the vocabulary. PAD is
``tokenizer_config.json``'s ``pad_token``, else ``<pad>`` if present, else EOS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Protocol, Sequence

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

# Conventional end-of-text tokens, most specific first (chat end before document end).
EOS_CANDIDATES = ("<eos>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "</s>")
DEMO_SPECIALS = ("<pad>", "<eos>", "<unk>")  # ids 0, 1, 2 in a demo tokenizer


class TokenizerError(ValueError):
    """A tokenizer file is missing/invalid, has no EOS, or text cannot be represented."""


class ChatPrompt(Protocol):
    """What ``Tokenizer.format_prompt`` needs of a chat template (``model.chat_template.ChatTemplate``)."""

    def prompt(self, question: str, system_prompt: str = "") -> str:
        """The rendered prompt of one user turn (after a system turn when ``system_prompt``)."""


class Tokenizer:
    """Text <-> token ids.

    Attributes:
      vocab_size: ids in the vocabulary including added/special tokens (a model's embedding may
        be larger, padded).
      eos_id: the id that ends a generation (first of ``eos_ids``).
      eos_ids: every id that ends a generation.
      pad_id: padding id (EOS when the tokenizer has no pad token).
      chat_template: the chat template prompts are rendered with (``model.chat_template``), or
        ``None``: ``format_prompt`` uses the string template.
      system_prompt: the system turn before each question under a chat template ("" = none).
    """

    def __init__(self, tok: _HFTokenizer, *, eos_ids: Sequence[int], pad_id: int | None = None,
                 source: str = "<tokenizer>"):
        if not eos_ids:
            raise TokenizerError(f"{source}: no EOS token found (pass eos_ids)")
        self._tok = tok
        self.source = source
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        for i in eos_ids:
            if not 0 <= int(i) < self.vocab_size:
                raise TokenizerError(f"{source}: eos id {i} outside vocabulary of {self.vocab_size}")
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.eos_id = self.eos_ids[0]
        self.pad_id = self.eos_id if pad_id is None else int(pad_id)
        unk = getattr(tok.model, "unk_token", None)
        self._unk_id = tok.token_to_id(unk) if unk else None
        self.chat_template: ChatPrompt | None = None  # set by use_chat_template
        self.system_prompt = ""

    @classmethod
    def from_file(cls, path, *, eos_ids: Sequence[int] | None = None) -> "Tokenizer":
        """Load a ``tokenizer.json`` (or a directory holding one).

        Args:
          path: file or directory.
          eos_ids: explicit EOS ids (e.g. ``ModelConfig.eos_token_ids``); None = discover.

        Raises:
          TokenizerError: file missing or unreadable, or no EOS can be determined.
        """
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"{file}: tokenizer file not found")
        try:
            tok = _HFTokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises a bare Exception with the serde message
            raise TokenizerError(f"{file}: not a valid tokenizer.json: {exc}") from None
        side = _side_files(file.parent)
        if not eos_ids:
            eos_ids = _discover_eos(tok, side)
        pad = _token_id(tok, side.get("pad_token"))
        if pad is None:
            pad = tok.token_to_id("<pad>")
        return cls(tok, eos_ids=eos_ids or (), pad_id=pad, source=str(file))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS or other special tokens are added.

        Raises:
          TokenizerError: ``text`` holds characters the vocabulary cannot represent (the model
            would emit its unknown token; only tokenizers without byte fallback, e.g. the demo one).
        """
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self._unk_id is not None and self._unk_id in ids:
            enc = self._tok.encode(text, add_special_tokens=False)
            bad = sorted({text[s:e] for i, (s, e) in zip(enc.ids, enc.offsets) if i == self._unk_id})
            raise TokenizerError(f"{self.source}: text contains characters outside the vocabulary: {bad}")
        return ids

    def decode(self, ids) -> str:
        """Text of ``ids`` (any int sequence / 1-D array), special tokens (EOS, PAD...) skipped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry, or None."""
        return self._tok.token_to_id(token)

    def use_chat_template(self, chat: ChatPrompt | None, system_prompt: str = "") -> "Tokenizer":
        """Render prompts with ``chat`` from now on (``format_prompt``; ``model.chat_template``),
        after a system turn ``system_prompt`` when it is not empty; ``None`` = the string template.
        Returns ``self``."""
        self.chat_template, self.system_prompt = chat, system_prompt
        return self

    def format_prompt(self, template: str, question: str) -> str:
        """The prompt text of ``question``: ``template.format(question=question)``, or, when a
        chat template is in use (``use_chat_template``), that template rendered on the user turn
        ``question`` with the generation prompt (``template`` is then unused).

        Raises:
          TokenizerError: the template has other fields or bad braces, or the chat template
            fails to render (``ChatTemplateError``).
        """
        if self.chat_template is not None:
            return self.chat_template.prompt(question, self.system_prompt)
        try:
            return template.format(question=question)
        except (KeyError, IndexError, ValueError) as exc:
            raise TokenizerError(
                f"prompt template {template!r}: only the field {{question}} is allowed ({exc!r})") from None

    def save(self, path) -> None:
        """Write ``tokenizer.json`` to ``path`` (a file path)."""
        self._tok.save(str(path))


def train_demo_tokenizer(texts: Iterable[str], vocab_size: int, path) -> Tokenizer:
    """Train the demo byte-level BPE tokenizer and write it to ``path`` (tokenizer.json).

    Digits are always single tokens (``Digits(individual_digits=True)`` before the byte-level
    split, so merges never join digits); whitespace is kept (ByteLevel), so
    ``decode(encode(x)) == x`` for text made of characters seen in ``texts``. Special tokens:
    ``<pad>`` = 0, ``<eos>`` = 1, ``<unk>`` = 2 (``encode`` raises on unseen characters rather
    than emitting it). The alphabet is the corpus's characters (so small vocabularies work);
    training is deterministic for a given corpus order.

    Args:
      texts: training corpus.
      vocab_size: target vocabulary size including specials and the alphabet.
      path: output file, or a directory (then ``<path>/tokenizer.json``).

    Raises:
      TokenizerError: ``vocab_size`` smaller than specials + alphabet, or empty corpus.
    """
    texts = list(texts)
    if not texts:
        raise TokenizerError("train_demo_tokenizer: empty corpus")
    tok = _HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(DEMO_SPECIALS),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    alphabet_plus = tok.get_vocab_size(with_added_tokens=True)
    if alphabet_plus > vocab_size:
        raise TokenizerError(
            f"train_demo_tokenizer: vocab_size={vocab_size} is below the {alphabet_plus} "
            "specials + corpus characters it needs")
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    file.parent.mkdir(parents=True, exist_ok=True)
    from rhyme_jax.io.atomic import atomic_write

    # Atomic: the processes of a multi-host run may all write the same (deterministic) file.
    with atomic_write(file, "w") as fh:
        fh.write(tok.to_str())
    return Tokenizer(tok, eos_ids=(1,), pad_id=0, source=str(file))


def _side_files(directory: Path) -> dict:
    """eos/pad hints from generation_config.json, config.json and tokenizer_config.json."""
    out: dict = {}
    for name in ("tokenizer_config.json", "config.json", "generation_config.json"):  # later wins for eos
        f = directory / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"{f}: not valid JSON: {exc}") from None
        if name == "tokenizer_config.json":
            for key in ("eos_token", "pad_token"):
                if data.get(key) is not None:
                    out[key] = data[key]
        elif data.get("eos_token_id") is not None:
            out["eos_token_id"] = data["eos_token_id"]
    return out


def _token_id(tok: _HFTokenizer, token) -> int | None:
    if isinstance(token, dict):  # serialized AddedToken
        token = token.get("content")
    return tok.token_to_id(token) if isinstance(token, str) else None


def _discover_eos(tok: _HFTokenizer, side: dict) -> tuple[int, ...]:
    ids: list[int] = []
    explicit = side.get("eos_token_id")
    if explicit is not None:
        ids += explicit if isinstance(explicit, list) else [explicit]
    named = _token_id(tok, side.get("eos_token"))
    if named is not None and named not in ids:
        ids.append(named)
    if not ids:
        specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        for cand in EOS_CANDIDATES:
            tid = tok.token_to_id(cand)
            if tid is not None and (cand in specials or not specials):
                ids.append(tid)
                break
    return tuple(int(i) for i in ids)
