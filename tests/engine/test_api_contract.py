"""The offline API does what API.md says: the KV cache follows the model's dtype, logprobs=k gives exactly k entries
per request, n completions share the prompt, unseeded draws belong to their engine, LLM.chat enforces json_schema,
and thinking_token_budget closes the thought. A tiny random E2B-like model over the real 262,144-token vocabulary
(so a grammar can pick any token the tokenizer has)."""
import json

import pytest

import gemmajax
from gemmajax.engine.llm import LLM
from tests.golden.hf_models import E2B_SMALL, save_real_vocab_checkpoint

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, gguf_file):
    return save_real_vocab_checkpoint(str(tmp_path_factory.mktemp("api_e2b")), gguf_file, "e2b", seed=5, **E2B_SMALL)


def _llm(ckpt, **kw):
    kw = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 64,
          "page_size": 8, "kv_cache_memory": 1 << 24, **kw}
    return LLM(ckpt, **kw)


@pytest.fixture(scope="module")
def llm(ckpt):
    return _llm(ckpt)


def test_kv_dtype_auto_follows_the_model(ckpt, llm):
    assert llm.engine.config.kv_dtype == "float32"          # the default is "auto"
    assert llm.engine.runner.kv[0].dtype.itemsize == 4      # float32 pages (bit-stored as uint32 on the CPU)
    bf = _llm(ckpt, dtype="bfloat16")
    assert bf.engine.config.kv_dtype == "bf16"
    fp8 = _llm(ckpt, kv_dtype="fp8_e4m3")
    assert fp8.engine.config.kv_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv dtype 'int8'"):
        _llm(ckpt, kv_dtype="int8")


def test_logprobs_count_is_per_request(llm):
    prompt = list(range(1000, 1012))
    one, five, none = llm.generate([prompt, prompt, prompt], [
        gemmajax.SamplingParams(max_tokens=6, logprobs=1), gemmajax.SamplingParams(max_tokens=6, logprobs=5),
        gemmajax.SamplingParams(max_tokens=6)])
    assert one.token_ids == five.token_ids == none.token_ids
    assert none.logprobs is None
    assert [len(e["top"]) for e in one.logprobs] == [1] * 6
    assert [len(e["top"]) for e in five.logprobs] == [5] * 6
    for a, b in zip(one.logprobs, five.logprobs):
        assert a["top"] == b["top"][:1]                       # the same distribution, cut to its own count
        assert [lp for _, lp in b["top"]] == sorted((lp for _, lp in b["top"]), reverse=True)
        assert a["token_id"] == b["top"][0][0]                # greedy: the chosen token is the top entry


def test_n_completions_share_the_prompt(llm):
    prompt = list(range(2000, 2029))   # 29 tokens: 3 full pages of 8
    p = gemmajax.SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=3)
    out = llm.generate(prompt, p)
    assert len(out) == 1 and len(out[0].outputs) == 3
    assert [o.index for o in out[0].outputs] == [0, 1, 2]
    texts = [tuple(o.token_ids) for o in out[0].outputs]
    assert len(set(texts)) == 3                          # seeds 11, 12, 13: different draws
    # choice j is the request with seed + j, alone
    for j, o in enumerate(out[0].outputs):
        alone = llm.generate(prompt, gemmajax.SamplingParams(max_tokens=8, temperature=1.0, seed=11 + j))[0]
        assert alone.token_ids == o.token_ids, j
    # greedy n=2: identical choices; the second one started from the first's cached prompt pages
    before = llm.engine.scheduler.num_prefix_cache_hit_tokens
    g = llm.generate(list(range(3000, 3029)), gemmajax.SamplingParams(max_tokens=5, n=2))[0]
    assert g.outputs[0].token_ids == g.outputs[1].token_ids
    assert llm.engine.scheduler.num_prefix_cache_hit_tokens - before >= 24   # 3 pages of the 29-token prompt


def test_unseeded_draws_belong_to_the_engine(ckpt):
    """An unseeded request is not a seed=0 request in disguise, and another engine's traffic does not move it."""
    prompt = list(range(500, 510))
    sampled = gemmajax.SamplingParams(max_tokens=12, temperature=1.0)
    a = _llm(ckpt, seed=3)
    first = a.generate(prompt, sampled)[0].token_ids
    b = _llm(ckpt, seed=3)
    b.generate([prompt] * 3, sampled)                    # other traffic on another engine
    c = _llm(ckpt, seed=3)
    assert c.generate(prompt, sampled)[0].token_ids == first
    seeded = [a.generate(prompt, gemmajax.SamplingParams(max_tokens=12, temperature=1.0, seed=s))[0].token_ids
              for s in range(4)]
    assert first not in seeded


def test_chat_json_schema_is_enforced(llm):
    """The README's call: a noise model's answer is valid JSON for the schema, thinking off and on."""
    msgs = [{"role": "user", "content": "A city and a number of days"}]
    for thinking in (False, True):
        out = llm.chat(msgs, gemmajax.SamplingParams(max_tokens=120, temperature=1.0, seed=1, json_schema=SCHEMA),
                       enable_thinking=thinking)[0]
        assert out.finish_reason == "stop", out
        obj = json.loads(out.content)
        assert set(obj) == {"city", "days"} and isinstance(obj["city"], str) and len(obj["city"]) <= 10
        assert isinstance(obj["days"], int) and 1 <= obj["days"] <= 9
        if thinking:   # the thought channel came first and was closed (at half of max_tokens at the latest)
            assert out.reasoning_content is not None and 0 < out.num_reasoning_tokens <= 60


def _thought_lengths(tok, ids):
    """Tokens between each <|channel> and the next <channel|> in ids."""
    o, c = tok.piece_to_id("<|channel>"), tok.piece_to_id("<channel|>")
    lengths, start = [], None
    for i, t in enumerate(ids):
        if t == o:
            start = i
        elif t == c and start is not None:
            lengths.append(i - start - 1)
            start = None
    return lengths


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_thinking_token_budget_forces_the_end_of_thought(llm, budget):
    msgs = [{"role": "user", "content": "Plan a trip"}]
    p = gemmajax.SamplingParams(max_tokens=80, temperature=1.0, seed=2, json_schema=SCHEMA,
                                thinking_token_budget=budget)
    out = llm.chat(msgs, p, enable_thinking=True)[0]
    tok = llm.tokenizer
    lengths = _thought_lengths(tok, out.token_ids)
    # the grammar's own "thought\n" label comes first, so a thought holds at least the label's tokens
    label = len(tok.encode("thought\n"))
    assert lengths == [max(budget, label)], (lengths, out.text)
    assert out.num_reasoning_tokens == lengths[0]
    assert json.loads(out.content)["days"] in range(1, 10)


def test_thinking_budget_with_greedy_decode_steps(ckpt, llm):
    """Greedy decoding in programs of several decode steps (num_scheduler_steps, the default 8) never runs past a
    thinking budget: the end of thought is forced at exactly the budget, and the tokens are those of one step a
    program; LLM(num_scheduler_steps=...) reaches the engine and a bad value is refused."""
    import dataclasses
    tok = llm.tokenizer
    eng = llm.engine
    assert eng.config.num_scheduler_steps == 8
    prompt = tok.encode("<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n")
    close = tok.piece_to_id("<channel|>")
    outs = {}
    try:
        for steps in (8, 1):
            eng.config = dataclasses.replace(eng.config, num_scheduler_steps=steps)
            m0 = eng.stats_counters["multi_steps"]
            for budget in (3, 11):
                p = gemmajax.SamplingParams(max_tokens=40, temperature=0.0, thinking_token_budget=budget,
                                            ignore_eos=True)
                ids = llm.generate(prompt, p)[0].token_ids
                assert close not in ids[:budget] and ids[budget] == close, (steps, budget, ids)
                outs[steps, budget] = ids
            assert (eng.stats_counters["multi_steps"] > m0) == (steps > 1)
    finally:
        eng.config = dataclasses.replace(eng.config, num_scheduler_steps=8)
    assert outs[8, 3] == outs[1, 3] and outs[8, 11] == outs[1, 11]
    assert _llm(ckpt, num_scheduler_steps=3).engine.config.num_scheduler_steps == 3
    with pytest.raises(ValueError, match="num_scheduler_steps must be an int >= 1.*got 0"):
        _llm(ckpt, num_scheduler_steps=0)


def test_stop_string_inside_a_program_counts_only_kept_tokens(llm):
    """A stop string met inside a program of several decode steps drops the tokens after it: the output, the
    engine's generation-token count and usage's reasoning tokens (the prompt ends inside a thought) count only the
    kept ones, as a ThoughtTracker fed those tokens alone counts them."""
    from gemmajax.engine.thinking import ThoughtTracker
    tok, eng = llm.tokenizer, llm.engine
    prompt = tok.encode("<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n")
    ids = llm.generate(prompt, gemmajax.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].token_ids
    # the whole text through token j, first completed by token j, inside the second 8-step program (tokens 9-16)
    j = 10
    stop = tok.decode(ids[:j + 1])
    assert len(stop) > len(tok.decode(ids[:j])), ids
    g0, m0 = eng.stats_counters["generation_tokens"], eng.stats_counters["multi_steps"]
    eng.add_request("stop-in-program", prompt, gemmajax.SamplingParams(max_tokens=24, temperature=0.0,
                                                                          ignore_eos=True, stop=[stop]))
    final = None
    while eng.has_unfinished():
        for o in eng.step():
            final = o if o.finished else final
    assert eng.stats_counters["multi_steps"] > m0
    assert final.finish_reason == "stop" and final.stop_reason == stop and final.token_ids == ids[:j + 1]
    assert eng.stats_counters["generation_tokens"] - g0 == j + 1
    want = ThoughtTracker.for_request(tok, prompt, None)
    for t in final.token_ids:
        want.advance(t)
    assert final.num_reasoning_tokens == want.total > 0


def test_thinking_budget_without_a_grammar(llm):
    """A prompt that ends inside an open thought (no grammar at all): the budget alone closes it."""
    tok = llm.tokenizer
    prompt = tok.encode("<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n")
    out = llm.generate(prompt, gemmajax.SamplingParams(max_tokens=30, temperature=1.0, seed=4,
                                                       thinking_token_budget=6, ignore_eos=True))[0]
    close = tok.piece_to_id("<channel|>")
    assert close not in out.token_ids[:6] and out.token_ids[6] == close, out.token_ids
    assert out.outputs[0] is out
