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


def test_greedy_argmax_of_16_bit_logits_equals_the_float32_copy():
    """The step's greedy token is the argmax of the activation-dtype logits (runner.model_step): it must be the first
    index of the row maximum of their float32 copy, the sampler's rule, also with the ties that bf16 rounding makes
    common, -inf rows and vocabularies that are not whole 512-token blocks; with round_to, on float32 sums that only
    tie once rounded. A row with a NaN gets some in-range token
    (XLA:CPU's float32 max reduction skips NaN, the 16-bit one does not: such rows are garbage either way)."""
    rng = np.random.default_rng(7)
    for v in (7, 512, 1000, 262_144 + 3):
        for dt in (jnp.bfloat16, jnp.float16):
            x = (rng.normal(size=(5, v)) * rng.choice([0.01, 1.0, 30.0])).astype(np.float32)
            x[1, rng.integers(0, v, 3)] = x[1].max() + 1.0   # a tie of three at the maximum
            x[2] = -np.inf
            x[3] = np.round(x[3] * 4) / 4                     # many exact ties
            x[4, rng.integers(0, v)] = np.nan
            low = jnp.asarray(x).astype(dt)
            want = np.asarray(low.astype(jnp.float32))
            expect = want[:4].argmax(-1)                      # numpy: the first index of the maximum
            got = np.asarray(jax.jit(S._argmax)(low))
            np.testing.assert_array_equal(got[:4], expect, err_msg=f"V={v} {dt}")
            np.testing.assert_array_equal(np.asarray(jax.jit(S._argmax)(low.astype(jnp.float32)))[:4], expect)
            assert 0 <= got[4] < v, (v, dt, got[4])
            # round_to: float32 sums rounded inside the argmax (runner.greedy_tokens) pick the rounded copy's token;
            # values a hair apart in float32 tie once rounded, so the first of them must win, not the largest
            fine = want[:4] * (1 + rng.uniform(-1e-4, 1e-4, size=want[:4].shape)).astype(np.float32)
            i, j = sorted(rng.choice(v, 2, replace=False))
            fine[0] = np.clip(fine[0], -0.5, 0.5)
            fine[0, i], fine[0, j] = 1.0, 1.0 + 2.0 ** -12  # j is the float32 maximum; rounded, i ties and comes first
            ref = np.asarray(jnp.asarray(fine).astype(dt).astype(jnp.float32)).argmax(-1)
            assert ref[0] == i and fine[0].argmax() == j
            np.testing.assert_array_equal(np.asarray(jax.jit(S._argmax, static_argnums=1)(jnp.asarray(fine), dt)),
                                          ref, err_msg=f"round_to V={v} {dt}")


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
    (dict(temperature=-1), "temperature must be >= 0 and finite in float32, got -1"),
    (dict(temperature=1e308), "temperature must be >= 0 and finite in float32"),
    (dict(top_k=2**31), r"top_k must be in \[-1, 2\*\*31 - 1\]"),
    (dict(repetition_penalty=1e-300), "repetition_penalty must be > 0 and a normal float32"),
    (dict(thinking_token_budget=-1), r"thinking_token_budget must be >= 0, got -1"),
    (dict(n=0), "n must be >= 1, got 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_k=-2), r"top_k must be in \[-1"),
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


# -- through the engine ----------------------------------------------------------------------------------

ENGINE_N = 3000          # samples per setting
P_FAIL = 1e-4            # per setting: a correct sampler fails the chi-square test with this probability
ENGINE_SETTINGS = [      # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0), (0.7, 8, 1.0, 0.0), (1.5, 0, 0.6, 0.0), (1.0, 0, 1.0, 0.2), (1.2, 30, 0.9, 0.05),
]


@pytest.fixture(scope="module")
def spread_model(tmp_path_factory):
    """A tiny random Gemma 4 (PLE, KV sharing) whose next-token distribution is spread over many tokens: the final
    norm is scaled down so the logits have a standard deviation of about 1.5 instead of 8."""
    import gemmajax
    from tests.golden.hf_models import VARIANTS, build_hf_config, save_text_checkpoint
    hf, cfg = build_hf_config(dict(VARIANTS["e2b"], family="gemma4"), seed=21)
    import torch
    with torch.no_grad():
        hf.model.norm.weight.mul_(0.2)
    return gemmajax.load_model(save_text_checkpoint(hf, cfg, str(tmp_path_factory.mktemp("spread"))),
                               dtype="float32")


def _engine(model, tok, **kw):
    from gemmajax.engine.llm_engine import EngineConfig, LLMEngine
    kw = {**dict(max_model_len=64, max_num_seqs=64, max_num_batched_tokens=128, page_size=8, kv_cache_memory=1 << 24,
                 token_buckets=(128,), seq_buckets=(64,)), **kw}
    return LLMEngine(model.config, model.weights, tok, EngineConfig(**kw))


def _run(eng, requests):
    """requests: (request_id, prompt ids, SamplingParams). Returns request_id -> final RequestOutput."""
    for rid, p, sp in requests:
        eng.add_request(rid, p, sp)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's chi-square p-value of observed `counts` against `probs` (tokens whose expected count is below 5
    lumped into one bin). Returns (p, degrees of freedom)."""
    import torch
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # too small a remainder for its own bin: merge it into the smallest bin
        j = int(np.argmin(exp[:-1]))
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))), df


def test_engine_samples_the_numpy_distribution(spread_model, gemma4_tokenizer):
    """Seeded temperature / top-k / top-p / min-p requests through LLMEngine: the first token's empirical frequencies
    match `analytic` (a float64 numpy reimplementation of vLLM's order) applied to the engine's own logits, by
    Pearson's chi-square at significance P_FAIL per setting (so a correct sampler fails this test with probability
    below len(ENGINE_SETTINGS) x P_FAIL = 5e-4), and no token outside the kept set is ever drawn.

    The logits are `model.logits` of the prompt; that they are the engine's own is checked against the top-20
    logprobs every request returns (to 1e-4; every request asks for them, so one sampler program serves all)."""
    model = spread_model
    prompt = [2, 17, 304, 99, 411, 250, 7, 380, 45]
    logits = model.logits(np.asarray(prompt))[-1].astype(np.float64)
    ref_lp = logits - np.logaddexp.reduce(logits)
    probs1 = np.exp(ref_lp)
    assert probs1.max() < 0.5 and (probs1 > 0.01).sum() >= 15, "the test needs a spread distribution"
    reqs = []
    for c, (t, k, p, mp) in enumerate(ENGINE_SETTINGS):
        for i in range(ENGINE_N):
            reqs.append((f"{c}.{i}", prompt, SamplingParams(max_tokens=1, temperature=t, top_k=k, top_p=p, min_p=mp,
                                                            seed=c * ENGINE_N + i, ignore_eos=True, logprobs=20)))
    done = _run(_engine(model, gemma4_tokenizer), reqs)
    lp = done["0.0"].logprobs[0]
    assert [t for t, _ in lp["top"]] == list(np.argsort(-logits)[:20])
    for t, v in lp["top"]:
        assert abs(v - ref_lp[t]) < 1e-4, (t, v, ref_lp[t])
    for c, setting in enumerate(ENGINE_SETTINGS):
        toks = np.array([done[f"{c}.{i}"].token_ids[0] for i in range(ENGINE_N)])
        expect = analytic(logits, *setting)
        counts = np.bincount(toks, minlength=len(expect))
        assert counts[expect == 0].sum() == 0, (setting, np.nonzero(counts * (expect == 0))[0])
        pval, df = chi_square_p(counts, expect)
        assert pval > P_FAIL, (setting, pval, df)


def test_seeded_request_is_the_same_in_any_batch(spread_model, gemma4_tokenizer):
    """A seeded sampled request gives the same tokens and text alone and among other random requests (greedy,
    seeded and unseeded sampled, other lengths), in other rows of other batches, its prompt chunked differently
    (a 16-token budget shared with the requests queued before it; no prefix caching). One engine, so one set of
    compiled programs."""
    model = spread_model
    rng = np.random.default_rng(8)
    target = list(map(int, rng.integers(3, 512, size=23)))
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, min_p=0.02, seed=4321, ignore_eos=True)
    eng = _engine(model, gemma4_tokenizer, max_num_seqs=6, seq_buckets=(8,), page_size=4, max_num_batched_tokens=16,
                  token_buckets=(16,), enable_prefix_caching=False)
    alone = _run(eng, [("alone", target, sp)])["alone"]
    assert len(set(alone.token_ids)) > 4  # a real sample, not a repeated token
    others = []
    for i in range(10):
        kind = i % 3
        p = SamplingParams(max_tokens=int(rng.integers(4, 20)), ignore_eos=True,
                           **({} if kind == 0 else dict(temperature=float(rng.uniform(0.5, 1.5)),
                                                        seed=None if kind == 1 else int(rng.integers(1 << 30)))))
        others.append((f"o{i}", list(map(int, rng.integers(3, 512, size=int(rng.integers(1, 40))))), p))
    crowd = _run(eng, others[:3] + [("crowd", target, sp)] + others[3:])["crowd"]
    assert (crowd.token_ids, crowd.text) == (alone.token_ids, alone.text)
