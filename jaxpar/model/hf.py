"""Hugging Face Llama checkpoints (``config.json`` + ``*.safetensors``) in and out of jaxpar.

Name and layout mapping (HF ``nn.Linear`` weights are stored ``[out, in]``; jaxpar keeps
``[in, out]`` with heads split out, and stacks the layers on a leading ``L`` axis):

=============================================  =============================  ==================
Hugging Face                                   jaxpar                         transform
=============================================  =============================  ==================
model.embed_tokens.weight ``[V, D]``           embed/table ``[V, D]``         as is
model.layers.N.input_layernorm.weight          layers/attn_norm/scale [N]     as is
model.layers.N.self_attn.q_proj.weight         layers/attn/wq [N] ``[D,H,Dh]``  ``w.T.reshape``
model.layers.N.self_attn.{k,v}_proj.weight     layers/attn/{wk,wv} [N]        ``w.T.reshape``
model.layers.N.self_attn.o_proj.weight         layers/attn/wo [N] ``[H,Dh,D]``  ``w.T.reshape``
model.layers.N.post_attention_layernorm.weight layers/mlp_norm/scale [N]      as is
model.layers.N.mlp.{gate,up,down}_proj.weight  layers/mlp/w_{gate,up,down}    ``w.T``
model.norm.weight                              head/norm/scale                as is
lm_head.weight ``[V, D]`` (absent when tied)   head/w_out ``[D, V]``          ``w.T``
=============================================  =============================  ==================

Rotary embeddings need no permutation: HF Llama's ``rotate_half`` pairs dimension ``i`` with
``i + Dh/2`` — the half-split convention of :func:`jaxpar.model.layers.rope` — and both use
frequencies ``theta^(-2i/Dh)``. Scaled RoPE variants (``rope_type`` other than ``default``),
attention/MLP biases and activations other than SiLU are refused clearly.

Before anything is read, :func:`check` holds the files to the model: every tensor it needs
present and of its shape, every tensor of a float dtype (F16, BF16, F32, F64: an integer or
quantised tensor is refused, not cast), and no tensor it does not have (a bias, an extra
layer: refused, not dropped), each stored once. Only ``rotary_emb.inv_freq`` buffers, which
older ``transformers`` saved and jaxpar computes from ``rope_theta``, are passed over.

Loading is lazy and layout-aware: each parameter is created with
``jax.make_array_from_callback`` in its target sharding, so a host reads only the tensors its
own devices need. BF16 tensors (which numpy cannot name) are read through a memory map of the
safetensors file with ``ml_dtypes.bfloat16``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar import typed
from jaxpar.config import ModelConfig
from jaxpar.errors import ConfigError, JaxparError
from jaxpar.model import hf_moe

Params = dict[str, Any]


@dataclass(frozen=True)
class _Entry:
    hf: str  # HF tensor name; "{i}" for the layer index
    path: tuple[str, ...]  # jaxpar param path
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    to_jax: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf

    @property
    def experts(self) -> bool:
        """One HF tensor per routed expert (``{x}``), stacked on jaxpar's leading ``E`` axis."""
        return "{x}" in self.hf

    def names(self, i: int | None, c: ModelConfig) -> list[str]:
        """The HF tensors of layer ``i`` (None: an unstacked entry)."""
        xs = range(c.moe.experts) if self.experts else [None]
        return [self.hf.format(i=i, x=x) for x in xs]

    def shape(self, c: ModelConfig) -> tuple[int, ...]:
        """jaxpar's shape of one layer's value."""
        one = self.to_jax(np.empty(self.hf_shape(c), np.float32), c).shape
        return (c.moe.experts, *one) if self.experts else one

    def read(self, reader: _Reader, i: int | None, c: ModelConfig) -> np.ndarray:
        """One layer's value in jaxpar's layout (experts stacked)."""
        ws = [self.to_jax(reader.get(name), c) for name in self.names(i, c)]
        return np.stack(ws) if self.experts else ws[0]

    def write(self, value: np.ndarray, i: int | None, c: ModelConfig) -> dict[str, np.ndarray]:
        """One layer's value as its HF tensors."""
        ws = list(value) if self.experts else [value]
        return {n: self.to_hf(w, c) for n, w in zip(self.names(i, c), ws, strict=True)}


def _same(w: np.ndarray, _: ModelConfig) -> np.ndarray:
    return w


def _t(w: np.ndarray, _: ModelConfig) -> np.ndarray:
    return np.ascontiguousarray(w.T)


def _heads_in(n_heads: Callable[[ModelConfig], int]):
    # [N*Dh, D] -> [D, N, Dh]
    return lambda w, c: np.ascontiguousarray(w.T.reshape(c.d_model, n_heads(c), c.hd))


def _heads_out(n_heads: Callable[[ModelConfig], int]):
    # [D, N, Dh] -> [N*Dh, D]
    return lambda w, c: np.ascontiguousarray(w.reshape(c.d_model, n_heads(c) * c.hd).T)


def _entries(c: ModelConfig) -> list[_Entry]:
    H = lambda c: c.n_heads  # noqa: E731
    K = lambda c: c.n_kv_heads  # noqa: E731
    L = "model.layers.{i}."
    out = [
        _Entry(
            "model.embed_tokens.weight",
            ("embed", "table"),
            lambda c: (c.vocab_size, c.d_model),
            _same,
            _same,
        ),
        _Entry(
            L + "input_layernorm.weight",
            ("layers", "attn_norm", "scale"),
            lambda c: (c.d_model,),
            _same,
            _same,
        ),
        _Entry(
            L + "self_attn.q_proj.weight",
            ("layers", "attn", "wq"),
            lambda c: (c.n_heads * c.hd, c.d_model),
            _heads_in(H),
            _heads_out(H),
        ),
        _Entry(
            L + "self_attn.k_proj.weight",
            ("layers", "attn", "wk"),
            lambda c: (c.n_kv_heads * c.hd, c.d_model),
            _heads_in(K),
            _heads_out(K),
        ),
        _Entry(
            L + "self_attn.v_proj.weight",
            ("layers", "attn", "wv"),
            lambda c: (c.n_kv_heads * c.hd, c.d_model),
            _heads_in(K),
            _heads_out(K),
        ),
        _Entry(
            L + "self_attn.o_proj.weight",
            ("layers", "attn", "wo"),
            lambda c: (c.d_model, c.n_heads * c.hd),
            lambda w, c: np.ascontiguousarray(w.T.reshape(c.n_heads, c.hd, c.d_model)),
            lambda w, c: np.ascontiguousarray(w.reshape(c.n_heads * c.hd, c.d_model).T),
        ),
        _Entry(
            L + "post_attention_layernorm.weight",
            ("layers", "mlp_norm", "scale"),
            lambda c: (c.d_model,),
            _same,
            _same,
        ),
        _Entry(
            L + "mlp.gate_proj.weight",
            ("layers", "mlp", "w_gate"),
            lambda c: (c.d_ff, c.d_model),
            _t,
            _t,
        ),
        _Entry(
            L + "mlp.up_proj.weight",
            ("layers", "mlp", "w_up"),
            lambda c: (c.d_ff, c.d_model),
            _t,
            _t,
        ),
        _Entry(
            L + "mlp.down_proj.weight",
            ("layers", "mlp", "w_down"),
            lambda c: (c.d_model, c.d_ff),
            _t,
            _t,
        ),
        _Entry(
            "model.norm.weight", ("head", "norm", "scale"), lambda c: (c.d_model,), _same, _same
        ),
    ]
    if not c.tied_embeddings:
        out.append(
            _Entry("lm_head.weight", ("head", "w_out"), lambda c: (c.vocab_size, c.d_model), _t, _t)
        )
    return hf_moe.entries(out, _Entry) if c.moe.enabled else out


# ---- config.json ------------------------------------------------------------------------------


# How a refusal names the directory: the field of ``jaxpar train``; ``eval`` and ``generate``
# pass their flag (``--init-from-hf``), which sets no such field.
FIELD = "train.init_from_hf"


def read_config(directory: str | Path, where: str = FIELD) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as a dict."""
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        gone = not Path(directory).exists()
        why = "does not exist" if gone else "is a file, expected a directory"
        raise ConfigError(f"{where}={str(directory)!r}: {why}")
    if not path.exists():
        raise ConfigError(f"{where}={str(directory)!r}: no config.json in the directory")
    data = typed.read_json(path, 1 << 20)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return data


def _rope(hf: dict[str, Any]) -> tuple[float, str]:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), str(kind)


def model_config(directory: str | Path, name: str | None = None, where: str = FIELD) -> ModelConfig:
    """A jaxpar :class:`ModelConfig` with the shape of the checkpoint in ``directory``."""
    hf = read_config(directory, where)
    try:
        return _model_config(hf, directory, name)
    except ConfigError:  # already one line naming the file (a ValueError too)
        raise
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as e:
        where = Path(directory) / "config.json"
        if isinstance(e, KeyError):
            raise ConfigError(f"{where}: {e.args[0]}: missing (Llama configs set it)") from None
        raise ConfigError(f"{where}: {e}") from None


def _model_config(hf: dict[str, Any], directory: str | Path, name: str | None) -> ModelConfig:
    _check_supported(hf, directory)
    d, h = _count(hf, "hidden_size"), _count(hf, "num_attention_heads")
    where = str(Path(directory) / "config.json")
    moe = hf_moe.config_fields(hf, where) if hf.get("model_type") == hf_moe.MODEL_TYPE else {}
    return ModelConfig(
        name=name or Path(directory).name,
        n_layers=_count(hf, "num_hidden_layers"),
        d_model=d,
        n_heads=h,
        n_kv_heads=_count(hf, "num_key_value_heads") if hf.get("num_key_value_heads") else h,
        d_ff=_count(hf, "intermediate_size"),
        vocab_size=_count(hf, "vocab_size"),
        max_seq_len=_count({"max_position_embeddings": 2048, **hf}, "max_position_embeddings"),
        head_dim=_count(hf, "head_dim") if hf.get("head_dim") not in (None, 0, d // h) else None,
        mlp="swiglu",
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=_rope(hf)[0],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        **moe,
    )


def _count(hf: dict[str, Any], key: str) -> int:
    """A positive integer field of config.json (refused naming the key otherwise)."""
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r}: must be a positive integer")
    return value


def _check_supported(hf: dict[str, Any], directory: str | Path) -> None:
    where = f"{Path(directory) / 'config.json'}"
    kind = hf.get("model_type", "llama")
    checks = [
        ("model_type", kind, lambda v: not hf_moe.refusal(v), hf_moe.refusal(kind)),
        ("hidden_act", hf.get("hidden_act", "silu"), lambda v: v == "silu", "must be 'silu'"),
        ("attention_bias", hf.get("attention_bias", False), lambda v: not v, "biases unsupported"),
        ("mlp_bias", hf.get("mlp_bias", False), lambda v: not v, "biases unsupported"),
        ("rope_type", _rope(hf)[1], lambda v: v == "default", "only unscaled RoPE is supported"),
    ]
    for key, value, ok, rule in checks:
        if not ok(value):
            raise ConfigError(f"{where}: {key}={value!r}: {rule}")


def check_config(directory: str | Path, cfg: ModelConfig, where: str = FIELD) -> None:
    """Refuse a checkpoint whose config.json disagrees with ``cfg`` (naming the field)."""
    if cfg.mlp != "swiglu":
        raise ConfigError(f"model.mlp={cfg.mlp!r}: Hugging Face Llama weights need 'swiglu'")
    theirs = model_config(directory, cfg.name, where)
    for f in ("n_heads", "n_kv_heads", "hd", "tied_embeddings", "rope_theta", "norm_eps"):
        a, b = getattr(theirs, f), getattr(cfg, f)
        if (abs(a - b) > 1e-12 * abs(b)) if isinstance(b, float) else a != b:
            raise ConfigError(
                f"model.{'head_dim' if f == 'hd' else f}={b!r}: the Hugging Face config.json in "
                f"{str(directory)!r} has {a!r}"
            )
    hf_moe.check_config(theirs, cfg, str(directory))


# ---- safetensors ------------------------------------------------------------------------------


class _Reader:
    """Tensors of every ``*.safetensors`` file of a directory, read on demand as numpy."""

    def __init__(self, directory: str | Path, where: str = FIELD):
        from safetensors import safe_open

        self.files = sorted(Path(directory).glob("*.safetensors"))
        if not self.files:
            raise ConfigError(f"{where}={str(directory)!r}: no *.safetensors files")
        self.where: dict[str, Path] = {}
        self.meta: dict[str, tuple[list[int], str]] = {}
        for p in self.files:
            # checked here, so safetensors itself never meets a truncated or garbage file
            for k, info in read_header(p).items():
                if k in self.where:  # which copy would be read would depend on file order
                    raise ConfigError(
                        f"{k}: in both {self.where[k].name} and {p.name}: a tensor must be "
                        f"stored once (in {directory})"
                    )
                self.where[k] = p
                self.meta[k] = (list(info["shape"]), info["dtype"])
        del safe_open

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.meta[name][0])

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32."""
        from safetensors import safe_open

        if self.meta[name][1] == "BF16":
            return _read_bf16(self.where[name], name).astype(np.float32)
        with safe_open(str(self.where[name]), framework="np") as f:
            return f.get_tensor(name).astype(np.float32)


# bytes per element of the safetensors dtypes
ST_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
             "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
             "F64": 8}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
_ST_ENTRY = {
    "dtype": typed.Rule(("str",), lambda v: v in ST_DTYPES, "not a safetensors dtype"),
    "shape": typed.Rule(
        ("list",),
        lambda v: all(typed._KINDS["int"](d) and d >= 0 for d in v),
        "must be a list of integers >= 0",
    ),  # fmt: skip
    "data_offsets": typed.Rule(
        ("list",),
        lambda v: len(v) == 2 and all(typed._KINDS["int"](x) for x in v) and 0 <= v[0] <= v[1],
        "must be [begin, end] with 0 <= begin <= end",
    ),
}


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors file's header, checked against the file: the header
    length, its JSON, each entry's dtype, shape and offsets, and that the offsets lie in the
    file and hold exactly ``prod(shape)`` elements. One ConfigError line otherwise."""
    why = typed.not_a_file(path)
    if why:
        raise ConfigError(f"{path}: {why}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{path}: {size} bytes: truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ConfigError(
                f"{path}: header length {n}: beyond the file's {size} bytes (truncated, or not "
                "a safetensors file)"
            )
        header = typed.parse_json(f.read(n), f"{path} (safetensors header)")
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: safetensors header: expected a JSON object")
    data = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        typed.check_record(f"{path}: tensor {name}", info, _ST_ENTRY)
        lo, hi = info["data_offsets"]
        want = int(np.prod(info["shape"], dtype=np.float64)) * ST_DTYPES[info["dtype"]]
        if hi > data:
            raise ConfigError(
                f"{path}: tensor {name}: data_offsets end {hi} beyond the {data} data bytes "
                "(the file is truncated)"
            )
        if hi - lo != want:
            raise ConfigError(
                f"{path}: tensor {name}: data_offsets hold {hi - lo} bytes, shape "
                f"{info['shape']} of {info['dtype']} needs {want}"
            )
        out[name] = info
    # safetensors itself refuses data bytes that no tensor covers, or tensors that overlap
    end = 0
    for name, info in sorted(out.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        lo, hi = info["data_offsets"]
        if lo != end:
            raise ConfigError(
                f"{path}: tensor {name}: data_offsets begin {lo}, expected {end} (tensors "
                "must cover the data bytes in order, without gaps or overlaps)"
            )
        end = hi
    if end != data:
        raise ConfigError(f"{path}: the tensors cover {end} of the {data} data bytes")
    return out


def _read_bf16(path: Path, name: str) -> np.ndarray:
    import ml_dtypes

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    info = read_header(path)[name]
    lo, hi = info["data_offsets"]
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n + lo, shape=(hi - lo,))
    return mm.view(ml_dtypes.bfloat16).reshape(info["shape"])


def _set(tree: Params, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _get(tree: Params, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


# The dtypes weights are read from (as float32); an integer or 8-bit float tensor is not a
# weight jaxpar can use as it is (quantised checkpoints need their own dequantisation).
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# Buffers older transformers saved beside the weights; jaxpar computes them (from rope_theta).
_BUFFERS = ("model.layers.{i}.self_attn.rotary_emb.inv_freq",)


def check(directory: str | Path, cfg: ModelConfig, where: str = FIELD) -> _Reader:
    """Refuse a checkpoint that does not fit ``cfg`` without reading tensor data (cheap enough
    to run before compiling anything): the config fields, then every tensor: each one the
    model needs present, of its shape and of a float dtype (:data:`FLOAT_DTYPES`), and no
    tensor the model does not have (which would be dropped without a word). ``where`` names
    the directory in a refusal (:data:`FIELD`, or the flag that gave it)."""
    check_config(directory, cfg, where)
    reader = _Reader(directory, where)
    expected: set[str] = set()
    for e in _entries(cfg):
        want = e.hf_shape(cfg)
        for i in range(cfg.n_layers) if e.stacked else [None]:
            for name in e.names(i, cfg):
                expected.add(name)
                if name not in reader.meta:
                    raise ConfigError(f"{name}: missing from the safetensors files in {directory}")
                if reader.shape(name) != want:
                    raise ConfigError(
                        f"{name}: shape {list(reader.shape(name))} does not match the model "
                        f"config (expected {list(want)})"
                    )
    buffers = {b.format(i=i) for b in _BUFFERS for i in range(cfg.n_layers)}
    for name, (shape, dtype) in sorted(reader.meta.items()):
        if name not in expected and name not in buffers:
            kind = "Mixtral" if cfg.moe.enabled else "Llama"
            raise ConfigError(
                f"{name}: shape {shape} in {reader.where[name].name}: not a tensor of this "
                f"model (a {kind} with this config.json has no such tensor; it would be "
                "ignored)"
            )
        if dtype not in FLOAT_DTYPES:
            raise ConfigError(
                f"{name}: dtype {dtype} in {reader.where[name].name}: weights must be stored "
                f"as a float type ({', '.join(FLOAT_DTYPES)}); a quantised or integer "
                "checkpoint is not read"
            )
    return reader


def load(directory: str | Path, cfg: ModelConfig, shardings: Any = None) -> Params:
    """jaxpar params from a Hugging Face Llama directory, placed with ``shardings``.

    ``shardings`` is a tree of ``NamedSharding`` like the params (e.g.
    ``Trainer.canonical_param_shardings``); without it the arrays go to the default device. A tensor
    whose shape disagrees with ``cfg`` raises a one-line :class:`ConfigError` naming it.
    """
    import jax

    reader = check(directory, cfg)
    entries = _entries(cfg)
    params: Params = {}
    for e in entries:

        def block(index, e=e) -> np.ndarray:
            if not e.stacked:
                return e.read(reader, None, cfg)[index]
            layers = range(*index[0].indices(cfg.n_layers))
            rest = index[1:]
            return np.stack([e.read(reader, i, cfg)[rest] for i in layers])

        shape = e.shape(cfg)
        if e.stacked:
            shape = (cfg.n_layers, *shape)
        sharding = _get(shardings, e.path) if shardings is not None else None
        if sharding is None:
            value = jax.numpy.asarray(block(tuple(slice(None) for _ in shape)))
        else:
            value = jax.make_array_from_callback(shape, sharding, block)
        _set(params, e.path, value)
    if cfg.moe.enabled:
        hf_moe.add_bias(params, cfg, shardings)
    return params


def _to_host(x: Any) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x, dtype=np.float32)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True), dtype=np.float32)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A ``LlamaForCausalLM`` (``MixtralForCausalLM`` for a MoE model) config.json for ``cfg``."""
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.hd,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": cfg.tied_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    return hf_moe.hf_config(cfg, out) if cfg.moe.enabled else out


def export(params: Params, cfg: ModelConfig, directory: str | Path) -> Path | None:
    """Write ``params`` as a Hugging Face Llama directory (fp32 ``model.safetensors``).

    Every process takes part in gathering sharded parameters; process 0 writes. Returns the
    directory on the writing process, None elsewhere.
    """
    import jax
    from safetensors.numpy import save_file

    if cfg.mlp != "swiglu":
        raise ConfigError(f"model.mlp={cfg.mlp!r}: Hugging Face Llama export needs 'swiglu'")
    if cfg.moe.enabled:
        hf_moe.check_shape(cfg)
        hf_moe.check_bias(_to_host(_get(params, hf_moe.BIAS)))
    tensors: dict[str, np.ndarray] = {}
    for e in _entries(cfg):
        value = _to_host(_get(params, e.path))
        if e.stacked:
            for i in range(cfg.n_layers):
                tensors.update(e.write(value[i], i, cfg))
        else:
            tensors.update(e.write(value, None, cfg))
    if jax.process_index() != 0:
        return None
    import shutil

    from jaxpar.lock import replace_dir, temp_name

    out = Path(directory)
    tmp = temp_name(out)
    try:
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / EXPORT_FILES[1]), metadata=EXPORT_METADATA)
        (tmp / EXPORT_FILES[0]).write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
        replace_dir(tmp, out)  # whole: no old shard or index is left beside the new weights
    except Exception as e:  # noqa: BLE001  (safetensors raises its own type for a full disk)
        reason = getattr(e, "strerror", None) or (str(e) or type(e).__name__).splitlines()[0]
        raise JaxparError(
            f"train.export_hf={str(directory)!r}: writing the export failed: {reason}; "
            f"{'the old directory is untouched' if out.exists() else 'nothing was written'}"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


EXPORT_FILES = ("config.json", "model.safetensors")
EXPORT_METADATA = {"format": "pt", "writer": "jaxpar"}


def check_export_target(directory: str | Path, force: bool = False) -> None:
    """Refuse an export into a directory that holds anything but an earlier jaxpar export (its
    two files, the weights marked as jaxpar's), unless ``force``; the export then replaces it
    whole. Checked before training, so the refusal never comes after the run."""
    out = Path(directory)
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"train.export_hf={str(directory)!r}: is a file, expected a directory")
    if force:
        return
    names = sorted(p.name for p in out.iterdir())
    ours = set(names) <= set(EXPORT_FILES)
    if ours and EXPORT_FILES[1] in names:
        try:
            meta = _metadata(out / EXPORT_FILES[1])
        except ConfigError:
            meta = {}
        ours = meta.get("writer") == EXPORT_METADATA["writer"]
    if not ours:
        raise ConfigError(
            f"train.export_hf={str(directory)!r}: holds files jaxpar's export did not write "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); choose an empty or "
            "new directory, or pass --force to replace it whole"
        )


def _metadata(path: Path) -> dict[str, Any]:
    read_header(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = typed.parse_json(f.read(n), str(path))
    meta = header.get("__metadata__") or {}
    return meta if isinstance(meta, dict) else {}
