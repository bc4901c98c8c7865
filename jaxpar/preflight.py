"""Every check a training run makes before it compiles, in one place, so ``--dry-run`` runs
them all: a dry run that passes is a run that starts.

:func:`preflight` checks, beyond :func:`jaxpar.validation.validate` (the configuration's types
and rules): the ``JAXPAR_*`` environment (:data:`ENV_RULES`; an unknown ``JAXPAR_`` name is
warned about), the XLA flags this run starts with (``XLA_FLAGS`` and the mesh file's
``xla_flags``: XLA aborts the process, with nothing a user would read, on a flag it does not
know or a value it cannot read, so XLA parses them first in a child process, once per flag:
:func:`check_xla_values`), the platform rules of the step (a ragged MoE
exchange needs a GPU), a Hugging Face directory's
config.json and every safetensors header, the data (token files and sidecars, the vocabulary,
the sequence length against each split), the checkpoint directory against ``--resume``, and
the outputs (:func:`jaxpar.outputs.check_outputs`). Nothing here starts JAX in this process.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
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


def _cache_file() -> Path | None:
    """Where the flags XLA accepted are kept, per jaxlib version (None: no jaxlib)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        key = version("jaxlib")
    except PackageNotFoundError:
        return None
    root = Path(os.environ.get("JAXPAR_CACHE_DIR") or Path.home() / ".cache" / "jaxpar")
    return root / f"xla_flags_ok-{key}.json"


def _accepted() -> set[str]:
    path = _cache_file()
    try:
        got = json.loads(path.read_text()) if path else []
    except (OSError, ValueError):
        return set()
    return {f for f in got if isinstance(f, str)} if isinstance(got, list) else set()


def _remember(flags: list[str]) -> None:
    path = _cache_file()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(sorted(_accepted() | set(flags))))
        os.replace(tmp, path)
    except OSError:
        pass  # no cache: the next run asks XLA again


_BAD_VALUE = re.compile(r"Couldn't interpret value (.*) for flag ([A-Za-z0-9_]+)\.")
_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (\S+)")


@functools.lru_cache(maxsize=16)
def _xla_says(flags: tuple[str, ...]) -> tuple[str, str, str] | None:
    """XLA started with ``flags`` in a child process: None when it starts, else (kind, the
    flag or name it names, what it said), kind ``value``, ``unknown`` or ``other``."""
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    try:
        done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return ("other", "", f"could not try them ({e})")
    if done.returncode == 0:
        return None
    if m := _BAD_VALUE.search(done.stderr):
        return ("value", m.group(2), f"XLA cannot interpret {m.group(1)!r} as {m.group(2)}")
    if m := _UNKNOWN.search(done.stderr):
        return ("unknown", m.group(1), "not a flag of the installed jaxlib's XLA")
    lines = [x.strip() for x in done.stderr.splitlines() if x.strip()]
    said = (lines[-1] if lines else "").split("] ", 1)[-1][:200]
    return ("other", "", said or f"XLA exited with code {done.returncode}")


def check_xla_values(flags: list[tuple[str, str]], known_names: bool = True) -> None:
    """Refuse, in one line naming where it came from (``XLA_FLAGS`` or ``hardware.xla_flags``)
    and its value, a flag XLA would abort on, printing nothing a user would read: not
    ``--name[=value]``, a value XLA cannot interpret (``--x_enable_y=banana``) or, with
    ``known_names``, a name jaxlib's XLA does not have (a GPU plugin's XLA checks its own
    names: :func:`jaxpar.gpu.compile.unknown_flags`). ``flags`` are ``(flag, source)``.

    XLA parses them itself, in a child process started with the flags (the parse is XLA's:
    bools, integers, floats, enums and lists alike); the flags it accepted are remembered in
    ``$JAXPAR_CACHE_DIR/xla_flags_ok-<jaxlib version>.json`` (default ``~/.cache/jaxpar``), so
    the child starts only for a flag not seen before."""
    for flag, source in flags:
        if not re.fullmatch(r"--[A-Za-z0-9_]+(=.*)?", flag, re.S):
            raise ConfigError(f"{source}={flag!r}: not an XLA flag (expected --name[=value])")
    known = _accepted()
    todo = [f for f, _ in flags if f not in known]
    while todo:
        said = _xla_says(tuple(todo))
        if said is None:
            _remember(todo)
            return
        kind, name, why = said
        hit = [f for f in todo if f.split("=", 1)[0].lstrip("-") == name or f == name]
        if kind == "unknown" and not known_names and hit:
            todo = [f for f in todo if f not in hit]  # the plugin's own flag: its check
            continue
        flag = hit[0] if hit else " ".join(todo)
        source = next((s for f, s in flags if f == flag), flags[0][1])
        raise ConfigError(f"{source}={flag!r}: {why}")


def check_xla_flags(hardware, env: Mapping[str, str] | None = None, layout=None) -> None:
    """Refuse the XLA flags this run starts with (``XLA_FLAGS`` and the mesh file's that it
    would apply, :func:`jaxpar.distributed.run_xla_flags`) that XLA does not accept
    (:func:`check_xla_values`)."""
    from jaxpar.distributed import apply_xla_flags, run_xla_flags

    scratch = dict(os.environ if env is None else env)
    given = scratch.get("XLA_FLAGS", "").split()
    added = apply_xla_flags(hardware.platform, run_xla_flags(hardware, layout), scratch)
    check_xla_values([(f, "XLA_FLAGS") for f in given] + [(f, "hardware.xla_flags") for f in added])


def run_platform(hardware, env: Mapping[str, str] | None = None) -> str:
    """The platform a run of this mesh uses, without starting JAX: a CPU mesh simulates CPU
    devices (:func:`jaxpar.distributed.setup`), a GPU mesh runs where JAX finds its devices."""
    from jaxpar.distributed import target_platform

    return "cpu" if hardware.platform == "cpu" else target_platform(env)


def check_platform(cfg, env: Mapping[str, str] | None = None) -> None:
    """The step's platform rules that the trainer applies to its devices
    (:func:`jaxpar.train.step.check_platform`), here on the platform the run will use: a
    ragged MoE exchange where XLA has no ragged all-to-all."""
    from jaxpar.validation import check_dispatch

    check_dispatch(cfg.model.moe, cfg.layout.ep, run_platform(cfg.mesh.hardware, env))


def check_checkpoints(cfg) -> None:
    """The checkpoint directory against ``--resume`` (as the run's own refusals say)."""
    from jaxpar.inference import newest_step

    t = cfg.train
    if (t.resume or t.resume_or_start) and not t.checkpoint_dir:  # named by the flag given
        given = "train.resume" if t.resume else "train.resume_or_start"
        raise ConfigError(f"{given}=True: needs train.checkpoint_dir (--checkpoint-dir)")
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
    check_xla_flags(cfg.mesh.hardware, layout=cfg.layout)
    check_platform(cfg)
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
