"""Sampler: greedy and top-k=1 equal argmax, seeded draws are reproducible across batches, empirical
distributions match the analytic min-p / top-k / top-p / temperature distribution (vLLM's order), penalties
match hand-computed logits, masks are never violated, logprobs are the raw log_softmax, and the top-k/top-p
thresholds equal a numpy sort on both the fast path and the exact fallback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmajax.engine import sampler as S
from gemmajax.engine.sampling_params import SamplingParams


def keys_for(n, counter=0, seeds=None, n_out=None):
    """Keys of n rows; a None seed stands for an unseeded request: seed 2**40 + counter + row (the engine draws
    such seeds per request)."""
    seeds = [None] * n if seeds is None else seeds
    seeds = [(1 << 40) + counter + i if s is None else s for i, s in enumerate(seeds)]
    n_out = [0] * n if n_out is None else n_out
    base, data = S.request_key_data(seeds, n_out)
    return S.fold_keys(jnp.asarray(base), jnp.asarray(data))


def run(logits, temps=1.0, top_ks=0, top_ps=1.0, min_ps=0.0, keys=None, counts=None, seen=None, presence=0.0,
        frequency=0.0, repetition=1.0, **kw):
    logits = jnp.asarray(logits, jnp.float32)
    b = logits.shape[0]

    def col(v, dtype=jnp.float32):
        return jnp.broadcast_to(jnp.asarray(v, dtype), (b,))

    return S.sample(logits, col(temps), col(top_ks, jnp.int32), col(top_ps), col(min_ps), col(presence),
                    col(frequency), col(repetition), counts, seen, keys_for(b) if keys is None else keys, **kw)


def analytic(logits, t, k, p, min_p):
    """vLLM's order in float64: temperature, min-p, top-k, top-p (renormalised after top-k)."""
    x = np.asarray(logits, np.float64) / t
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    order = np.argsort(-x, kind="stable")
    if 0 < k < len(x):
        keep[order[k:]] = False
    q = np.where(keep, probs, 0.0)
    q /= q.sum()
    cum = np.cumsum(q[order])
    drop = (cum - q[order]) >= p
    keep[order[drop]] = False
    q = np.where(keep, probs, 0.0)
    return q / q.sum()


# No ties: tokens tied at a top-k / top-p threshold are all kept, unlike a stable sort.
LOGITS8 = np.log(np.array([0.3, 0.2, 0.15, 0.11, 0.09, 0.08, 0.05, 0.02]))[[3, 0, 6, 1, 7, 2, 5, 4]]


@pytest.mark.parametrize("candidate_k", [1024, 2])  # 2: top-k 3/5 and most top-p rows take the exact fallback
def test_empirical_distribution_matches_analytic(candidate_k):
    configs = [(1.0, 0, 1.0, 0.0), (0.5, 0, 1.0, 0.0), (2.0, 3, 1.0, 0.0), (1.0, 0, 0.7, 0.0),
               (1.0, 0, 1.0, 0.3), (1.3, 5, 0.8, 0.05), (0.8, 2, 0.95, 0.0)]
    n = 4000
    rows = np.array([c for c in configs for _ in range(n)])
    logits = np.broadcast_to(LOGITS8, (len(rows), 8))
    out = run(logits, rows[:, 0], rows[:, 1].astype(int), rows[:, 2], rows[:, 3], keys=keys_for(len(rows), 7),
              candidate_k=candidate_k)
    tokens = np.asarray(out.tokens).reshape(len(configs), n)
    for cfg, toks in zip(configs, tokens):
        expect = analytic(LOGITS8, *cfg)
        freq = np.bincount(toks, minlength=8) / n
        assert np.all(freq[expect == 0] == 0), (cfg, freq, expect)
        assert np.abs(freq - expect).max() < 0.03, (cfg, freq, expect)


def test_greedy_and_top_k_1_are_argmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 3000)).astype(np.float32) * 4
    expect = logits.argmax(-1)
    np.testing.assert_array_equal(run(logits, temps=0.0).tokens, expect)
    np.testing.assert_array_equal(run(logits, temps=1.0, top_ks=1).tokens, expect)
    np.testing.assert_array_equal(run(logits, temps=5.0, top_ks=1, top_ps=0.5).tokens, expect)
    # Mixed batch: greedy rows stay argmax whatever the sampled rows do.
    temps = np.array([0.0, 2.0, 0.0, 2.0, 0.0, 2.0])
    toks = np.asarray(run(logits, temps=temps).tokens)
    np.testing.assert_array_equal(toks[temps == 0], expect[temps == 0])


def test_seeded_rows_reproduce_in_any_batch():
    rng = np.random.default_rng(1)
    row = rng.normal(size=1000).astype(np.float32)
    other = rng.normal(size=(5, 1000)).astype(np.float32)
    base, data = S.request_key_data([1234], [5])
    np.testing.assert_array_equal(S.fold_keys(jnp.asarray(base), jnp.asarray(data))[0],
                                  jax.random.fold_in(jax.random.PRNGKey(1234), 5))
    alone = run(row[None], keys=keys_for(1, seeds=[1234], n_out=[5])).tokens[0]
    again = run(row[None], keys=keys_for(1, counter=99, seeds=[1234], n_out=[5])).tokens[0]
    batch = np.concatenate([other[:3], row[None], other[3:]])
    seeds = [None, 7, None, 1234, 8, None]
    in_batch = run(batch, keys=keys_for(6, counter=50, seeds=seeds, n_out=[0, 1, 2, 5, 3, 0])).tokens[3]
    assert int(alone) == int(again) == int(in_batch)
    # The draw moves on with the output length; unseeded rows differ across counters.
    steps = [int(run(row[None], keys=keys_for(1, seeds=[1234], n_out=[i])).tokens[0]) for i in range(20)]
    assert len(set(steps)) > 5
    unseeded = [int(run(row[None], keys=keys_for(1, counter=c)).tokens[0]) for c in range(20)]
    assert len(set(unseeded)) > 5


def test_penalties_hand_computed():
    logits = np.array([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0], [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]], np.float32)
    prompt = jnp.array([[0, 1, -1], [3, -1, -1]])
    output = jnp.array([[2, 2, 4], [4, -1, -1]])
    counts, seen = S.penalty_inputs(prompt, output, 6)
    np.testing.assert_array_equal(counts, [[0, 0, 2, 0, 1, 0], [0, 0, 0, 0, 1, 0]])
    np.testing.assert_array_equal(seen, [[1, 1, 1, 0, 1, 0], [0, 0, 0, 1, 1, 0]])
    presence, frequency, repetition = jnp.array([0.25, 1.5]), jnp.array([0.5, 0.0]), jnp.array([2.0, 1.0])
    got = S.apply_penalties(jnp.asarray(logits), counts, seen, presence, frequency, repetition)
    # Row 0: repetition 2 on {0, 1, 2, 4}: 2 -> 1, -1 -> -2, 0.5 -> 0.25, 3 -> 1.5; then token 2 (count 2):
    # 0.25 - 0.5*2 - 0.25 = -1.0 and token 4 (count 1): 1.5 - 0.5 - 0.25 = 0.75.  Row 1: presence 1.5 on 4.
    np.testing.assert_allclose(got, [[1.0, -2.0, -1.0, -0.5, 0.75, 0.0], [2.0, -1.0, 0.5, -0.5, 1.5, 0.0]])
    out = run(logits, temps=0.0, counts=counts, seen=seen, presence=presence, frequency=frequency,
              repetition=repetition)
    np.testing.assert_array_equal(out.tokens, [0, 0])  # 4 without penalties
    np.testing.assert_array_equal(run(logits, temps=0.0).tokens, [4, 4])


def test_token_counts_ignores_padding_and_out_of_range():
    ids = jnp.array([[1, 1, 3, -1, 7], [0, 9, -1, -1, 2]])
    np.testing.assert_array_equal(S.token_counts(ids, 8), [[0, 2, 0, 1, 0, 0, 0, 1], [1, 0, 1, 0, 0, 0, 0, 0]])


def test_allowed_mask_and_banned_ids_never_violated():
    rng = np.random.default_rng(2)
    b, v = 64, 300
    logits = rng.normal(size=(b, v)).astype(np.float32) * 3
    mask = rng.random((b, v)) < 0.1
    mask[np.arange(b), rng.integers(0, v, b)] = True
    temps = np.where(np.arange(b) % 3 == 0, 0.0, 1.5)
    top_ps = np.where(np.arange(b) % 2 == 0, 0.9, 1.0)
    for counter in range(5):
        out = run(logits, temps=temps, top_ps=top_ps, keys=keys_for(b, counter * b), allowed_mask=jnp.asarray(mask))
        toks = np.asarray(out.tokens)
        assert mask[np.arange(b), toks].all()
    greedy_masked = np.where(mask, logits, -np.inf).argmax(-1)
    np.testing.assert_array_equal(np.asarray(out.tokens)[temps == 0], greedy_masked[temps == 0])

    best = logits.argmax(-1)
    banned = np.stack([best, np.full(b, -1)], axis=1)
    out = run(logits, temps=0.0, banned_ids=jnp.asarray(banned))
    second = np.argsort(-logits, axis=-1)[:, 1]
    np.testing.assert_array_equal(out.tokens, second)
    for counter in range(3):
        out = run(logits, temps=3.0, keys=keys_for(b, counter * b), banned_ids=jnp.asarray(banned))
        assert not np.any(np.asarray(out.tokens) == best)


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 500)).astype(np.float32) * 2
    ref = jax.nn.log_softmax(jnp.asarray(logits, jnp.float64) if jax.config.x64_enabled else logits, axis=-1)
    ref = np.asarray(ref, np.float64)
    counts = jnp.zeros((4, 500), jnp.int32).at[:, logits.argmax(-1)].set(0)
    seen = jnp.zeros((4, 500), bool).at[jnp.arange(4), logits.argmax(-1)].set(True)
    out = run(logits, temps=0.7, counts=counts, seen=seen, repetition=1.8, top_ps=0.9, num_logprobs=5)
    toks = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprob, ref[np.arange(4), toks], rtol=0, atol=2e-5)
    order = np.argsort(-logits, axis=-1)[:, :5]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, order, -1), rtol=0, atol=2e-5)
    assert run(logits).top_ids.shape == (4, 0)


def reference_keep(y, k, p):
    """Kept set of top-k then top-p over scaled logits y (float64 numpy)."""
    order = np.argsort(-y, kind="stable")
    keep = np.isfinite(y)
    if 0 < k < len(y):
        keep[order[k:]] = False
    q = np.where(keep, np.exp(y - y.max()), 0.0)
    q /= q.sum()
    cum = np.cumsum(q[order])
    keep[order[(cum - q[order]) >= p]] = False
    return keep


@pytest.mark.parametrize("candidate_k", [4096, 64, 4])
def test_thresholds_match_sort(candidate_k):
    rng = np.random.default_rng(4)
    b, v = 12, 4096
    y = (rng.normal(size=(b, v)) * rng.uniform(0.5, 6, (b, 1))).astype(np.float32)
    y[0, :100] = -np.inf  # masked tokens
    ks = np.array([0, 1, 10, 50, 100, 0, 0, 3000, 20, 0, 70, 4095], np.int32)
    ps = np.array([0.9, 1.0, 1.0, 0.5, 0.95, 0.99, 0.3, 0.9, 0.999, 1.0, 0.6, 0.97], np.float32)
    yj = jnp.asarray(y)
    tau = S._thresholds(yj, jnp.max(yj, -1), jnp.asarray(ks), jnp.asarray(ps), candidate_k)
    kept = y >= np.asarray(tau)[:, None]
    for i in range(b):
        np.testing.assert_array_equal(kept[i], reference_keep(y[i].astype(np.float64), ks[i], ps[i]), err_msg=str(i))


def test_unpack_token_bitmask():
    rng = np.random.default_rng(5)
    bits = rng.random((3, 70)) < 0.5
    words = np.zeros((3, 3), np.uint32)
    for r, c in zip(*np.nonzero(bits)):
        words[r, c // 32] |= np.uint32(1 << (c % 32))
    np.testing.assert_array_equal(S.unpack_token_bitmask(jnp.asarray(words.view(np.int32)), 70), bits)


def test_sampling_arrays():
    arrs = S.sampling_arrays([SamplingParams(temperature=0.5, top_k=-1, top_p=0.9), SamplingParams(top_k=5)])
    np.testing.assert_array_equal(arrs["top_ks"], [0, 5])
    np.testing.assert_allclose(arrs["temps"], [0.5, 0.0])
    np.testing.assert_allclose(arrs["top_ps"], [0.9, 1.0])


@pytest.mark.parametrize("bad, match", [
    (dict(temperature=-1), "temperature must be >= 0, got -1"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_k=-2), "top_k must be >= 0"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (dict(presence_penalty=3), r"presence_penalty must be in \[-2, 2\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(logprobs=21), r"logprobs must be in \[0, 20\], got 21"),
    (dict(min_tokens=100), "min_tokens must be <= max_tokens"),
    (dict(stop=[""]), "stop must hold non-empty strings"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(json_schema={}, grammar="x"), "exclusive"),
    (dict(temperature=float("nan")), "temperature"),
])
def test_sampling_params_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams(stop="END", stop_token_ids=(3, 4))
    assert p.stop == ["END"] and p.stop_token_ids == [3, 4] and p.max_tokens == 64 and p.greedy
    assert SamplingParams().stop == [] and not SamplingParams().uses_penalties
