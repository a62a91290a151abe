"""Synthetic sources: the exact floors and entropy rates against empirical estimates and naive loops."""
import math

import numpy as np
import pytest

from data import IGNORE_INDEX, PAD_ID, SyntheticMixture, build_data
from data.config import DataConfig

DEFAULT = {
    "kind": "synthetic", "seq_len": 128, "min_doc_len": 16, "seed": 1234,
    "sources": [
        {"name": "markov", "kind": "markov", "weight": 0.7, "alphabet": 32, "order": 2, "support": 4,
         "concentration": 0.5},
        {"name": "copy", "kind": "copy", "weight": 0.3, "alphabet": 32, "segment": 12},
    ],
}


def _symbols(ds, batch, s):
    """Alphabet symbols 0..A-1 of source s from label ids (IGNORE stays negative)."""
    return np.where(batch.labels.numpy() == IGNORE_INDEX, -1, batch.labels.numpy() - ds.bos_ids[s] - 1)


def test_markov_entropy_rate_matches_plugin_estimate():
    A, k = 8, 2
    # Full-length documents (min_doc_len = seq_len + 1) of a single Markov source.
    ds = SyntheticMixture([{"kind": "markov", "alphabet": A, "order": k, "support": 3, "concentration": 0.5}],
                          seq_len=2048, min_doc_len=2049, seed=2)
    x_BT = _symbols(ds, ds.samples(range(150)), 0)
    assert (x_BT >= 0).all() and (x_BT < A).all()
    # Plug-in conditional entropy H(next | previous k) from counts, after a burn-in so the context
    # distribution has settled to its limit. 150 * ~2000 = 3e5 transitions over 64 contexts: the
    # plug-in bias ~ (cells - contexts) / 2N < 1e-3 and the standard error ~ 2e-3, so 0.01 nats is ~5 SE.
    burn = 64
    ctx = x_BT[:, burn - 2:-2] * A + x_BT[:, burn - 1:-1]  # context (x_{t-2}, x_{t-1}) of x_t
    nxt = x_BT[:, burn:]
    counts = np.zeros((A**k, A))
    np.add.at(counts, (ctx.ravel(), nxt.ravel()), 1)
    n_c = counts.sum(1, keepdims=True)
    p = np.divide(counts, n_c, out=np.zeros_like(counts), where=n_c > 0)
    plugin = -(counts * np.log(np.where(p > 0, p, 1))).sum() / counts.sum()
    rate = ds.entropy_rates()[ds.source_names[0]]
    tol = 0.01
    assert abs(plugin - rate) < tol, (plugin, rate)
    # The test has power: the naive answer (contexts uniform instead of at their limit) is far off.
    assert abs(ds.sources[0].H_C.mean() - rate) > 3 * tol


def test_markov_floor_is_entropy_of_actual_context():
    A = 8
    ds = SyntheticMixture([{"kind": "markov", "alphabet": A, "order": 2, "support": 3, "concentration": 0.5}],
                          seq_len=64, min_doc_len=65, seed=0)
    batch = ds.samples(range(20))
    x_BT, floor_BT = _symbols(ds, batch, 0), batch.floor.numpy()
    src = ds.sources[0]
    for b in range(20):  # naive loop over positions, independent of the vectorised generator
        for t in range(64):
            if t < 2:
                want = math.log(A)
            else:
                c = x_BT[b, t - 2] * A + x_BT[b, t - 1]
                want = src.H_C[c]
                assert x_BT[b, t] in src.next_CS[c]  # only symbols in the context's support occur
            assert floor_BT[b, t] == pytest.approx(want, abs=1e-6)


def _ratio_and_se(sum_i, n_i):
    """Token-weighted mean sum(S)/sum(n) and its delta-method standard error over documents."""
    r = sum_i.sum() / n_i.sum()
    return r, np.std(sum_i - r * n_i, ddof=1) / (n_i.mean() * math.sqrt(len(n_i)))


def test_mean_floor_matches_floor_by_source():
    ds = build_data(DataConfig.from_dict(DEFAULT))
    batch = ds.samples(range(4000))
    valid = batch.labels.numpy() != IGNORE_INDEX
    floor = batch.floor.numpy().astype(np.float64)
    assert (floor[~valid] == 0).all()
    exact = ds.floor_by_source()
    for s, name in enumerate(ds.source_names):
        rows = batch.sources.numpy() == s
        r, se = _ratio_and_se(floor[rows].sum(1), valid[rows].sum(1))
        assert abs(r - exact[name]) < 5 * se + 1e-6, (name, r, exact[name], se)
    w = ds.weights
    assert ds.expected_floor() == pytest.approx(sum(wi * exact[n] for wi, n in zip(w, ds.source_names)), rel=1e-12)


def test_markov_position_floors_match_empirical_means():
    # A small chain whose context distribution drifts far from uniform (limit 0.72 vs uniform-context
    # mean 0.65 nats), so propagating the context distribution visibly matters.
    ds = SyntheticMixture([{"kind": "markov", "alphabet": 8, "order": 2, "support": 3, "concentration": 0.5}],
                          seq_len=32, min_doc_len=2, seed=2)
    batch = ds.samples(range(4000))
    valid = (batch.labels != IGNORE_INDEX).numpy()
    floor = batch.floor.numpy().astype(np.float64)
    f_T = ds.sources[0].position_floors(32)
    for t in range(2, 32):
        col = floor[valid[:, t], t]
        se = col.std(ddof=1) / math.sqrt(col.size)
        assert abs(col.mean() - f_T[t]) < 5 * se, (t, col.mean(), f_T[t], se)
    r, se = _ratio_and_se(floor.sum(1), valid.sum(1))
    assert abs(r - ds.floor_by_source()[ds.source_names[0]]) < 5 * se


def test_copy_floor_by_source_matches_naive_loop():
    ds = build_data(DataConfig.from_dict(DEFAULT))
    A, seg, m, T = 32, 12, 16, 128
    sums, counts = [], []
    for L in range(m, T + 2):  # uniform document length; L - 1 labels
        f = [math.log(A) if (t // seg) % 2 == 0 else 0.0 for t in range(L - 1)]
        sums.append(sum(f))
        counts.append(len(f))
    assert ds.floor_by_source()["copy"] == pytest.approx(np.mean(sums) / np.mean(counts), rel=1e-12)


def test_copy_source_copies_and_has_half_entropy():
    A, seg, T = 32, 12, 240  # 240 = 10 pairs of segments: the document floor is exactly log(A) / 2
    ds = SyntheticMixture([{"kind": "copy", "alphabet": A, "segment": seg}], seq_len=T, min_doc_len=T + 1, seed=5)
    batch = ds.samples(range(200))
    x_BT = _symbols(ds, batch, 0)
    blocks = x_BT.reshape(200, T // seg, seg)
    assert (blocks[:, 1::2] == blocks[:, 0::2]).all()  # the copied half equals the fresh half
    assert not (blocks[:, 2::2] == blocks[:, 0:-2:2]).all()  # and fresh segments are fresh
    np.testing.assert_allclose(batch.floor.numpy().mean(1), math.log(A) / 2, rtol=1e-6)
    assert ds.entropy_rates()["copy"] == pytest.approx(math.log(A) / 2)
    # Fresh symbols are uniform: 24000 draws, 750 expected per symbol, each count within 5 sigma.
    fresh = blocks[:, 0::2].ravel()
    counts = np.bincount(fresh, minlength=A)
    n, p = fresh.size, 1 / A
    assert np.abs(counts - n * p).max() < 5 * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.2, 0.5, 0.3]])
def test_mixture_frequencies_match_weights(weights):
    srcs = [{"name": f"s{i}", "kind": "copy" if i % 2 else "markov", "weight": w, "alphabet": 16}
            for i, w in enumerate(weights)]
    ds = SyntheticMixture(srcs, seq_len=32, min_doc_len=8, seed=3)
    n = 4000
    counts = np.bincount(ds.samples(range(n)).sources.numpy(), minlength=len(weights))
    for c, w in zip(counts, weights):
        assert abs(c - n * w) < 4 * math.sqrt(n * w * (1 - w)), (counts, weights)


def test_set_weights_changes_only_the_source_choice():
    ds = build_data(DataConfig.from_dict(DEFAULT))
    before = ds.samples(range(300))
    floor_before = ds.expected_floor()
    ds.set_weights([0.0, 1.0])
    after = ds.samples(range(300))
    assert (after.sources == 1).all()
    # Same lengths: the length draw does not depend on the weights.
    assert ((before.labels != IGNORE_INDEX).sum(1) == (after.labels != IGNORE_INDEX).sum(1)).all()
    # Samples that were already copy documents are unchanged.
    was_copy = before.sources == 1
    assert (before.tokens[was_copy] == after.tokens[was_copy]).all()
    assert ds.expected_floor() == pytest.approx(ds.floor_by_source()["copy"])
    assert ds.expected_floor() != pytest.approx(floor_before)
    with pytest.raises(ValueError, match="weights"):
        ds.set_weights([0.0, 0.0])


def test_sources_use_disjoint_token_ids():
    ds = build_data(DataConfig.from_dict(DEFAULT))
    ranges = ds.token_ranges()
    ids = [i for r in ranges for i in r]
    assert len(ids) == len(set(ids)) and sorted(ids) == list(range(1, ds.vocab_size))  # 0 is PAD
    assert ds.vocab_size == 1 + sum(1 + s["alphabet"] for s in DEFAULT["sources"])
    batch = ds.samples(range(500))
    tok, lab = batch.tokens.numpy(), batch.labels.numpy()
    valid = lab != IGNORE_INDEX
    for b in range(500):
        r = ranges[int(batch.sources[b])]
        assert tok[b, 0] == r.start  # the document opens with its source's BOS
        n = valid[b].sum()
        assert valid[b, :n].all() and (tok[b, n:] == PAD_ID).all()
        assert all(t in r for t in tok[b, :n]) and all(t in r[1:] for t in lab[b, :n])
        assert (tok[b, 1:n] == lab[b, :n - 1]).all()  # labels are the inputs shifted by one


def test_samples_are_pure_functions_of_id_and_split():
    ds = build_data(DataConfig.from_dict(DEFAULT))
    a, b = ds.samples([5, 3, 9]), ds.samples([9, 5])
    assert (a.tokens[0] == b.tokens[1]).all() and (a.tokens[2] == b.tokens[0]).all()
    assert (a.floor[2] == b.floor[0]).all() and a.sample_ids.tolist() == [5, 3, 9]
    val = ds.samples([5, 3, 9], split="val")
    assert not (val.tokens == a.tokens).all()
    with pytest.raises(ValueError, match="split"):
        ds.samples([0], split="test")


@pytest.mark.parametrize("patch, needle", [
    ({"kind": "foo"}, "data.kind=foo: expected one of synthetic, text"),
    ({"seq_len": 0}, "data.seq_len=0"),
    ({"min_doc_len": 1}, "data.min_doc_len=1"),
    ({"min_doc_len": 130}, "data.min_doc_len=130"),
    ({"sources": [{"kind": "copy"}, {"kind": "markov", "alphabet": 32, "support": 40}]},
     "data.sources[1].support=40 > alphabet=32"),
    ({"sources": [{"kind": "markov", "order": 0}]}, "data.sources[0].order=0"),
    ({"sources": [{"kind": "lstm"}]}, "data.sources[0].kind=lstm"),
    ({"sources": [{"kind": "copy", "weight": -1}]}, "data.sources[0].weight=-1"),
    ({"sources": [{"kind": "copy", "weight": 0}, {"kind": "markov", "weight": 0}]}, "not all zero"),
    ({"sources": [{"kind": "copy", "segmnt": 3}]}, "data.sources[0].segmnt: unknown key"),
    ({"sources": [{"kind": "copy"}, {"kind": "copy"}]}, "unique"),
])
def test_bad_config_raises_naming_the_key(patch, needle):
    with pytest.raises(ValueError) as e:
        build_data(DataConfig.from_dict({**DEFAULT, **patch}))
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("alphabet,order,support", [(32, 1, 4), (8, 2, 3), (5, 3, 5)])
def test_markov_draws_the_same_documents_one_at_a_time_and_vectorised(alphabet, order, support):
    """generate() draws a few documents in Python and many with numpy: the same symbols and floors either way."""
    from data.sources import ROWS_IN_PYTHON, MarkovSource

    src = MarkovSource("m", alphabet, order, support, 0.3, seed=7)
    u = np.random.default_rng(order).random((ROWS_IN_PYTHON + 5, 40))
    x, f = src.generate(u)  # the vectorised path
    for b in range(0, len(u), 6):
        xb, fb = src.generate(u[b:b + 1])  # one document: the Python path
        assert np.array_equal(xb[0], x[b]) and np.array_equal(fb[0], f[b]), b
