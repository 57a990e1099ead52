"""Driving an LLMEngine to the end in tests that compare two engines' outputs."""


def tokens_and_logprobs(eng, prompts, params) -> list[tuple[list[int], list[dict]]]:
    """Adds request r<i> for each (prompt ids, SamplingParams), steps the engine until every request finishes, and
    returns per request (its output token ids, the logprob entries of all its tokens): `RequestOutput.logprobs`
    holds only each step's new tokens', so they are gathered over the steps."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    done, lps = {}, {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            lps[o.request_id] += o.logprobs or []
            if o.finished:
                done[o.request_id] = o
    return [(done[f"r{i}"].token_ids, lps[f"r{i}"]) for i in range(len(prompts))]


def small_engine_mixed_batch(model, tok, seed: int, **config):
    """A small LLMEngine over `model` (EngineConfig `config` on top of a 16-token, 4-sequence setup) and the outputs of
    a batch that mixes prefill chunks and decodes: three prompts (5, 19 and 11 random ids) greedy, sampled with 4
    logprobs, and greedy with 2 (tokens_and_logprobs). Returns (engine, outputs)."""
    import numpy as np

    from gemmajax.engine.llm_engine import EngineConfig, LLMEngine
    from gemmajax.engine.sampling_params import SamplingParams
    eng = LLMEngine(model.config, model.weights, tok, EngineConfig(
        max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, page_size=8, kv_cache_memory=1 << 24,
        token_buckets=(16,), seq_buckets=(4,), **config))
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(3, 512, size=n))) for n in (5, 19, 11)]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.9, seed=3, logprobs=4, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)]
    return eng, tokens_and_logprobs(eng, prompts, params)


def assert_same_mixed_batch(want, got, atol: float) -> None:
    """Two `small_engine_mixed_batch` outputs agree: the same 8 tokens per request, the same logprob entries (none,
    then 4 and 2 top alternatives) with the same token ids, and the logprobs within `atol`."""
    import numpy as np
    for (ta, la), (tb, lb), sp in zip(want, got, (None, 4, 2)):
        assert ta == tb and len(ta) == 8
        assert len(la) == len(lb) == (0 if sp is None else 8)
        for a, b in zip(la, lb):
            assert a["token_id"] == b["token_id"] and len(a["top"]) == len(b["top"]) == sp
            assert [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
            np.testing.assert_allclose(a["logprob"], b["logprob"], rtol=0, atol=atol)
            np.testing.assert_allclose([v for _, v in a["top"]], [v for _, v in b["top"]], rtol=0, atol=atol)
