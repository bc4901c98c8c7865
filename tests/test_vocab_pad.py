"""A vocabulary tp does not divide (GPT-2's 50257): padded at rest as Megatron-LM pads it, the
padded logits masked out of the softmax, so every layout computes one device's numbers; the
canonical form (checkpoints, Hugging Face weights, inference) keeps the true vocabulary.
Refusals of sizes past int32. 8 simulated CPU devices (conftest)."""

from functools import cache

import jax
import numpy as np
import pytest
from conftest import small_config

from jaxpar import config as C
from jaxpar import validation as V
from jaxpar.data import Batches, load_corpus
from jaxpar.devices import make_mesh
from jaxpar.errors import ConfigError
from jaxpar.train.step import Trainer

VOCAB = 257  # odd: no tp > 1 divides it

CASES = {
    "dp2_tp2_z3_tied": (dict(dp=2, tp=2, zero=3), True),
    "tp2_pp2_m2": (dict(tp=2, pp=2, microbatches=2), False),
}


def cfg_of(layout: dict, tied: bool) -> C.RunConfig:
    cfg = small_config(**layout)
    cfg.model.vocab_size, cfg.model.tied_embeddings = VOCAB, tied
    V.validate(cfg, cfg.layout.n_devices)
    return cfg


def grads(cfg: C.RunConfig):
    tr = Trainer(cfg, make_mesh(cfg.layout, jax.devices()[: cfg.layout.n_devices]))
    t = cfg.train
    # Synthetic tokens use every id of the vocabulary, the last true row included.
    batches = Batches(load_corpus("synthetic", VOCAB), t.global_batch, t.seq_len, seed=3)
    params = tr.init_state(0)["params"]
    loss, g = tr.grads(params, batches.global_array(0, tr.batch_sharding))
    canon = lambda tree: jax.tree.map(np.asarray, tr.convert(tree, "canonical"))  # noqa: E731
    return tr, float(loss), canon(g), canon(params), jax.tree.map(np.asarray, g)


@cache
def reference(tied: bool):
    return grads(cfg_of({}, tied))[1:4]


@pytest.mark.parametrize("name", list(CASES))
def test_padded_vocabulary_reproduces_one_device(name):
    layout, tied = CASES[name]
    tr, loss, g, params, g_rest = grads(cfg_of(layout, tied))
    ref_loss, ref, ref_params = reference(tied)
    assert tr.rest.vocab == (VOCAB, 512)  # Megatron's multiple of 128 * tp
    assert abs(loss / ref_loss - 1) < 1e-5
    for path, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
        r, p0, p = ref, ref_params, params
        for key in path:
            r, p0, p = r[key.key], p0[key.key], p[key.key]
        assert leaf.shape == r.shape and p.shape == p0.shape  # the true vocabulary, canonical
        # The same initial weights as one device: bitwise with XLA:CPU's default fusion
        # emitters; the suite's classic ones (conftest) round the padded table's init one ulp
        # apart in a few percent of its elements.
        np.testing.assert_allclose(p, p0, rtol=3e-7, atol=0)
        np.testing.assert_allclose(leaf, r, rtol=1e-4, atol=1e-4 * np.abs(r).max(),
                                   err_msg=str(path))  # fmt: skip
    # At rest the padded rows exist and get no gradient (they stay zero under AdamW).
    table = g_rest["embed"]["table"]
    table = table if table.ndim == 2 else table.sum(0)  # a pipeline's [pp, V, D] slots
    assert table.shape[0] == 512 and not np.any(table[VOCAB:])


def test_planner_costs_the_padded_vocabulary_and_sizes_past_int32_are_refused(capsys):
    from jaxpar.cli import main
    from jaxpar.planner.shapes import param_counts

    gpt2 = C.load_model("gpt2-124m")
    assert gpt2.padded_vocab(1) == 50257 and gpt2.padded_vocab(8) == 51200  # Megatron's
    counts = param_counts(gpt2, C.LayoutConfig(tp=2, dp=4))
    assert counts.tensors["embed/table"][1] == 50432 // 2 * 768  # what a tp rank stores
    V.check_layout(gpt2, C.LayoutConfig(tp=4), 8, 1024)  # any tp: padded, not refused
    big = C.ModelConfig(vocab_size=2**31 - 1)
    with pytest.raises(ConfigError, match=r"^layout.tp=2: model.vocab_size=2147483647 padded"):
        V.check_layout(big, C.LayoutConfig(tp=2), 8, 32)
    with pytest.raises(ConfigError, match=r"^train.global_batch=16777216: global_batch\*seq"):
        V.check_layout(C.ModelConfig(), C.LayoutConfig(), 2**24, 256)
    # One line, exit 2, nothing compiled: a vocabulary past int32 token ids.
    assert main(["train", "--dry-run", "-o", "model.vocab_size=2147483648"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "jaxpar train: error: model.vocab_size=2147483648: must be at most 2147483647 (int32 in "
        "the compiled step)"
    ]
