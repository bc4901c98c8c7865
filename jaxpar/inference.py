"""Weights for ``jaxpar eval`` and ``jaxpar generate``: a jaxpar checkpoint or a Hugging Face
Llama directory, read into any layout, with the tokenizer that goes with them.

The model shape comes from the checkpoint's own record (``<step>/meta/metadata``, read as JSON
before JAX starts, so the layout can be validated first) or from ``config.json``. Only the
parameters are read from a checkpoint (orbax partial restore: no optimizer state in memory),
straight into the shardings of the requested layout, whatever layout wrote them; the step must
pass jaxpar's integrity check (:func:`jaxpar.checkpoint.verify_step`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxpar import config as C
from jaxpar import tokenizer as T
from jaxpar import validation as V
from jaxpar.errors import CheckpointError, ConfigError


def add_arguments(p: argparse.ArgumentParser, layout_flags: tuple[str, ...]) -> None:
    """Where the weights come from, the tokenizer, the devices and the layout flags (names of
    :data:`jaxpar.commands.train.FLAGS`)."""
    from jaxpar.commands.flags import FLAGS

    g = p.add_argument_group("weights (one of)")
    g.add_argument("--checkpoint-dir", default=None, help="a jaxpar checkpoint directory")
    g.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    g.add_argument("--init-from-hf", default=None, help="a Hugging Face Llama directory")
    p.add_argument(
        "--model", default=None, help="model name or YAML (default: the weights' own shape)"
    )
    p.add_argument("--mesh", default="cpu-8", help="mesh name or YAML (hardware figures)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="'byte' or a directory with tokenizer.json (default: the one the data was "
        "prepared with, or the Hugging Face directory's own)",
    )
    p.add_argument(
        "--devices", type=int, default=None, help="devices to simulate on CPU (default: layout)"
    )
    for name in layout_flags:
        _, typ, text = FLAGS[name]
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=text)
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last line")


def newest_step(directory: Path) -> int | None:
    """Newest step directory that passes the size check of its manifest."""
    from jaxpar.checkpoint import verify_step

    # ASCII digits only: str.isdigit also accepts e.g. '²', which int() refuses
    names = [d.name for d in directory.iterdir() if d.name.isascii() and d.name.isdigit()]
    steps = sorted(map(int, names), reverse=True)
    return next((s for s in steps if verify_step(directory / str(s), full=False) is None), None)


def checkpoint_record(directory: str, step: int | None) -> tuple[int, dict[str, Any]]:
    """The step to read and its JSON record (model shape, layout, data, tokenizer)."""
    from jaxpar.checkpoint import verify_step

    d = Path(directory)
    where = f"--checkpoint-dir={directory!r}"
    if not d.is_dir():
        raise ConfigError(f"{where}: not a directory")
    step = newest_step(d) if step is None else step
    if step is None:
        raise CheckpointError(f"{where}: no complete checkpoint")
    why = verify_step(d / str(step))
    if why is not None:
        raise CheckpointError(f"{where}: step {step}: {why}")
    from jaxpar import typed
    from jaxpar.data import SIDECAR_SCHEMA

    try:
        meta = typed.read_json(d / str(step) / "meta" / "metadata")
        schema = {
            "model": typed.Rule(("dict",)),
            "data": typed.Rule(("dict", "None"), required=False),
            "tokenizer": SIDECAR_SCHEMA["tokenizer"],
        }
        return step, typed.check_record(f"{where}: step {step} record", meta, schema)
    except ConfigError as e:
        raise CheckpointError(f"{where}: step {step}: unreadable record ({e})") from None


@dataclass
class Source:
    """Resolved weights: the run config (model shape + layout), where the weights are, and the
    tokenizer identity that goes with them."""

    cfg: C.RunConfig
    checkpoint_dir: str | None
    step: int | None
    hf_dir: str | None
    tokenizer: dict[str, Any] | None
    data: str | None  # the training data of a checkpoint


def resolve(args: argparse.Namespace, layout_flags: tuple[str, ...], **layout: Any) -> Source:
    """Model shape and layout from the flags and the weights' record; validated, JAX not
    started. ``layout`` holds defaults (e.g. ``dp=1``) that flags override."""
    from jaxpar.commands.flags import FLAGS
    from jaxpar.model import hf

    ck, hf_dir = args.checkpoint_dir, args.init_from_hf
    if (ck is None) == (hf_dir is None):
        raise ConfigError("--checkpoint-dir / --init-from-hf: give exactly one of them")
    cfg = C.load(args.model or "tiny", args.mesh)
    step, tok, data = None, None, None
    if ck is not None:
        step, meta = checkpoint_record(ck, args.step)
        saved = meta.get("model", {})
        if args.model is None:
            known = {f for f in C.ModelConfig.__dataclass_fields__}
            cfg.model = C.ModelConfig(**{k: v for k, v in saved.items() if k in known})
        else:
            from jaxpar.checkpoint import check_model_matches

            check_model_matches(meta, cfg.model)
        tok = meta.get("tokenizer")
        data = meta.get("data", {}).get("source")
        if tok is None and data == "stdlib":
            tok = {"kind": T.BYTE}
    else:
        if args.step is not None:
            raise ConfigError("--step: only with --checkpoint-dir")
        if args.model is None:
            cfg.model = hf.model_config(hf_dir, where="--init-from-hf")
        # config.json and every tensor header, before JAX starts
        hf.check(hf_dir, cfg.model, where="--init-from-hf")
        if (Path(hf_dir) / "tokenizer.json").is_file():
            tok = T.HFTokenizer(hf_dir, where="--init-from-hf").identity()
    saved_data = meta.get("data", {}) if ck is not None else {}
    # Batch shape: the checkpoint's training one (flags override), within the context.
    cfg.train.global_batch = saved_data.get("global_batch", cfg.train.global_batch)
    cfg.train.seq_len = min(saved_data.get("seq_len", cfg.train.seq_len), cfg.model.max_seq_len)
    lay = C.LayoutConfig(
        dp=1, tp=1, pp=1, sp=1, zero=0, microbatches=1, remat="none", **layout
    )  # a layout of its own: the training layout's pipeline/remat settings do not apply
    cfg.mesh.layout = lay
    for name in layout_flags:
        value = getattr(args, name, None)
        if value is not None:
            C.override(cfg, FLAGS[name][0], value)
    # Evaluation and sampling run the whole model as one program (no schedule): layers merely
    # rest on the pp ranks. Micro-batches only have to satisfy the schedule's validation.
    cfg.layout.microbatches = max(cfg.layout.pp * cfg.layout.virtual, 1)
    cfg.mesh.devices = args.devices or cfg.layout.n_devices
    if cfg.mesh.devices < cfg.layout.n_devices:
        raise ConfigError(
            f"--devices={cfg.mesh.devices}: fewer than the layout's pp*dp*sp*tp="
            f"{cfg.layout.n_devices}"
        )
    V.validate(cfg)
    if cfg.layout.fp8 == "delayed":  # its forward quantizes with the weights' amax histories
        from jaxpar.train.checkpointing import check_fp8_history

        where = f"checkpoint step {step} in {ck}" if ck is not None else f"{hf_dir}"
        check_fp8_history(meta if ck is not None else None, "delayed", where)
    return Source(cfg, ck, step, hf_dir, tok, data)


def tokenizer_for(src: Source, spec: str | None) -> T.Tokenizer | None:
    """``--tokenizer`` if given, else the one the weights' record names (None if unknown)."""
    if spec is not None:
        return T.load(spec)
    return T.from_identity(src.tokenizer, "the checkpoint's tokenizer")


def start(src: Source):
    """Set up the devices (simulated on CPU) and return the layout's mesh."""
    from jaxpar.distributed import setup

    setup(src.cfg.mesh.hardware, src.cfg.mesh.devices)
    import jax

    from jaxpar.devices import make_mesh

    return make_mesh(src.cfg.layout, jax.devices()[: src.cfg.layout.n_devices])


def load_params(src: Source, shardings: Any) -> Any:
    """The weights, in canonical form, read straight into ``shardings`` (e.g.
    ``Trainer.canonical_param_shardings``)."""
    import jax

    if src.hf_dir is not None:
        from jaxpar.model import hf

        return hf.load(src.hf_dir, src.cfg.model, shardings)
    import orbax.checkpoint as ocp

    from jaxpar.model import Model

    abstract = {
        "params": jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            Model(src.cfg.model, fp8_history=src.cfg.layout.fp8 == "delayed").abstract(),
            shardings,
        )
    }
    # A read-only manager with the generic pytree handler: the train state was written by the
    # standard handler (same format), and partial_restore leaves the optimizer state on disk.
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns that a read-only manager will not save
    try:
        mgr = ocp.CheckpointManager(
            Path(src.checkpoint_dir).absolute(),
            options=ocp.CheckpointManagerOptions(read_only=True, create=False),
            item_handlers={"state": ocp.PyTreeCheckpointHandler()},
        )
    finally:
        absl.setLevel(level)
    try:
        restore = ocp.args.PyTreeRestore(
            item=abstract,
            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=True,
        )
        out = mgr.restore(src.step, args=ocp.args.Composite(state=restore))
    finally:
        mgr.close()
    return out["state"]["params"]


def describe(src: Source) -> dict[str, Any]:
    """JSON fields naming the weights."""
    return {
        "model": src.cfg.model.name,
        "params": src.cfg.model.param_count(),
        "checkpoint_dir": src.checkpoint_dir,
        "checkpoint_step": src.step,
        "init_from_hf": src.hf_dir,
    }
