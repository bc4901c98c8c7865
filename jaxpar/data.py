"""Deterministic, resumable batches placed sharded over ``dp`` from the start.

Every source is a flat token array with a held-out split. Row ``r`` of the batch of step ``i``
is a window at an offset drawn from ``numpy.random.default_rng((seed, i, r))``, so:

- the global batch of a step does not depend on the layout (equivalence tests rely on it);
- resuming at step ``i`` needs no saved iterator state beyond ``i`` itself;
- a host builds only the rows of the devices it owns (``jax.make_array_from_callback``), never
  the whole batch.

Sources: ``stdlib`` — the Python standard library's own ``.py`` files (present on every machine,
no download), byte-level tokens, files split train/held-out by a hash of their path;
``synthetic`` — a learnable stream (repeated random-stride counting); or a path to a ``.bin``
token file (memory-mapped).

Token files. ``jaxpar data prepare`` writes ``NAME.bin`` (the tokens, native little-endian) and
its sidecar ``NAME.json`` (:data:`SIDECAR_KEYS`: dtype, vocabulary size, tokenizer, token and
document counts, end-of-text id, split, and for a training file the name of its held-out
partner). With a sidecar, the dtype and vocabulary come from it; without one, the dtype is
``train.data_dtype`` and the vocabulary is the file's largest token id + 1 (not the dtype's
range, so a uint16 file fits a 50257-token model). The held-out split is ``train.eval_data``,
else the sidecar's ``validation_file``, else the file's last 5%. An empty file, a size that is not
a whole number of tokens, a sidecar that disagrees with its file, or a token id outside the
model's vocabulary is refused in one line before anything compiles.
"""

from __future__ import annotations

import functools
import json
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar import typed
from jaxpar.config import TOKEN_DTYPES
from jaxpar.errors import ConfigError

HELD_OUT_MOD = 20  # one file in 20 (by path hash) is held out of the stdlib corpus
HELD_OUT_TAIL = 0.05  # a token file without a held-out partner holds out its last 5%
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
SIDECAR_FORMAT = "jaxpar-tokens/1"
SIDECAR_KEYS = (
    "format", "dtype", "vocab_size", "tokenizer", "eos_id", "tokens", "documents", "split",
    "validation_fraction", "validation_file", "sources", "text_field",
)  # fmt: skip


@dataclass(frozen=True)
class Corpus:
    """Train and held-out token arrays (any integer dtype, possibly memory-mapped).

    ``vocab_size`` is what the data needs of the model, ``vocab_note`` says where that figure
    comes from (for error messages), ``tokenizer`` is the identity of the tokenizer that wrote
    the tokens (:func:`jaxpar.tokenizer.from_identity`), None when unknown.
    """

    train: np.ndarray
    heldout: np.ndarray
    vocab_size: int
    name: str
    vocab_note: str = ""
    tokenizer: dict[str, Any] | None = field(default=None)


def stdlib_files(max_bytes: int = 16_000_000) -> list[tuple[str, Path]]:
    """The standard library's ``.py`` files of the embedded corpus, sorted, up to ``max_bytes``
    (each counted with the two newlines that separate it from the next)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not (_SKIP_DIRS & set(p.parts)))
    out, total = [], 0
    for p in files:
        total += p.stat().st_size + 2
        if total > max_bytes:
            break
        out.append((p.relative_to(root).as_posix(), p))
    return out


@functools.lru_cache(maxsize=2)
def stdlib_corpus(max_bytes: int = 16_000_000) -> Corpus:
    """Byte-level corpus of the standard library's source files (train / held-out)."""
    train, held = [], []
    for rel, p in stdlib_files(max_bytes):
        data = p.read_bytes() + b"\n\n"
        (held if zlib.crc32(rel.encode()) % HELD_OUT_MOD == 0 else train).append(data)
    if not train or not held:
        root = sysconfig.get_paths()["stdlib"]
        raise ConfigError(f"train.data='stdlib': no Python sources found under {root}")
    as_arr = lambda chunks: np.frombuffer(b"".join(chunks), dtype=np.uint8)  # noqa: E731
    return Corpus(as_arr(train), as_arr(held), 256, "stdlib", "bytes", {"kind": "byte"})


def synthetic_corpus(vocab_size: int, n_tokens: int = 1 << 20, seed: int = 1234) -> Corpus:
    """A learnable stream: runs of ``start, start+k, start+2k, ...`` modulo the vocabulary."""
    rng = np.random.default_rng(seed)
    runs = n_tokens // 64
    starts = rng.integers(0, vocab_size, runs)[:, None]
    strides = rng.integers(1, 8, runs)[:, None]
    tokens = ((starts + strides * np.arange(64)[None, :]) % vocab_size).reshape(-1)
    tokens = tokens.astype(np.uint32)
    cut = int(len(tokens) * (1 - HELD_OUT_TAIL))
    return Corpus(tokens[:cut], tokens[cut:], vocab_size, "synthetic", "the model's vocabulary")


# ---- token files -----------------------------------------------------------------------------


def sidecar_path(bin_path: str | Path) -> Path:
    """``NAME.json`` beside ``NAME.bin``."""
    return Path(bin_path).with_suffix(".json")


def write_sidecar(bin_path: str | Path, record: dict[str, Any]) -> Path:
    """Write the sidecar of a token file (keys in :data:`SIDECAR_KEYS` order, stable bytes)."""
    unknown = set(record) - set(SIDECAR_KEYS)
    if unknown:
        raise ValueError(f"sidecar keys {sorted(unknown)}: not in SIDECAR_KEYS")
    ordered = {k: record.get(k) for k in SIDECAR_KEYS}
    ordered["format"] = SIDECAR_FORMAT
    from jaxpar.lock import write_atomic

    return write_atomic(sidecar_path(bin_path), (json.dumps(ordered, indent=2) + "\n").encode())


@dataclass(frozen=True)
class TokenFile:
    """A memory-mapped token file and what its sidecar (or its contents) say about it."""

    path: Path
    tokens: np.ndarray
    vocab_size: int
    vocab_note: str
    meta: dict[str, Any] | None  # the sidecar, None when there is none

    @property
    def tokenizer(self) -> dict[str, Any] | None:
        """The tokenizer identity of the sidecar, or None."""
        return (self.meta or {}).get("tokenizer")


def _tokenizer_identity(v: Any) -> bool:
    """A tokenizer identity as :meth:`jaxpar.tokenizer.Tokenizer.identity` writes it."""
    if v.get("kind") == "byte":
        return True
    return (
        v.get("kind") == "huggingface"
        and isinstance(v.get("path"), str)
        and bool(v["path"])
        and isinstance(v.get("sha256"), (str, type(None)))
    )


_COUNT = typed.Rule(("int", "None"), lambda v: v >= 0, "must be an integer >= 0", False)
SIDECAR_SCHEMA: dict[str, typed.Rule] = {
    "format": typed.Rule(("str",), lambda v: v == SIDECAR_FORMAT, f"must be {SIDECAR_FORMAT!r}"),
    "dtype": typed.Rule(("str",), lambda v: v in TOKEN_DTYPES, f"one of {', '.join(TOKEN_DTYPES)}"),
    "vocab_size": typed.Rule(("int",), lambda v: 0 < v <= 2**32, "must be in 1..2**32"),
    "tokens": typed.Rule(("int",), lambda v: v >= 0, "must be an integer >= 0"),
    "tokenizer": typed.Rule(
        ("dict", "None"),
        _tokenizer_identity,
        "must be {'kind': 'byte'} or {'kind': 'huggingface', 'path': ..., 'sha256': ...}",
        False,
    ),
    "eos_id": _COUNT,
    "documents": _COUNT,
    "split": typed.Rule(
        ("str", "None"),
        lambda v: v in ("all", "train", "validation"),
        "all, train or validation",
        False,
    ),
    "validation_fraction": typed.Rule(("float", "None"), lambda v: 0 <= v < 1, "in [0, 1)", False),
    # a name beside the sidecar, never a path: what a file names stays in its directory
    "validation_file": typed.Rule(
        ("str", "None"), typed.plain_name, "must be a file name in the sidecar's directory", False
    ),
    "sources": typed.Rule(("list", "None"), required=False),
    "text_field": typed.Rule(("str", "None"), required=False),
}
MAX_SIDECAR_BYTES = 1 << 20


def _read_sidecar(path: Path, where: str) -> dict[str, Any] | None:
    side = sidecar_path(path)
    if not side.exists():
        return None
    meta = typed.read_json(side, MAX_SIDECAR_BYTES)
    if not isinstance(meta, dict) or meta.get("format") != SIDECAR_FORMAT:
        raise ConfigError(
            f"{where}: {side} is not a jaxpar token sidecar (format != {SIDECAR_FORMAT!r}); "
            f"move it away to read {path.name} without one"
        )
    typed.check_record(str(side), meta, SIDECAR_SCHEMA)
    top = int(np.iinfo(np.dtype(meta["dtype"])).max)
    if meta["vocab_size"] > top + 1:
        raise ConfigError(
            f"{side}: vocab_size={meta['vocab_size']}: more ids than dtype={meta['dtype']} holds "
            f"({top + 1})"
        )
    return meta


def largest_id(tokens: np.ndarray) -> int:
    """The largest token id of a (memory-mapped) token array: one vectorised pass, in blocks
    of 64 Mi tokens so the pages it maps are released as it goes (cost: docs/reliability.md)."""
    block = 1 << 26
    return max(int(tokens[i : i + block].max()) for i in range(0, len(tokens), block))


def open_token_file(
    path: str | Path, dtype: str = "uint16", where: str = "train.data"
) -> TokenFile:
    """Memory-map a token file, checked against its sidecar (or ``dtype`` without one); the
    largest token id is read either way, so a sidecar's vocabulary is checked, not believed."""
    p = Path(path)
    why = typed.not_a_file(p)
    if why:
        raise ConfigError(f"{where}={str(path)!r}: token file {why}")
    meta = _read_sidecar(p, f"{where}={str(path)!r}")
    dt = np.dtype(meta["dtype"] if meta else dtype)
    size = p.stat().st_size
    if size == 0:
        raise ConfigError(f"{where}={str(path)!r}: empty token file (0 bytes)")
    if size % dt.itemsize:
        raise ConfigError(
            f"{where}={str(path)!r}: {size} bytes is not a whole number of {dt.name} tokens "
            f"({dt.itemsize} bytes each); "
            + ("the file is truncated" if meta else "another --data-dtype?")
        )
    tokens = np.memmap(p, dtype=dt, mode="r")
    top = largest_id(tokens)
    if meta:
        side = sidecar_path(p)
        if meta["tokens"] != len(tokens):
            raise ConfigError(
                f"{side}: tokens={meta['tokens']} but {p.name} holds {len(tokens)} {dt.name} tokens"
            )
        if top >= meta["vocab_size"]:
            raise ConfigError(
                f"{side}: vocab_size={meta['vocab_size']}: but {p.name} holds token id {top} "
                "(the sidecar does not describe this file)"
            )
        return TokenFile(p, tokens, meta["vocab_size"], f"sidecar {side.name}", meta)
    # No sidecar: the vocabulary the data needs is its largest id + 1.
    return TokenFile(p, tokens, top + 1, f"largest token id {top} in {p.name}", None)


def token_file_corpus(path: str, dtype: str, eval_path: str | None = None) -> Corpus:
    """A token file as a corpus; the held-out split is ``eval_path``, else the sidecar's
    ``validation_file``, else the file's last 5%."""
    train = open_token_file(path, dtype)
    if eval_path is None and train.meta and train.meta.get("validation_file"):
        # a plain name (SIDECAR_SCHEMA): the partner is beside the training file
        partner = train.path.parent / train.meta["validation_file"]
        eval_path = str(partner) if partner.exists() else None
    if eval_path is None:
        cut = int(len(train.tokens) * (1 - HELD_OUT_TAIL))
        tokens, held = train.tokens[:cut], train.tokens[cut:]
        vocab, note = train.vocab_size, train.vocab_note
    else:
        # Without a sidecar of its own, the held-out file has the training file's dtype.
        heldout = open_token_file(eval_path, train.tokens.dtype.name, "train.eval_data")
        if train.tokenizer and heldout.tokenizer and train.tokenizer != heldout.tokenizer:
            raise ConfigError(
                f"train.eval_data={eval_path!r}: written by another tokenizer than "
                f"train.data={path!r} ({heldout.tokenizer} vs {train.tokenizer})"
            )
        tokens, held = train.tokens, heldout.tokens
        # The file that needs the larger vocabulary names it; on a tie, the training file (a
        # tuple max would compare the notes and name whichever sorts last).
        bigger = heldout if heldout.vocab_size > train.vocab_size else train
        vocab, note = bigger.vocab_size, bigger.vocab_note
    return Corpus(tokens, held, vocab, train.path.name, note, train.tokenizer)


def load_corpus(
    data: str, vocab_size: int, dtype: str = "uint16", eval_data: str | None = None
) -> Corpus:
    """Resolve ``train.data`` (and ``train.eval_data``) to a corpus."""
    if data in ("stdlib", "synthetic") and eval_data is not None:
        raise ConfigError(f"train.eval_data={eval_data!r}: only with a token file as train.data")
    if data == "stdlib":
        corpus = stdlib_corpus()
    elif data == "synthetic":
        corpus = synthetic_corpus(vocab_size)
    else:
        corpus = token_file_corpus(data, dtype, eval_data)
    check_vocab(corpus, vocab_size)
    return corpus


def check_vocab(corpus: Corpus | TokenFile, model_vocab: int) -> None:
    """Refuse data whose tokens the model cannot embed (one line, before compiling)."""
    if corpus.vocab_size > model_vocab:
        raise ConfigError(
            f"model.vocab_size={model_vocab}: smaller than the data's vocabulary "
            f"{corpus.vocab_size} ({corpus.vocab_note}); use a model with vocab_size >= "
            f"{corpus.vocab_size}"
        )


class Batches:
    """Deterministic batches of ``[global_batch, seq_len + 1]`` windows (inputs + next token).

    ``rows(step, lo, hi, split)`` builds rows ``lo:hi`` of a step's batch; ``global_batch``
    rows make the whole batch. Held-out batches use negative step numbers so they never
    coincide with training batches.
    """

    def __init__(self, corpus: Corpus, global_batch: int, seq_len: int, seed: int):
        self.corpus, self.global_batch, self.seq_len, self.seed = (
            corpus,
            global_batch,
            seq_len,
            seed,
        )
        for split in ("train", "heldout"):
            if len(getattr(corpus, split)) <= seq_len + 1:
                raise ConfigError(
                    f"train.seq_len={seq_len}: longer than the {split} split of "
                    f"{corpus.name} ({len(getattr(corpus, split))} tokens)"
                )

    def rows(self, step: int, lo: int, hi: int, split: str = "train") -> np.ndarray:
        """Rows ``lo:hi`` of step ``step``'s batch as int32 ``[hi-lo, seq_len+1]``."""
        tokens = self.corpus.train if split == "train" else self.corpus.heldout
        span = len(tokens) - self.seq_len - 1
        tag = 0 if split == "train" else 1
        out = np.empty((hi - lo, self.seq_len + 1), np.int32)
        for i, r in enumerate(range(lo, hi)):
            start = int(np.random.default_rng((self.seed, tag, step, r)).integers(0, span))
            out[i] = tokens[start : start + self.seq_len + 1]
        return out

    def global_array(self, step: int, sharding, split: str = "train"):
        """The step's batch as one global ``jax.Array`` with ``sharding`` (rows over ``dp``).

        Each addressable device's callback builds only its own rows.
        """
        import jax

        shape = (self.global_batch, self.seq_len + 1)

        def cb(index):
            rows = index[0]
            lo, hi, _ = rows.indices(self.global_batch)
            block = self.rows(step, lo, hi, split)
            return block[:, index[1]]

        return jax.make_array_from_callback(shape, sharding, cb)


class SequentialBatches(Batches):
    """Every window of a token array in order, ``global_batch`` windows a step (evaluation).

    Window ``w`` is ``tokens[w·seq_len : w·seq_len + seq_len + 1]``: consecutive windows share
    one token, so each token but the first is predicted exactly once. ``steps`` full batches
    fit; the remainder (fewer than ``global_batch`` windows) is left out.
    """

    def __init__(self, tokens: np.ndarray, global_batch: int, seq_len: int, name: str):
        self.tokens, self.global_batch, self.seq_len = tokens, global_batch, seq_len
        self.steps = (len(tokens) - 1) // seq_len // global_batch
        if self.steps < 1:
            raise ConfigError(
                f"{name}: {len(tokens)} tokens hold no batch of {global_batch} windows of "
                f"seq_len {seq_len} (needs {global_batch * seq_len + 1}); lower --global-batch "
                "or --seq-len"
            )

    def rows(self, step: int, lo: int, hi: int, split: str = "heldout") -> np.ndarray:
        """Windows ``step·global_batch + lo .. + hi`` as int32 ``[hi-lo, seq_len+1]``."""
        out = np.empty((hi - lo, self.seq_len + 1), np.int32)
        for i, r in enumerate(range(lo, hi)):
            start = (step * self.global_batch + r) * self.seq_len
            out[i] = self.tokens[start : start + self.seq_len + 1]
        return out
