"""Tokenizers for data preparation, evaluation and sampling: bytes, or Hugging Face ``tokenizers``.

Two kinds, one interface (:class:`Tokenizer`):

- ``byte``: UTF-8 bytes are the tokens (vocabulary 256, the embedded corpus's encoding), every
  byte of a text, so ``decode(encode(text)) == text``. Byte 0 (NUL, absent from text) is also
  the end-of-document token, so a byte-level token file fits the default 256-token model;
  :func:`document_ids` therefore drops NUL characters from the documents of a token file (one
  would split its document), while a prompt keeps them (the model reads what it was given).
- a directory holding ``tokenizer.json`` (Hugging Face ``tokenizers``; e.g. a Llama
  checkpoint's own directory, or one written by :func:`train_bpe`). Its end-of-text token comes
  from ``tokenizer_config.json`` (``eos_token``), else ``config.json``/``generation_config.json``
  (``eos_token_id``), else a well-known name (``<|endoftext|>``, ``</s>``, ...).

Texts are encoded with the tokenizer's own special tokens (a Llama tokenizer prepends ``<s>``);
:func:`document_ids` appends the end-of-text token, so documents in a token file are separated
by it. Nothing here imports JAX (``jaxpar data`` never starts an accelerator).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from jaxpar.errors import ConfigError

BYTE = "byte"
EOT = "<|endoftext|>"  # the end-of-text token of tokenizers trained by train_bpe
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what train_bpe writes
# The largest vocabulary train_bpe accepts: its trainer holds a table per token and pair, and a
# 2**20-token vocabulary is four times the largest in use (Gemma's 262k).
MAX_VOCAB = 1 << 20
_EOS_NAMES = (EOT, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


class Tokenizer(Protocol):
    """What data preparation, evaluation and generation need from a tokenizer."""

    vocab_size: int
    eos_id: int | None

    def identity(self) -> dict[str, Any]:
        """JSON-able description that :func:`from_identity` turns back into the tokenizer."""
        ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (with the tokenizer's own special tokens)."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens dropped)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes, every one of them (NUL too); byte 0 ends a document."""

    vocab_size = 256
    eos_id = 0

    def identity(self) -> dict[str, Any]:
        return {"kind": BYTE}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # ids beyond the bytes (a model vocabulary above 256) are no text: left out
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer from ``DIR/tokenizer.json``."""

    def __init__(self, directory: str | Path, eos: str | None = None, where: str = "--tokenizer"):
        from tokenizers import Tokenizer as _Tok

        self.directory = Path(directory).resolve()
        path = self.directory / "tokenizer.json"
        if not self.directory.is_dir():
            raise ConfigError(f"{where}={str(directory)!r}: not a directory (or 'byte')")
        if not path.is_file():
            raise ConfigError(
                f"{where}={str(directory)!r}: no tokenizer.json in the directory (write one "
                "with `jaxpar data train-tokenizer`, or use 'byte')"
            )
        raw = path.read_bytes()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        try:
            self._tok = _Tok.from_str(raw.decode("utf-8"))
        except Exception as e:  # noqa: BLE001  (tokenizers raises its own exception types)
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                f"{where}={str(directory)!r}: unreadable tokenizer.json: {first}"
            ) from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(eos, where)

    def _find_eos(self, eos: str | None, where: str) -> int | None:
        if eos is not None:
            tid = self._tok.token_to_id(eos)
            if tid is None:
                raise ConfigError(f"--eos={eos!r}: not a token of {self.directory}/tokenizer.json")
            return tid
        cfg = _read_json(self.directory / "tokenizer_config.json")
        name = cfg.get("eos_token")
        if isinstance(name, dict):
            name = name.get("content")
        if isinstance(name, str) and self._tok.token_to_id(name) is not None:
            return self._tok.token_to_id(name)
        for fname in ("generation_config.json", "config.json"):
            tid = _read_json(self.directory / fname).get("eos_token_id")
            if isinstance(tid, list) and tid:
                tid = tid[0]
            if isinstance(tid, int) and 0 <= tid < self.vocab_size:
                return tid
        for name in _EOS_NAMES:
            if self._tok.token_to_id(name) is not None:
                return self._tok.token_to_id(name)
        return None

    def identity(self) -> dict[str, Any]:
        return {"kind": "huggingface", "path": str(self.directory), "sha256": self.sha256}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips character offsets (tokenizers >= 0.21): same ids, less work.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=True)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load(spec: str, eos: str | None = None, where: str = "--tokenizer") -> Tokenizer:
    """``'byte'`` or a directory with ``tokenizer.json``."""
    if spec == BYTE:
        if eos is not None:
            raise ConfigError(f"--eos={eos!r}: the byte tokenizer's end-of-text token is byte 0")
        return ByteTokenizer()
    return HFTokenizer(spec, eos, where)


def from_identity(identity: dict[str, Any] | None, where: str) -> Tokenizer | None:
    """The tokenizer a sidecar or checkpoint names (None when it names none)."""
    if not identity:
        return None
    if identity.get("kind") == BYTE:
        return ByteTokenizer()
    tok = HFTokenizer(identity.get("path", ""), where=where)
    if identity.get("sha256") not in (None, tok.sha256):
        raise ConfigError(
            f"{where}: {tok.directory}/tokenizer.json changed since the data was prepared "
            "(sha256 differs); pass --tokenizer to choose one explicitly"
        )
    return tok


def document_ids(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids followed by the end-of-text token (documents are separated by it). The
    byte tokenizer's end-of-text token is byte 0, so a NUL inside a text is dropped here: it
    would end the document early."""
    if isinstance(tok, ByteTokenizer):
        texts = [t.replace("\0", "") for t in texts]
    out = tok.encode_batch(texts)
    if tok.eos_id is not None:
        for ids in out:
            if not ids or ids[-1] != tok.eos_id:
                ids.append(tok.eos_id)
    return out


def check_vocab_size(vocab_size: int) -> None:
    """Refuse a BPE vocabulary size that cannot be trained: below 258 or above MAX_VOCAB."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 258:
        raise ConfigError(
            f"--vocab-size={vocab_size}: must be at least 258 (256 byte symbols, the "
            f"{EOT} token and one merge)"
        )
    if vocab_size > MAX_VOCAB:
        raise ConfigError(f"--vocab-size={vocab_size}: must be at most {MAX_VOCAB}")


def train_bpe(texts: Iterable[str], vocab_size: int, directory: str | Path) -> Path:
    """Train a byte-level BPE (GPT-2 style, ``<|endoftext|>`` = id 0) of ``vocab_size`` tokens
    on ``texts`` and write ``DIR/tokenizer.json`` and ``DIR/tokenizer_config.json``.

    The initial alphabet is all 256 bytes, so any text encodes; merges are learned until the
    vocabulary has ``vocab_size`` entries (fewer if the text runs out of pairs).
    """
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"eos_token": EOT, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / TOKENIZER_FILES[1]).write_text(json.dumps(config, indent=2) + "\n")
    return out
