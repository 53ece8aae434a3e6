"""Tests for rpb.coactivation: exact streaming counts and the structure / drift metrics."""

import itertools
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import rpb.coactivation as co
from rpb.coactivation import (
    CoactivationCounter,
    coactivation_cosine,
    communities,
    mean_kl,
    modularity,
    partition_ari,
    partition_nmi,
    split_half_stability,
    summarize_layers,
    topk_overlap,
    uniform_baseline,
    usage_entropy,
)


def _routing(t: int, e: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Skewed scores so counts are far from uniform and ordering bugs show up.
    scores = torch.rand(t, e, generator=g) * torch.linspace(1.0, 3.0, e)
    return scores.topk(k, dim=1).indices


def _brute_force(idx: torch.Tensor, e: int, mask: torch.Tensor | None = None) -> np.ndarray:
    out = np.zeros((e, e), dtype=np.int64)
    for t, row in enumerate(idx.tolist()):
        if mask is not None and not mask[t]:
            continue
        for i in row:
            out[i, i] += 1
        for i, j in itertools.combinations(row, 2):
            out[i, j] += 1
            out[j, i] += 1
    return out


def _planted(e: int, n_blocks: int, t: int, k: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Tokens that each pick k experts from one of n_blocks equal blocks."""
    g = torch.Generator().manual_seed(seed)
    size = e // n_blocks
    block = torch.randint(n_blocks, (t,), generator=g)
    within = torch.rand(t, size, generator=g).topk(k, dim=1).indices
    return block.unsqueeze(1) * size + within, np.arange(e) // size


def test_counts_match_brute_force_with_mask_and_chunking(monkeypatch):
    monkeypatch.setattr(co, "_CHUNK_TOKENS", 7)  # force several chunks per batch
    e, k = 10, 3
    idx = _routing(50, e, k, seed=1)
    mask = torch.arange(50) % 3 != 0
    c = CoactivationCounter(2, e)
    c.update(1, idx, mask)
    expected = _brute_force(idx, e, mask)
    assert np.array_equal(c.counts[1].numpy(), expected)
    assert c.counts[0].sum() == 0
    assert c.n_tokens.tolist() == [0, int(mask.sum())]
    assert torch.equal(c.counts[1], c.counts[1].T)
    assert torch.equal(c.usage[1], c.counts[1].diagonal())
    assert int(c.usage[1].sum()) == int(mask.sum()) * k


def test_leading_dims_are_flattened():
    idx = _routing(24, 8, 2, seed=2)
    mask = torch.rand(24, generator=torch.Generator().manual_seed(0)) > 0.3
    flat, nested = CoactivationCounter(1, 8), CoactivationCounter(1, 8)
    flat.update(0, idx, mask)
    nested.update(0, idx.view(4, 6, 2), mask.view(4, 6))
    assert torch.equal(flat.counts, nested.counts)


def test_merge_equals_counting_all_at_once():
    idx = _routing(40, 6, 2, seed=3)
    whole, a, b = (CoactivationCounter(1, 6) for _ in range(3))
    whole.update(0, idx)
    a.update(0, idx[:17])
    b.update(0, idx[17:])
    a.merge(b)
    assert torch.equal(a.counts, whole.counts)
    assert torch.equal(a.n_tokens, whole.n_tokens)
    with pytest.raises(ValueError, match="cannot merge"):
        a.merge(CoactivationCounter(1, 7))


def test_state_dict_round_trips_through_safetensors(tmp_path):
    c = CoactivationCounter(2, 5)
    c.update(0, _routing(30, 5, 2, seed=4))
    save_file(c.state_dict(), tmp_path / "c.safetensors")
    back = CoactivationCounter.from_state_dict(load_file(tmp_path / "c.safetensors"))
    assert torch.equal(back.counts, c.counts)
    assert torch.equal(back.n_tokens, c.n_tokens)
    with pytest.raises(ValueError, match="lacks"):
        CoactivationCounter.from_state_dict({"counts": c.counts})


@pytest.mark.parametrize(
    ("idx", "match"),
    [
        (torch.tensor([[0, 5]]), "out of range"),
        (torch.tensor([[-1, 2]]), "out of range"),
        (torch.tensor([[1, 1]]), "same expert twice"),
        (torch.tensor([[0.0, 1.0]]), "integer tensor"),
    ],
)
def test_update_rejects_bad_indices(idx, match):
    with pytest.raises(ValueError, match=match):
        CoactivationCounter(1, 5).update(0, idx)


def test_update_rejects_bad_layer_and_mask():
    c = CoactivationCounter(2, 5)
    with pytest.raises(ValueError, match="layer 2"):
        c.update(2, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="mask"):
        c.update(0, torch.tensor([[0, 1], [2, 3]]), torch.tensor([True]))


def test_louvain_recovers_planted_blocks_deterministically():
    idx, truth = _planted(e=12, n_blocks=3, t=3000, k=2, seed=5)
    c = CoactivationCounter(1, 12)
    c.update(0, idx)
    coact = c.counts[0].numpy()
    labels = communities(coact, seed=0)
    assert partition_nmi(labels, truth) == pytest.approx(1.0)
    assert np.array_equal(labels, communities(coact, seed=0))
    assert labels[0] == 0  # canonical numbering
    # Disjoint blocks, one pair per token (k=2): Q = 1 - sum_c (share of tokens in block c)^2.
    share = np.bincount(truth[idx[:, 0].numpy()]) / len(idx)
    assert modularity(coact, labels) == pytest.approx(1 - (share**2).sum())


def test_isolated_and_empty_graphs():
    coact = np.zeros((4, 4))
    coact[0, 1] = coact[1, 0] = 3.0
    coact[2, 2] = 5.0  # used but never co-selected: isolated
    labels = communities(coact)
    assert labels.tolist() == [0, 0, 1, 2]
    assert math.isnan(modularity(np.diag([1.0, 2.0, 3.0]), [0, 1, 2]))
    with pytest.raises(ValueError, match="symmetric"):
        communities(np.triu(np.ones((3, 3))))


def test_partition_scores_against_hand_values():
    assert partition_nmi([0, 0, 1, 1], [1, 1, 0, 0]) == pytest.approx(1.0)
    assert partition_nmi([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx(0.0)
    # ARI of two crossing halves: (0 - 4/6) / (2 - 4/6).
    assert partition_ari([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx(-0.5)
    # NMI (arithmetic normalisation) of [0,0,0,1] vs [0,0,1,1].
    mi = 0.5 * math.log(4 / 3) + 0.25 * math.log(2 / 3) + 0.25 * math.log(2)
    ha = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert partition_nmi([0, 0, 0, 1], [0, 0, 1, 1]) == pytest.approx(mi / ((ha + math.log(2)) / 2))
    with pytest.raises(ValueError, match="equal length"):
        partition_nmi([0, 1], [0, 1, 1])


def test_cosine_uses_off_diagonal_only():
    a = np.array([[9, 1, 2], [1, 0, 0], [2, 0, 0]])
    b = np.array([[0, 0, 2], [0, 7, 3], [2, 3, 1]])
    assert coactivation_cosine(a, b) == pytest.approx(4 / math.sqrt(5 * 13))
    assert math.isnan(coactivation_cosine(np.eye(3), a))


def test_usage_entropy_hand_values():
    assert usage_entropy([1, 1, 1, 1]) == pytest.approx(1.0)
    assert usage_entropy([3, 3, 0, 0]) == pytest.approx(0.5)
    assert usage_entropy([3, 3, 0, 0], normalized=False) == pytest.approx(math.log(2))
    assert usage_entropy([5, 0, 0]) == pytest.approx(0.0)
    assert np.allclose(usage_entropy([[1, 1], [1, 0]]), [1.0, 0.0])
    with pytest.raises(ValueError, match="positive total"):
        usage_entropy([0, 0])


def test_topk_overlap_and_kl_hand_values():
    a = torch.tensor([[0, 1], [2, 3]])
    b = torch.tensor([[1, 0], [2, 4]])
    assert topk_overlap(a, b) == pytest.approx(0.75)
    assert topk_overlap(a, b, mask=torch.tensor([False, True])) == pytest.approx(0.5)
    p_ref = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    p = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    expected = (0.5 * math.log(2) + 0.5 * math.log(2 / 3)) / 2  # second token: 0, not NaN
    assert mean_kl(p_ref, p) == pytest.approx(expected)
    assert math.isfinite(mean_kl(torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]])))
    with pytest.raises(ValueError, match="shapes differ"):
        mean_kl(p_ref, p[:, :1])


def test_uniform_baseline_is_unstructured():
    base = uniform_baseline(n_experts=16, k=2, n_tokens=4000, seed=0)
    assert base["usage_entropy"] > 0.99
    assert base["modularity"] < 0.05
    assert base == uniform_baseline(n_experts=16, k=2, n_tokens=4000, seed=0)


def test_split_half_stability_on_planted_vs_noise():
    idx, _ = _planted(e=12, n_blocks=3, t=2000, k=2, seed=6)
    halves = CoactivationCounter(2, 12)
    odd = torch.arange(2000) % 2 == 1
    halves.update(0, idx, ~odd)
    halves.update(1, idx, odd)
    assert split_half_stability(halves.counts[0], halves.counts[1]) == pytest.approx(1.0)
    # Both halves a single community: no structure, so no stability claim.
    flat = np.ones((4, 4))
    assert math.isnan(split_half_stability(flat, flat))


def test_summarize_layers_against_reference():
    planted, _ = _planted(e=12, n_blocks=3, t=2000, k=2, seed=7)
    ref = CoactivationCounter(2, 12)
    ref.update(0, planted)
    ref.update(1, planted)
    live = CoactivationCounter(2, 12)
    live.update(0, planted)  # layer 0 keeps the structure
    live.update(1, _routing(2000, 12, 2, seed=8))  # layer 1 loses it
    rows = summarize_layers(live.counts, ref.counts)
    assert [r["layer"] for r in rows] == [0, 1, "mean"]
    assert rows[0]["community_nmi"] == pytest.approx(1.0)
    assert rows[0]["community_ari"] == pytest.approx(1.0)
    assert rows[0]["coact_cosine"] == pytest.approx(1.0)
    assert rows[1]["coact_cosine"] < 0.9
    assert rows[1]["ref_partition_modularity"] < 0.1 < rows[0]["ref_partition_modularity"]
    assert rows[2]["coact_cosine"] == pytest.approx(
        (rows[0]["coact_cosine"] + rows[1]["coact_cosine"]) / 2
    )
    alone = summarize_layers(live.counts)
    assert "community_nmi" not in alone[0]
    assert alone[0]["modularity"] == pytest.approx(rows[0]["modularity"])
    assert alone[0]["modularity"] > 0.6  # three blocks: at most 2/3
    with pytest.raises(ValueError, match="differs"):
        summarize_layers(live.counts, ref.counts[:1])
