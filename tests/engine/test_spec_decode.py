"""Speculative decoding is lossless: greedy outputs with n-gram drafting equal outputs without, token for token,
through continuous batching, chunked prefill, prefix caching, sliding windows, KV-shared layers, preemption and
aborts; the sampled acceptance rule keeps the target's distribution exactly (chi-square against softmax)."""
import jax.numpy as jnp
import numpy as np
import pytest

import gemmajax
from gemmajax.engine import sampler as S
from gemmajax.engine.llm_engine import EngineConfig, LLMEngine
from gemmajax.engine.sampling_params import SamplingParams
from gemmajax.engine.spec_decode import SpecConfig, accepted_tokens, ngram_propose
from tests.golden.hf_models import E2B_SMALL, VARIANTS, build_hf_config, save_text_checkpoint


def test_ngram_propose_hand_computed():
    ids = [5, 6, 7, 8, 9, 5, 6, 7]
    assert ngram_propose(ids, 3, 2, 4) == [8, 9, 5]          # "5 6 7" seen before, followed by 8 9 5
    assert ngram_propose(ids, 1, 2, 4) == [8]
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []       # nothing repeats
    assert ngram_propose([1, 2, 1, 2, 1, 2], 2, 2, 2) == [1, 2]  # the latest match followed by 2 tokens: at 2
    assert ngram_propose([1, 2, 9, 1, 2, 8, 1, 2], 1, 2, 2) == [8]   # the latest match
    assert ngram_propose([1, 2, 9, 1, 2, 8, 1, 2], 3, 2, 2) == [8, 1, 2]   # the latest, 3 tokens after it
    assert ngram_propose([1, 2, 9, 1, 2, 8, 1, 2], 4, 2, 2) == [9, 1, 2, 8]   # the latest with 4 after it
    assert ngram_propose([4, 4, 4], 5, 1, 1) == [4, 4]       # none has 5 after it: the earliest, all that follows
    assert ngram_propose([3, 9, 3], 2, 2, 3) == []           # n_min 2: the single-token match does not count


def test_accepted_tokens():
    assert accepted_tokens([4, 5, 6], np.array([4, 5, 9, 1])) == ([4, 5, 9], 2)
    assert accepted_tokens([4, 5, 6], np.array([4, 5, 6, 1])) == ([4, 5, 6, 1], 3)   # all kept + bonus
    assert accepted_tokens([4], np.array([7, 1])) == ([7], 0)


def test_spec_config_errors():
    assert SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 3}).num_speculative_tokens == 3
    assert SpecConfig.parse({"model": "/x", "num_speculative_tokens": 2}).method == "draft_model"
    with pytest.raises(ValueError, match="unknown field"):
        SpecConfig.parse({"method": "ngram", "k": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 1"):
        SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpecConfig.parse({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2})


@pytest.mark.parametrize("temp,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.8)])
def test_coupled_verification_keeps_the_target_distribution(temp, top_k, top_p):
    """The engine's rule at a drafted position: sample the row as plain decoding would, keep the draft iff it is
    that token. Over 40,000 keys: the draft is kept with probability p(d), a rejected row never yields d, and the
    resulting token is distributed as the filtered softmax p (chi-square over tokens with expected count >= 5)."""
    rng = np.random.default_rng(0)
    v, n = 64, 40_000
    logits = rng.normal(size=v).astype(np.float32) * 2
    d = int(np.argsort(logits)[-3])                    # a plausible but not the most likely draft
    x = logits / temp
    p = np.exp(x - x.max())
    p /= p.sum()
    # vLLM's order: top-k, renormalise, then the most likely tokens until their mass reaches top_p
    order = np.argsort(-p)
    k = top_k or v
    pk = np.where(np.arange(v) < k, p[order], 0.0)
    pk /= pk.sum()
    before = np.cumsum(pk) - pk
    keep = np.zeros(v, bool)
    keep[order[(np.arange(v) < k) & (before < top_p)]] = True
    q = np.where(keep, p, 0)
    q /= q.sum()
    base, data = S.request_key_data(list(range(n)), [0] * n)
    col = lambda a, dt=jnp.float32: jnp.full((n,), a, dt)  # noqa: E731
    toks = np.asarray(S.sample(jnp.broadcast_to(jnp.asarray(logits), (n, v)), col(temp), col(top_k, jnp.int32),
                               col(top_p), col(0.0), col(0.0), col(0.0), col(1.0), None, None,
                               S.fold_keys(jnp.asarray(base), jnp.asarray(data))).tokens)
    out = [accepted_tokens([d], np.array([t, 0]))[0][0] for t in toks]
    kept = np.array([accepted_tokens([d], np.array([t, 0]))[1] for t in toks], bool)
    counts = np.bincount(out, minlength=v)
    assert counts[~keep].sum() == 0
    exp = q * n
    big = exp >= 5
    chi2 = (((counts - exp) ** 2 / np.where(big, exp, 1))[big]).sum()
    dof = big.sum() - 1
    # P(chi2 > dof + 5 sqrt(2 dof)) is about 1e-5 for these dof: a correct rule fails this once in 100,000 runs
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)
    assert abs(kept.mean() - q[d]) < 5 * np.sqrt(q[d] * (1 - q[d]) / n)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # block gain 4 (measured, seed 7): greedy outputs of 9-25 distinct tokens in 3-30 that still copy from their
    # prompts now and then, so n-gram drafts are kept whole, kept in part and rejected (6 / 2 / 10 rounds in
    # test_ngram_greedy_equals_plain_decoding). build_hf's gain 1 repeats one token (every draft passes); the
    # family's BLOCK_GAIN 8 never copies (no draft passes)
    m, cfg = build_hf_config(dict(VARIANTS["e2b"], **E2B_SMALL, family="gemma4"), seed=7, block_gain=4.0)
    return gemmajax.load_model(save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp("spec_e2b"))), "float32")


def _prompts(seed, n):
    """Prompts that invite copying (a repeated motif) and ones that do not, of mixed lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        motif = rng.integers(3, 512, size=rng.integers(3, 7)).tolist()
        tail = rng.integers(3, 512, size=rng.integers(1, 12)).tolist()
        out.append(motif * int(rng.integers(2, 5)) + tail if i % 3 else tail + [7] * 3)
    return out


def spy_accepts(eng) -> list[tuple[int, int]]:
    """Record (drafts, accepted) of every verification the engine makes."""
    accepts, orig = [], eng._accept

    def spy(d, t):
        out = orig(d, t)
        accepts.append((len(d), len(out) - 1))
        return out
    eng._accept = spy
    return accepts


def _run(model, tok, prompts, params, spec=None, abort_at=None, trace=None, **kw):
    """Runs the requests to the end (aborting abort_at = (step, request id)). trace, a dict, gets "drafted" (the
    requests that drafted tokens for verification), "preempted" (request ids, once per preemption) and
    "aborted_while" ("running" / "waiting": where the aborted request was at the abort)."""
    cfg = dict(max_model_len=128, max_num_seqs=3, max_num_batched_tokens=24, page_size=8, kv_cache_memory=1 << 22,
               token_buckets=(8, 24), seq_buckets=(3,), speculative=spec)
    cfg.update(kw)
    eng = LLMEngine(model.config, model.weights, tok, EngineConfig(**cfg))
    accepts = spy_accepts(eng)
    trace = {} if trace is None else trace
    trace.update(drafted=set(), preempted=[])
    preempt, propose = eng.scheduler._preempt, eng._propose

    def spy_preempt(seq):
        trace["preempted"].append(seq.request_id)
        preempt(seq)

    def spy_propose():
        propose()
        trace["drafted"] |= {s.request_id for s in eng.scheduler.running if s.spec_tokens}
    eng.scheduler._preempt, eng._propose = spy_preempt, spy_propose
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    done, steps = {}, 0
    while eng.has_unfinished():
        if abort_at is not None and steps == abort_at[0]:
            where = {s.request_id: w for w, q in (("running", eng.scheduler.running),
                                                  ("waiting", eng.scheduler.waiting)) for s in q}
            trace["aborted_while"] = where.get(abort_at[1])
            eng.abort_request(abort_at[1])
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        assert steps < 3000
    bm = eng.block_manager
    for g in bm.groups:
        assert bm.num_free_pages(g.name) == g.num_pages - 1, g
    return [done[f"r{i}"] for i in range(len(prompts))], eng, accepts


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_ngram_greedy_equals_plain_decoding(model, gemma4_tokenizer, prefix_caching):
    prompts = _prompts(1, 7)
    params = [SamplingParams(max_tokens=int(n), ignore_eos=True) for n in (20, 9, 30, 14, 25, 3, 18)]
    spec = SpecConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    # the plain baseline one token a step (num_scheduler_steps=1), so its step count is one per token
    want, plain, _ = _run(model, gemma4_tokenizer, prompts, params, enable_prefix_caching=prefix_caching,
                          num_scheduler_steps=1)
    got, eng, accepts = _run(model, gemma4_tokenizer, prompts, params, spec, enable_prefix_caching=prefix_caching)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == ["length"] * 7
    st = eng.spec_decode_stats()
    assert st["num_drafts"] == len(accepts) > 0 and st["num_draft_tokens"] == sum(k for k, _ in accepts)
    assert st["num_accepted_tokens"] == sum(m for _, m in accepts) > 0
    # every acceptance path ran: all drafts kept (plus the bonus token), some kept, none kept
    assert any(m == k for k, m in accepts) and any(0 < m < k for k, m in accepts) and any(m == 0 for _, m in accepts)
    assert eng.stats_counters["steps"] < plain.stats_counters["steps"]   # fewer steps than one token at a time


@pytest.mark.slow  # make test keeps n-gram == plain on the tiny models (all three acceptance paths: agreeing pair)
def test_ngram_on_the_real_model(gguf_file):
    """Gemma 3 270M, float32, prompts that invite copying: equal greedy text with and without drafting, and every
    acceptance path runs (all drafts kept plus the bonus token, some kept, none kept)."""
    llm = gemmajax.LLM(gguf_file, dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                       page_size=16, kv_cache_memory=1 << 26)
    prompts = ["Repeat this list: apple, banana, cherry, apple, banana, cherry, apple,",
               "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
               "The capital of France is"]
    p = gemmajax.SamplingParams(max_tokens=40, ignore_eos=True)
    want = llm.generate(prompts, p)
    spec = gemmajax.LLM(gguf_file, dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                        page_size=16, kv_cache_memory=1 << 26,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    accepts = spy_accepts(spec.engine)
    got = spec.generate(prompts, p)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert any(m == k for k, m in accepts) and any(0 < m < k for k, m in accepts) and any(m == 0 for _, m in accepts)
    st = spec.spec_decode_stats()
    assert st["num_accepted_tokens"] == sum(m for _, m in accepts)


def test_ngram_with_preemption_abort_and_seeded_sampling(model, gemma4_tokenizer):
    prompts = _prompts(5, 6)  # seed and abort step chosen so that the trace below happens (it is asserted)
    params = [SamplingParams(max_tokens=24, ignore_eos=True) for _ in prompts]
    params[2] = SamplingParams(max_tokens=24, temperature=0.8, top_k=30, seed=9, ignore_eos=True)
    spec = SpecConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2)
    kw = dict(max_num_batched_tokens=16, token_buckets=(8, 16))
    # the reference: plain decoding in a roomy pool
    want, _, _ = _run(model, gemma4_tokenizer, prompts, params, kv_cache_memory=1 << 22, **kw)
    # drafting in a pool too small for three sequences at once (5 + 17 pages of 8): preemption by recompute in the
    # middle of speculation (the seeded sampled request r2 drafts and is preempted), and an abort of a running,
    # drafting request
    trace = {}
    small, eng, accepts = _run(model, gemma4_tokenizer, prompts, params, spec, kv_cache_memory=95_000,
                               abort_at=(40, "r3"), trace=trace, **kw)
    assert eng.spec.num_pages == (5, 17) and eng.scheduler.num_preemptions > 0
    assert "r2" in trace["preempted"] and "r2" in trace["drafted"], trace
    assert trace["aborted_while"] == "running" and "r3" in trace["drafted"], trace
    assert any(m > 0 for _, m in accepts)   # some drafts were kept: tokens came from verification rows
    for i, (a, b) in enumerate(zip(want, small)):
        if i == 3:
            assert b.finish_reason == "abort"
        else:
            # the seeded sampled request too: its draws follow its tokens (same keys, same draws as plain decoding)
            assert a.token_ids == b.token_ids, i


# ------------------------------------------------------------------------------------------ the assistant drafter

def _drafter_engine(tmp_path, target, tcfg, drafter, k=3, **kw):
    t_dir, d_dir = str(tmp_path / "target"), str(tmp_path / "drafter")
    save_text_checkpoint(target, tcfg, t_dir)
    drafter.save_pretrained(d_dir)
    model = gemmajax.load_model(t_dir, "float32")
    return model, d_dir, SpecConfig(method="draft_model", model=d_dir, num_speculative_tokens=k)


def _record_drafts(eng):
    """Every drafting round: (the sequence's tokens [0, p] when drafting, the drafts)."""
    rounds, orig = [], eng._propose

    def spy():
        orig()
        for seq in eng.scheduler.running:
            if seq.spec_tokens:
                rounds.append((list(seq.token_ids), list(seq.spec_tokens)))
    eng._propose = spy
    return rounds


@pytest.mark.parametrize("variant", ["e2b", pytest.param("31b", marks=pytest.mark.slow)])
def test_assistant_drafts_are_hfs_and_output_equals_plain(tmp_path, gemma4_tokenizer, variant):
    """A random target + gemma4_assistant pair (E2B-like: KV-shared store layers, PLE; 31B-like: K=V full layers):
    batched mixed-length greedy requests give the plain tokens, and every round's drafts equal HF's own
    Gemma4AssistantForCausalLM run at that state with exactly the target's K/V of the positions before the drafted
    token (tests/golden/hf_assistant.hf_draft), so the acceptance counts are HF's."""
    from tests.golden.hf_assistant import build_assistant, build_target, hf_draft
    target, tcfg = build_target(variant, seed=0)
    drafter, _ = build_assistant(tcfg, seed=1, ordered=variant == "e2b")
    model, _, spec = _drafter_engine(tmp_path, target, tcfg, drafter)
    prompts = _prompts(4, 5)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 7, 15, 9, 11)]
    want, _, _ = _run(model, gemma4_tokenizer, prompts, params)
    cfg = dict(max_model_len=128, max_num_seqs=3, max_num_batched_tokens=24, page_size=8, kv_cache_memory=1 << 22,
               token_buckets=(8, 24), seq_buckets=(3,), speculative=spec)
    eng = LLMEngine(model.config, model.weights, gemma4_tokenizer, EngineConfig(**cfg))
    rounds = _record_drafts(eng)
    accepts = spy_accepts(eng)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert [done[f"r{i}"].token_ids for i in range(5)] == [o.token_ids for o in want]
    assert rounds and len(accepts) >= len(rounds) // 2
    for ids, drafts in rounds:
        hf, _, _ = hf_draft(drafter, target, np.asarray(ids[:-1]), ids[-1], len(drafts))
        assert drafts == hf, (ids, drafts, hf)


def test_agreeing_assistant_is_accepted(tmp_path, gemma4_tokenizer):
    """A drafter built to agree with its target (tests/golden/hf_assistant.build_agreeing_pair) drafts the
    target's continuation: nearly every draft is kept (bonus tokens included), in fewer steps, same tokens."""
    from tests.golden.hf_assistant import SINKS, build_agreeing_pair
    target, tcfg, drafter, _ = build_agreeing_pair()
    model, _, spec = _drafter_engine(tmp_path, target, tcfg, drafter, k=4)
    rng = np.random.default_rng(0)
    prompts = [[SINKS[i % 2]] + rng.integers(max(SINKS) + 1, 512, size=9).tolist() for i in range(3)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True) for _ in prompts]
    want, plain, _ = _run(model, gemma4_tokenizer, prompts, params, num_scheduler_steps=1)   # a token a step
    got, eng, accepts = _run(model, gemma4_tokenizer, prompts, params, spec)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    st = eng.spec_decode_stats()
    assert st["num_accepted_tokens"] >= 0.9 * st["num_draft_tokens"] > 0, st
    assert any(m == k for k, m in accepts)
    assert eng.stats_counters["steps"] < plain.stats_counters["steps"] / 2


def test_spec_stats_on_metrics(model, gemma4_tokenizer):
    """The cumulative counts reach /metrics as Prometheus counters (vLLM's names), equal to spec_decode_stats()."""
    from starlette.testclient import TestClient

    from gemmajax.engine.async_engine import AsyncEngineClient
    from gemmajax.server.app import build_app
    spec = SpecConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    got, eng, _ = _run(model, gemma4_tokenizer, _prompts(1, 3), [SamplingParams(max_tokens=24, ignore_eos=True)] * 3,
                       spec)
    client = AsyncEngineClient(eng, model_name="m", tokenizer=gemma4_tokenizer)
    try:
        text = TestClient(build_app(client)).get("/metrics").text
    finally:
        client.shutdown()
    st = eng.spec_decode_stats()
    assert st["num_accepted_tokens"] > 0
    for key, value in st.items():
        assert f"gemmajax_spec_decode_{key}_total {float(value)}" in text, key


@pytest.fixture(scope="module")
def real_vocab_model(tmp_path_factory):
    """E2B-like over the real 262,144-token vocabulary (a grammar's tokens must exist in the model's vocabulary)."""
    from tests.golden.hf_models import REAL_VOCAB
    m, cfg = build_hf_config(dict(VARIANTS["e2b"], **E2B_SMALL, family="gemma4", vocab_size=REAL_VOCAB,
                                  vocab_size_per_layer_input=REAL_VOCAB), seed=7)
    return gemmajax.load_model(save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp("spec_rv"))), "float32")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 6}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.mark.parametrize("kv_dtype", [pytest.param("float32", marks=pytest.mark.slow), "fp8_e4m3"])
def test_ngram_with_a_grammar_and_fp8_pages_equals_plain(real_vocab_model, gemma4_tokenizer, kv_dtype,
                                                          monkeypatch):
    """n-gram drafting under a JSON schema (drafts the grammar forbids are cut, the rest verified under its masks)
    and over fp8 pages (the verify step writes and reads them as decoding does): greedy and seeded sampled tokens
    equal the same engine without drafting, every constrained output that stopped parses and fits the schema, and
    drafts were accepted (so the paths ran)."""
    import json
    # the constrained requests' prompts hold answers of the schema's shape, so n-gram drafting has text to copy
    shots = ['{"a":12,"b":["yy","x"]}\n{"a":3,"b":["x"]}\n', '{"a":70,"b":[]}\n', '{"a":5,"b":["x","x","yy"]}\n']
    prompts = [p if i % 2 == 0 else gemma4_tokenizer.encode(shots[i // 2] * 2)
               for i, p in enumerate(_prompts(3, 6))]
    params = [SamplingParams(max_tokens=40, json_schema=SCHEMA, temperature=0.0 if i % 4 == 1 else 1.0, seed=i)
              if i % 2 else
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0 if i % 3 else 0.8, seed=50 + i)
              for i in range(6)]
    spec = SpecConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    want, _, _ = _run(real_vocab_model, gemma4_tokenizer, prompts, params, kv_dtype=kv_dtype)
    kept = []   # drafts of constrained requests that the grammar let through to verification
    masks = LLMEngine._grammar_masks

    def spy(self, c, d):
        out = masks(self, c, d)
        kept.append(len(out[0]))
        return out
    monkeypatch.setattr(LLMEngine, "_grammar_masks", spy)
    got, _, accepts = _run(real_vocab_model, gemma4_tokenizer, prompts, params, spec, kv_dtype=kv_dtype)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stopped = 0
    for i in range(1, 6, 2):
        assert got[i].finish_reason in ("stop", "length"), got[i]
        if got[i].finish_reason == "stop":
            v = json.loads(got[i].text)
            assert set(v) == {"a", "b"} and 0 <= v["a"] <= 99 and len(v["b"]) <= 6, got[i].text
            stopped += 1
    assert stopped >= 2, [o.text for o in got]
    assert sum(m for _, m in accepts) >= 3, accepts
    assert sum(kept) >= 3, kept   # the verify-under-masks path ran


def test_a_grammar_outside_the_vocabulary_fails_only_its_request(model, gemma4_tokenizer):
    """A 512-token model with the 262,144-token tokenizer: the JSON grammar's tokens all lie outside the model's
    vocabulary, so its mask allows nothing. That request ends with finish_reason "error" and a message naming it;
    the greedy requests batched with it finish as they do alone."""
    prompts = _prompts(4, 3)
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0),
              SamplingParams(max_tokens=10, json_schema=SCHEMA),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)]
    alone, _, _ = _run(model, gemma4_tokenizer, [prompts[0], prompts[2]], [params[0], params[2]])
    outs, _, _ = _run(model, gemma4_tokenizer, prompts, params)
    assert outs[1].finish_reason == "error" and "'r1'" in outs[1].error, outs[1]
    assert "not allowed by the grammar" in outs[1].error, outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == [alone[0].token_ids, alone[1].token_ids]
