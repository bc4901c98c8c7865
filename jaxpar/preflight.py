"""Every check a training run makes before it compiles, in one place, so ``--dry-run`` runs
them all: a dry run that passes is a run that starts.

:func:`preflight` checks, beyond :func:`jaxpar.validation.validate` (the configuration's types
and rules): the ``JAXPAR_*`` environment (:data:`ENV_RULES`; an unknown ``JAXPAR_`` name is
warned about), the mesh file's XLA flags that this run would apply (XLA aborts the process on
a flag it does not know, so they are tried once in a child process), a Hugging Face directory's
config.json and every safetensors header, the data (token files and sidecars, the vocabulary,
the sequence length against each split), the checkpoint directory against ``--resume``, and
the outputs (:func:`jaxpar.outputs.check_outputs`). Nothing here starts JAX in this process.
"""

from __future__ import annotations

import difflib
import functools
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

from jaxpar.errors import ConfigError, JaxparWarning


def _choice(*allowed: str) -> Callable[[str], str | None]:
    return lambda v: None if v in allowed else f"must be one of {', '.join(allowed)}"


def _number(lo: float, hi: float, integer: bool = False) -> Callable[[str], str | None]:
    def check(v: str) -> str | None:
        try:
            x = int(v) if integer else float(v)
        except ValueError:
            x = None
        if x is None or not lo <= x <= hi:
            return f"must be {'an integer' if integer else 'a number'} in {lo:g}..{hi:g}"
        return None

    return check


def _path(v: str) -> str | None:
    return None if v and "\0" not in v else "must be a non-empty path"


# Values of the JAXPAR_* variables jaxpar reads; the process layout ones (COORDINATOR,
# NUM_PROCESSES, PROCESS_ID, LOCAL_DEVICES) are checked together by
# jaxpar.distributed.process_config.
ENV_RULES: dict[str, Callable[[str], str | None]] = {
    "JAXPAR_HOST_ALLOCATOR": _choice("keep", "system"),
    "JAXPAR_CACHE_DIR": _path,
    "JAXPAR_INIT_TIMEOUT": _number(1, 86400, integer=True),
    "JAXPAR_PEER_TIMEOUT_S": _number(1, 3600),
    "JAXPAR_TEST_SAVE_DELAY_S": _number(0, 3600),
}
LAYOUT_VARS = ("JAXPAR_COORDINATOR", "JAXPAR_NUM_PROCESSES", "JAXPAR_PROCESS_ID",
               "JAXPAR_LOCAL_DEVICES")  # fmt: skip


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """Refuse a ``JAXPAR_*`` variable whose value breaks its rule (one line, naming it)."""
    from jaxpar.distributed import process_config

    env = os.environ if env is None else env
    known = (*ENV_RULES, *LAYOUT_VARS)
    for name, value in sorted(env.items()):
        if not name.startswith("JAXPAR_"):
            continue
        rule = ENV_RULES.get(name)
        if rule is not None:
            why = rule(value)
            if why:
                raise ConfigError(f"{name}={value!r}: {why}")
        elif name not in known:
            hint = difflib.get_close_matches(name, known, n=1)
            warnings.warn(
                f"{name}: not a variable jaxpar reads"
                + (f" (did you mean {hint[0]}?)" if hint else ""),
                JaxparWarning,
                stacklevel=2,
            )
    process_config(env=env)


@functools.lru_cache(maxsize=16)
def _xla_refusal(flags: tuple[str, ...]) -> str | None:
    """What XLA says about ``flags`` when it starts with them (None: it starts)."""
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    code = "import jax; jax.devices()"
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not try them ({e})"
    if done.returncode == 0:
        return None
    lines = [x.strip() for x in done.stderr.splitlines() if x.strip()]
    said = next((x for x in lines if "nknown flag" in x), lines[-1] if lines else "")
    return said.split("] ", 1)[-1][:200] or f"XLA exited with code {done.returncode}"


def check_xla_flags(hardware, env: Mapping[str, str] | None = None) -> None:
    """Refuse the mesh file's XLA flags that this run would apply but XLA does not accept."""
    from jaxpar.distributed import apply_xla_flags

    scratch = dict(os.environ if env is None else env)
    added = apply_xla_flags(hardware.platform, list(hardware.xla_flags), scratch)
    if added:
        why = _xla_refusal(tuple(scratch["XLA_FLAGS"].split()))
        if why:
            raise ConfigError(f"hardware.xla_flags={' '.join(added)!r}: XLA refuses them: {why}")


def check_checkpoints(cfg) -> None:
    """The checkpoint directory against ``--resume`` (as the run's own refusals say)."""
    from jaxpar.inference import newest_step

    t = cfg.train
    if (t.resume or t.resume_or_start) and not t.checkpoint_dir:
        raise ConfigError("train.resume=True: needs train.checkpoint_dir (--checkpoint-dir)")
    if t.resume and t.init_from_hf:
        raise ConfigError(f"train.init_from_hf={t.init_from_hf!r}: conflicts with --resume")
    d = Path(t.checkpoint_dir) if t.checkpoint_dir else None
    if d is None or not d.is_dir():
        return
    steps = [p.name for p in d.iterdir() if p.name.isascii() and p.name.isdigit()]
    if steps and not (t.resume or t.resume_or_start):
        raise ConfigError(
            f"train.checkpoint_dir={t.checkpoint_dir!r}: already holds checkpoints up to step "
            f"{max(map(int, steps))}; pass --resume to continue, or choose another directory"
        )
    if t.resume and not t.resume_or_start and newest_step(d) is None:
        raise ConfigError(
            f"train.resume=True: no complete checkpoint in {t.checkpoint_dir!r}; pass "
            "--resume-or-start to start fresh there, or drop --resume"
        )


def preflight(cfg, data: bool = True) -> None:
    """Every check of a run before it compiles (see the module docstring); ``data=False``
    leaves the data to the run itself (it loads it next)."""
    from jaxpar.outputs import check_outputs

    check_environment()
    check_xla_flags(cfg.mesh.hardware)
    t = cfg.train
    if t.init_from_hf:
        from jaxpar.model import hf

        hf.check(t.init_from_hf, cfg.model)  # config.json and every safetensors header
    if data:
        from jaxpar.data import Batches
        from jaxpar.train import load_data

        Batches(load_data(cfg), t.global_batch, t.seq_len, t.seed)
    check_checkpoints(cfg)
    check_outputs(cfg)
