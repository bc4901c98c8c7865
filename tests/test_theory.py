"""The literature's closed forms against the published tables (pure Python)."""

from __future__ import annotations

import pytest

from jaxpar.analysis import theory as th
from jaxpar.config import ModelConfig

GQA = ModelConfig(
    name="gqa",
    n_layers=8,
    d_model=512,
    n_heads=8,
    n_kv_heads=2,
    d_ff=1536,
    vocab_size=1001,
    max_seq_len=512,
)

# ZeRO paper, Table 1, Ψ = 7.5B, K = 12: GB per device for DDP, P_os, P_os+g, P_os+g+p.
ZERO_TABLE1 = {
    4: (120, 52.5, 41.3, 30),
    16: (120, 35.6, 21.6, 7.5),
    64: (120, 31.4, 16.6, 1.88),
    256: (120, 30.4, 15.4, 0.47),
    1024: (120, 30.1, 15.1, 0.12),
}


@pytest.mark.parametrize("n", sorted(ZERO_TABLE1))
def test_zero_table1(n):
    for stage, paper_gb in enumerate(ZERO_TABLE1[n]):
        got = th.zero_model_states(7.5e9, n, stage)["total"] / th.GB
        assert got == pytest.approx(paper_gb, abs=0.06), (n, stage)  # paper rounds to 3 digits


def test_zero_formula_terms():
    psi, n = 1e9, 8
    expected = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    for stage, want in expected.items():
        got = th.zero_model_states(psi, n, stage)
        assert got["total"] == pytest.approx(want)
        assert got["total"] == pytest.approx(got["params"] + got["grads"] + got["optimizer"])
    with pytest.raises(ValueError):
        th.zero_model_states(psi, n, 4)


def test_activation_per_layer_korthikanti_table2():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    act = th.activation_bytes_per_layer
    assert act(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert act(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert act(s, b, h, a, t, True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert act(s, b, h, a, t, False, "selective") == pytest.approx(sbh * (10 + 24 / t))
    assert act(s, b, h, a, t, True, "selective") == pytest.approx(sbh * 34 / t)
    assert act(s, b, h, a, 1, False, "full") == 2 * sbh
    assert act(s, b, h, a, t, True, cp=4) == pytest.approx(act(s, b, h, a, t, True) / 4)
    assert act(s, b, h, a, flash=True) == pytest.approx(34 * sbh)
    with pytest.raises(ValueError):
        act(s, b, h, a, recompute="some")


def test_tp_ulysses_ring_pipeline_comm():
    b, s, h, t = 2, 1024, 4096, 4
    tp = th.tp_comm_elements_per_layer(b, s, h, t)
    tp_sp = th.tp_comm_elements_per_layer(b, s, h, t, sequence_parallel=True)
    one = b * s * h * 3 / 4
    assert tp["elements"] == pytest.approx(8 * one) and tp["ops"] == {"all-reduce": 4}
    # SP: the backward gathers the column-parallel inputs again (the shard is what is kept)
    assert tp_sp["elements"] == pytest.approx(10 * one)
    assert tp_sp["ops"] == {"all-gather": 6, "reduce-scatter": 4}
    full = th.tp_comm_elements_per_layer(b, s, h, t, True, "full")
    assert full["ops"] == {"all-gather": 6, "reduce-scatter": 6}
    assert th.tp_comm_elements_per_layer(b, s, h, t, recompute="full")["elements"] == 10 * one
    assert th.tp_comm_elements_per_layer(b, s, h, 1)["elements"] == 0
    n_tok, p = b * s, 4
    uly = th.ulysses_comm_elements_per_layer(n_tok, h, p)
    assert uly["forward"] == pytest.approx(4 * n_tok * h / p)
    assert uly["wire"] == pytest.approx(uly["elements"] * 3 / 4)
    assert (
        th.ulysses_comm_elements_per_layer(n_tok, h, p, kv_dim=h // 4)["forward"] < uly["forward"]
    )
    ring = th.ring_attention_comm_elements_per_layer(n_tok, h, p)
    assert ring["forward"] == pytest.approx(2 * (p - 1) * n_tok * h / p)
    assert th.ring_attention_comm_elements_per_layer(n_tok, h, 1)["elements"] == 0
    assert th.pp_p2p_elements(b, s, h) == b * s * h
    assert th.pp_p2p_elements(b, s, h, t, sequence_parallel=True) == b * s * h / t


def test_flops_and_mfu():
    seq = 2048
    psi = GQA.param_count() - GQA.vocab_size * GQA.d_model  # input embedding is a gather
    attn = 12 * GQA.n_layers * GQA.n_heads * GQA.hd * seq
    assert th.train_flops_per_token(GQA, seq) == pytest.approx(6 * psi + attn)
    assert th.forward_flops_per_token(GQA, seq) * 3 == pytest.approx(
        th.train_flops_per_token(GQA, seq)
    )
    tied = ModelConfig(**{**GQA.__dict__, "tied_embeddings": True})
    assert th.matmul_params(tied) == tied.param_count()
    assert th.mfu(1000.0, 1e9, 4, 1e12) == pytest.approx(1000 * 1e9 / 4e12)


def test_bubble():
    assert th.bubble_fraction(4, 8, "gpipe") == pytest.approx(3 / 11)
    assert th.bubble_fraction(4, 8, "1f1b") == th.bubble_fraction(4, 8, "gpipe")
    assert th.bubble_fraction(4, 8, "interleaved", v=2) == pytest.approx(3 / 19)
    assert th.bubble_fraction(1, 8) == 0
    assert th.bubble_overhead(4, 8) == pytest.approx(3 / 8)
    assert th.bubble_overhead(4, 8, "interleaved", v=2) == pytest.approx(3 / 16)
    with pytest.raises(ValueError):
        th.bubble_fraction(4, 8, "zb-h1")
