"""The host allocator keeps XLA CPU's per-execution buffers mapped between executions."""

import json
import os
import subprocess
import sys

import pytest
from conftest import TEST_XLA_FLAGS

from jaxpar import hostmem
from jaxpar.errors import ConfigError

# One process per allocator choice (the arena choice is fixed when JAX's threads start): a jitted
# function whose temporaries (about 130 MB, compiled) exceed a thread arena's 64 MiB heap, run
# after two warm-up calls: minor page faults (getrusage) of each of 24 calls.
PROBE = r"""
import json, os, resource
os.environ["JAX_PLATFORMS"] = "cpu"
from jaxpar.devices import simulate_cpu_devices
from jaxpar import hostmem
simulate_cpu_devices(1)
import jax, jax.numpy as jnp

@jax.jit
def f(x, w):
    h = jnp.tanh(x @ w)              # 8192 x 2048 fp32: 64 MiB each
    g = jnp.exp(-h) * h + jnp.sin(h)
    return jnp.sum(g @ w.T)

x = jnp.ones((8192, 64), jnp.float32) * 0.01
w = jnp.ones((64, 2048), jnp.float32) * 0.01
temp = f.lower(x, w).compile().memory_analysis().temp_size_in_bytes
for _ in range(2):
    f(x, w).block_until_ready()
faulted = []
for _ in range(24):
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w).block_until_ready()
    faulted.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) * 4096)
print(json.dumps({"state": hostmem.state(), "temp": temp, "faulted": faulted}))
"""


def _probe(choice: str) -> dict:
    env = {**os.environ, hostmem.ENV: choice}
    env["XLA_FLAGS"] = TEST_XLA_FLAGS
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hostmem.glibc(), reason="the allocator setting is glibc's (Linux)")
def test_step_buffers_stay_mapped():
    system, kept = _probe("system"), _probe("keep")
    assert system["state"] == "system" and kept["state"] == "kept"
    assert system["temp"] > 64 * 2**20
    # glibc's defaults: every call maps its temporaries afresh and faults them in again ...
    assert min(system["faulted"]) >= 0.5 * system["temp"], system
    # ... kept: a call reuses the pages of an earlier one. Until the heap has room for every
    # execution in flight at once (a buffer is freed after its call returns) some calls still
    # grow it: 0 to 5.3 temporaries' worth in all over the 24 calls in 30 runs of this probe,
    # against 24 with the defaults.
    assert sum(kept["faulted"]) <= 8 * kept["temp"], kept


def test_bad_choice_is_refused(monkeypatch):
    monkeypatch.setattr(hostmem, "_state", None)
    monkeypatch.setenv(hostmem.ENV, "jemalloc")
    with pytest.raises(ConfigError, match=r"JAXPAR_HOST_ALLOCATOR='jemalloc': must be 'keep'"):
        hostmem.keep_host_buffers()
    assert hostmem.state() is None


@pytest.mark.skipif(not hostmem.glibc(), reason="the allocator setting is glibc's (Linux)")
def test_after_jax_started_it_says_late():
    # JAX's threads already hold their arenas: the setting is applied but reported as late.
    code = (
        "import jax; jax.devices('cpu'); from jaxpar import hostmem; "
        "print(hostmem.keep_host_buffers(), hostmem.keep_host_buffers())"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", hostmem.ENV: "keep"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["late", "late"]
