"""The last layer carries only the logits rows past its attention (`gemma.decoder(last_rows=...)`, used by the
runner for steps with more tokens than logits rows and no KV-shared layers). Configs, quantizations and dtypes are
drawn at random (seeded) from the whole space; each engine is held to the same engine with the trim taken out (the
decoder run on every token, then the rows gathered, as before), over a batch that mixes prefill chunks, decodes,
greedy and sampled requests with logprobs. The trim must also be seen to happen: the last layer's MLP gets fewer
rows than the step has tokens."""
import numpy as np
import pytest

from gemmajax.engine.llm_engine import EngineConfig, LLMEngine
from gemmajax.engine.sampling_params import SamplingParams
from gemmajax.model import gemma
from gemmajax.model.loader import load_model
from tests.engine.engine_run import tokens_and_logprobs
from tests.golden.hf_models import build_hf_config, random_text_config, save_text_checkpoint

QUANTS = ("none", "w8a8", "w4a16", "w8a8+emb4", "w4a16+emb8", "w8a8+emb8")
_rng = np.random.default_rng(20261205)
# no KV-shared layers: a model with them already narrows to the logits rows at its first shared layer
CASES = [(int(_rng.integers(1 << 30)), str(_rng.choice(QUANTS)), str(_rng.choice(["float32", "bfloat16"])), {})
         for _ in range(3)]
# and one pinned Gemma 4 case with per-layer inputs and experts (the rows' PLE slice and the MoE branch)
CASES.append((int(_rng.integers(1 << 30)), str(_rng.choice(QUANTS)), "float32",
              {"family": "gemma4", "hidden_size_per_layer_input": 8, "enable_moe_block": True, "num_experts": 4,
               "top_k_experts": 2, "moe_intermediate_size": 16}))


def _untrimmed(decoder):
    def run(*args, last_rows=None, **kw):
        h, kv = decoder(*args, **kw)
        return (h if last_rows is None else h[:, last_rows]), kv
    return run


def _run(model, tok, max_model_len: int):
    eng = LLMEngine(model.config, model.weights, tok, EngineConfig(
        max_model_len=max_model_len, max_num_seqs=4, max_num_batched_tokens=16, page_size=8, kv_cache_memory=1 << 24,
        token_buckets=(16,), seq_buckets=(4,)))
    rng = np.random.default_rng(11)
    prompts = [list(map(int, rng.integers(3, 512, size=n))) for n in (5, 19, 11, 2)]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, seed=3, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.7, seed=5, ignore_eos=True)]
    return tokens_and_logprobs(eng, prompts, params)


@pytest.mark.parametrize("seed,quant,dtype,pin", CASES)
def test_engine_with_last_layer_trim_equals_without(tmp_path_factory, gemma4_tokenizer, monkeypatch, seed, quant,
                                                   dtype, pin):
    text = random_text_config(np.random.default_rng(seed), num_kv_shared_layers=0, **pin)
    m, cfg = build_hf_config(text, seed=seed % 1000)
    model = load_model(save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp("trim"))), dtype=dtype, quant=quant)
    assert model.config.first_shared_layer == model.config.num_layers
    rows: list = []
    mlp = gemma.mlp_block

    def spy(mw, h):
        rows.append(h.shape[-2])      # traced: one entry per layer per compiled step
        return mlp(mw, h)
    monkeypatch.setattr(gemma, "mlp_block", spy)
    # The two runs differ in max_model_len, so each has its own runner spec, hence its own jitted step, traced here
    # with the function patched at that moment (no cache is cleared: other tests' compiled steps stay shared).
    trimmed = _run(model, gemma4_tokenizer, 64)
    L = model.config.num_layers

    def per_step():      # the recorded rows, one list per traced step
        assert len(rows) % L == 0
        return [rows[i:i + L] for i in range(0, len(rows), L)]
    steps = per_step()
    assert steps
    # a mixed step (16 tokens, 4 logits rows): every layer but the last sees all 16 tokens, the last only 4
    assert [16] * (L - 1) + [4] in steps, steps

    monkeypatch.setattr(gemma, "decoder", _untrimmed(gemma.decoder))
    rows.clear()
    whole = _run(model, gemma4_tokenizer, 72)
    # traced afresh (rows recorded), and the trim is off: the last layer sees as many rows as the first
    assert rows and all(s[-1] == s[0] for s in per_step())

    tol = 1e-5 if dtype == "float32" else 2e-2
    for (ta, la), (tb, lb) in zip(trimmed, whole):
        assert ta == tb and len(ta) == 6
        assert len(la) == len(lb)
        for a, b in zip(la, lb):
            assert a["token_id"] == b["token_id"]
            np.testing.assert_allclose(a["logprob"], b["logprob"], rtol=0, atol=tol)
            assert [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
