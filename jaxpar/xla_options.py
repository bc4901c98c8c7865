"""Per-program XLA compiler options: which kernel library XLA's CPU backend fuses into.

XLA's CPU backend lowers dots to YNNPACK fusions. ``hardware.cpu_fusion`` chooses whether
reductions (and the elementwise work around dots and reductions) go there too, through the
compile option ``xla_cpu_experimental_ynn_fusion_type`` given to the trainer's programs (the
step, evaluation and gradients; :class:`jaxpar.train.step.Trainer`): unlike
``hardware.xla_flags`` (process-wide ``XLA_FLAGS``) it applies to the programs it is given to
and nothing else, and a jaxlib that does not know it refuses it with an error, not an abort.

* ``"xla"``: XLA's own choice.
* ``"ynnpack"``: YNNPACK fusions for dots and reductions. The one-device step of the issue-13
  shape (4 layers, d 256, batch 16 × 256) then has 40 fewer loop fusions: the backward attention
  tile computes dS inside a dot's fusion and adds the dK/dV/dQ contributions inside theirs.
* ``"auto"`` (default): ``"ynnpack"`` for a program on one CPU device, ``"xla"`` for more. Same
  process A/B of the training step, ratio of step time to ``"xla"`` (BENCHMARKS.md): one device
  0.91 (issue shape) and 1.00 (d 512, 1024 positions); 4 simulated devices, DDP 1.03 and ZeRO-3
  1.02 (two cores shared by four programs).

Off CPU the setting does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import jax
import jax.numpy as jnp

from jaxpar.config import CPU_FUSIONS
from jaxpar.errors import ConfigError

OPTION = "xla_cpu_experimental_ynn_fusion_type"
DOT_AND_REDUCE = "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE"


@cache
def _accepted(device: jax.Device) -> str | None:
    """None when this jaxlib compiles with the option on ``device``, else its error (one line)."""
    x = jax.device_put(jnp.zeros((8, 8), jnp.float32), device)
    try:
        jax.jit(lambda a: (a @ a).sum()).lower(x).compile(compiler_options={OPTION: DOT_AND_REDUCE})
    except Exception as e:  # noqa: BLE001 - jaxlib's error types vary between versions
        return " ".join(str(e).split())[:200]
    return None


def cpu_fusion(setting: str, devices: Sequence[jax.Device]) -> str | None:
    """The fusion (``"xla"`` or ``"ynnpack"``) a program on ``devices`` compiles with under
    ``hardware.cpu_fusion = setting``; None off CPU.

    ``"auto"`` falls back to ``"xla"`` where this jaxlib refuses the option; a forced
    ``"ynnpack"`` raises :class:`ConfigError` there instead.
    """
    if setting not in CPU_FUSIONS:
        raise ConfigError(f"hardware.cpu_fusion={setting!r}: must be one of {CPU_FUSIONS}")
    if devices[0].platform != "cpu":
        return None
    if setting == "xla" or (setting == "auto" and len(devices) > 1):
        return "xla"
    refused = _accepted(devices[0])
    if refused is None:
        return "ynnpack"
    if setting == "auto":
        return "xla"
    raise ConfigError(
        f"hardware.cpu_fusion='ynnpack': jax {jax.__version__} refuses the compile option "
        f"{OPTION} ({refused}); use 'xla' or 'auto'"
    )


def compiler_options(fusion: str | None) -> dict[str, str] | None:
    """``compiler_options`` for ``jax.jit`` of a program that :func:`cpu_fusion` chose for."""
    return {OPTION: DOT_AND_REDUCE} if fusion == "ynnpack" else None
