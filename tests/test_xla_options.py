"""hardware.cpu_fusion: which kernels XLA's CPU backend fuses into, per compiled program."""

import re

import jax
import numpy as np
import pytest

from jaxpar import validation as V
from jaxpar import xla_options
from jaxpar.devices import make_mesh
from jaxpar.errors import ConfigError
from jaxpar.train.step import Trainer


def _trainer(cfg, fusion: str) -> Trainer:
    cfg.mesh.hardware.cpu_fusion = fusion
    V.validate(cfg, cfg.layout.n_devices)
    return Trainer(cfg, make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices]))


def _fusions(hlo: str) -> tuple[int, int]:
    """(loop fusions, YNNPACK fusions that compute elementwise work) of a compiled program."""
    computation = re.compile(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", re.M | re.S)
    bodies = {m[1]: m[2] for m in computation.finditer(hlo)}
    ynn = re.findall(r"fusion\([^\n]*kind=kCustom, calls=%([\w.\-]+)[^\n]*__ynn_fusion", hlo)
    elementwise = re.compile(r" (add|multiply|subtract|exponential|select)\(")
    return hlo.count("kind=kLoop"), sum(bool(elementwise.search(bodies.get(c, ""))) for c in ynn)


def test_one_device_step_fuses_reductions_into_ynnpack_and_matches_xla(make_cfg):
    auto = _trainer(make_cfg(dp=1), "auto")
    xla = _trainer(make_cfg(dp=1), "xla")
    assert (auto.cpu_fusion, xla.cpu_fusion) == ("ynnpack", "xla")
    assert auto.compiler_options == {xla_options.OPTION: xla_options.DOT_AND_REDUCE}
    assert xla.compiler_options is None
    # More than one device: XLA's own choice (measured faster there).
    assert _trainer(make_cfg(dp=2), "auto").cpu_fusion == "xla"
    assert _trainer(make_cfg(dp=2), "ynnpack").cpu_fusion == "ynnpack"

    loops_auto, ynn_auto = _fusions(auto.compile_step().as_text())
    loops_xla, ynn_xla = _fusions(xla.compile_step().as_text())
    assert loops_auto < loops_xla and ynn_auto > ynn_xla, (loops_auto, loops_xla, ynn_auto, ynn_xla)

    # The same loss and gradients (fp32), and the same first steps.
    state = xla.init_state(0)
    batch = jax.device_put(np.arange(16 * 33).reshape(16, 33) % 256, xla.batch_sharding)
    (la, ga), (lx, gx) = auto.grads(state["params"], batch), xla.grads(state["params"], batch)
    np.testing.assert_allclose(la, lx, rtol=1e-6)
    for a, x in zip(jax.tree.leaves(ga), jax.tree.leaves(gx), strict=True):
        np.testing.assert_allclose(a, x, rtol=1e-5, atol=1e-7)
    _, ma = auto.step(auto.init_state(0), batch)
    _, mx = xla.step(xla.init_state(0), batch)
    np.testing.assert_allclose(ma["loss"], mx["loss"], rtol=1e-6)


def test_a_refused_option_falls_back_under_auto_and_is_an_error_when_forced(make_cfg, monkeypatch):
    monkeypatch.setattr(xla_options, "OPTION", "xla_cpu_no_such_option_in_any_jaxlib")
    xla_options._accepted.cache_clear()
    try:
        assert xla_options.cpu_fusion("auto", jax.devices()[:1]) == "xla"
        with pytest.raises(ConfigError, match=r"hardware.cpu_fusion='ynnpack': jax .* refuses"):
            _trainer(make_cfg(dp=1), "ynnpack")
    finally:
        monkeypatch.undo()
        xla_options._accepted.cache_clear()
    assert xla_options.cpu_fusion("auto", jax.devices()[:1]) == "ynnpack"


def test_bad_cpu_fusion_is_refused_before_compiling(make_cfg):
    cfg = make_cfg(dp=1)
    cfg.mesh.hardware.cpu_fusion = "eigen"
    with pytest.raises(ConfigError, match=r"hardware.cpu_fusion.*'eigen'"):
        V.validate(cfg, 1)
