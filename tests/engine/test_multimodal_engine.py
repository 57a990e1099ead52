"""Images and audio through LLM.chat equal HF's own processor + generate, token for token (float32, greedy):
E2B-like (vision with clipped linears, audio, PLE at the placeholders), 31B-like (bidirectional image blocks on
sliding layers) and the 12B-like unified stack, over the real 262,144-token vocabulary (so the real tokenizer's
special tokens and our chat template drive the model). Also: the prompt ids equal HF's processor's, a repeated
image is a prefix-cache hit and another image is not, bad media are errors naming the part, and a text-only
checkpoint refuses an image."""
import base64
import io
import wave

import numpy as np
import pytest
import torch
from PIL import Image

import gemmajax
from gemmajax.tools.tokenizer import gguf_to_gemma4_sp
from tests.golden import hf_multimodal as hm


def _png(h, w, seed):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _wav(n, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 0.2 * 32767).clip(-32767, 32767).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16000)
        f.writeframes(x.tobytes())
    return buf.getvalue()


def _image_part(png):
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


def _audio_part(wav):
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


IMG1, IMG2, WAV1 = _png(90, 140, 1), _png(200, 60, 2), _wav(12000, 3)


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory, gguf_file):
    d = tmp_path_factory.mktemp("sp")
    (d / "tokenizer.model").write_bytes(gguf_to_gemma4_sp(gguf_file))
    return d


@pytest.fixture(scope="module")
def mm_models(tmp_path_factory, sp_dir):
    out = {}
    for v, seed in (("e2b", 0), ("31b", 1), ("12b", 2)):
        model, _ = hm.build_mm(v, seed=seed, real_vocab=True)
        with torch.no_grad():   # smaller embeddings: a random model that does not just repeat its last input
            model.model.language_model.embed_tokens.weight.mul_(0.1)
        d = tmp_path_factory.mktemp(f"mm_{v}")
        model.save_pretrained(d)
        (d / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
        llm = gemmajax.LLM(str(d), dtype="float32", max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=1024,
                           page_size=16, kv_cache_memory=1 << 26, token_buckets=(64, 1024), seq_buckets=(4,))
        out[v] = (model, llm)
    return out


def _hf_generate(model, proc, text, images, audio, n):
    kw = {"text": [text], "return_tensors": "pt"}
    if images:
        kw["images"] = [[Image.open(io.BytesIO(b)).convert("RGB") for b in images]]
    if audio:
        kw["audio"] = [gemmajax_decode(w) for w in audio]
    inputs = proc(**kw)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


def gemmajax_decode(wav_bytes):
    from gemmajax.tools.media import decode_audio
    return decode_audio(wav_bytes)


CASES = {
    "text": ([{"type": "text", "text": "Describe the sea"}], [], []),
    "one image": ([_image_part(IMG1), {"type": "text", "text": "What is this?"}], [IMG1], []),
    "two images": ([{"type": "text", "text": "Compare"}, _image_part(IMG1), _image_part(IMG2)], [IMG1, IMG2], []),
    "audio": ([{"type": "text", "text": "Listen"}, _audio_part(WAV1)], [], [WAV1]),
}


@pytest.mark.parametrize("variant,case", [("e2b", c) for c in CASES] + [("31b", "one image"), ("31b", "two images"),
                                                                         ("12b", "one image")])
def test_chat_equals_hf_generate(mm_models, sp_dir, variant, case):
    model, llm = mm_models[variant]
    content, images, audio = CASES[case]
    messages = [{"role": "user", "content": content}]
    ids, items = llm.chat_prompt(messages)
    if variant == "12b":
        # HF's 12B image processor resizes with torchvision (not installed): HF's model gets our pixels, which
        # tests/tools/test_media.py checks equal HF's patch merge
        inputs = {"input_ids": torch.as_tensor([ids]),
                  "pixel_values": torch.as_tensor(np.stack([m.pixel_values for m in items])),
                  "image_position_ids": torch.as_tensor(np.stack([m.position_ids for m in items])),
                  "mm_token_type_ids": torch.as_tensor([[int(t == 258880) for t in ids]])}
        with torch.no_grad():
            hf_new = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(ids):]
        hf_ids, hf_new = ids, hf_new.tolist()
    else:
        # HF's processor on our template's text (placeholders unexpanded) gives the same prompt ids
        from gemmajax.engine.chat import prepare_media
        text = llm.chat_template().render(prepare_media(messages, llm.mm_config)[0])
        proc = hm.hf_processor(hm.hf_gemma4_tokenizer(str(sp_dir)))
        hf_ids, hf_new = _hf_generate(model, proc, text, images, audio, 6)
        assert ids == hf_ids
    out = llm.chat(messages, gemmajax.SamplingParams(max_tokens=6, ignore_eos=True, skip_special_tokens=False))[0]
    assert out.prompt_token_ids == hf_ids
    assert out.token_ids == hf_new, (variant, case)


def test_same_image_hits_the_prefix_cache_another_does_not(mm_models):
    _, llm = mm_models["e2b"]
    eng = llm.engine
    p = gemmajax.SamplingParams(max_tokens=2)
    first = llm.chat([{"role": "user", "content": [_image_part(IMG1), {"type": "text", "text": "A"}]}], p)[0]
    h0 = eng.scheduler.num_prefix_cache_hit_tokens
    again = llm.chat([{"role": "user", "content": [_image_part(IMG1), {"type": "text", "text": "B"}]}], p)[0]
    h1 = eng.scheduler.num_prefix_cache_hit_tokens
    other = llm.chat([{"role": "user", "content": [_image_part(_png(90, 140, 9)), {"type": "text", "text": "A"}]}],
                     p)[0]
    h2 = eng.scheduler.num_prefix_cache_hit_tokens
    n_img = sum(t == 258880 for t in first.prompt_token_ids)
    assert first.prompt_token_ids != again.prompt_token_ids and len(first.prompt_token_ids) > n_img
    assert h1 - h0 >= n_img - 16          # the image's pages are reused (all full pages before the text)
    assert h2 - h1 < 16                   # same placeholder ids, other pixels: no hit past the first page
    assert other.prompt_token_ids == first.prompt_token_ids


def test_bad_media_are_errors_naming_the_part(mm_models, tmp_path, gguf_file):
    _, llm = mm_models["e2b"]
    bad = [({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "not a decodable image"),
           ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "base64"),
           ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "fetching URLs is off"),
           ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}}, "format 'mp3'"),
           ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF....").decode()}}, "audio")]
    for part, msg in bad:
        with pytest.raises(ValueError, match=rf"messages\.0\.content\.1: .*{msg}"):
            llm.chat([{"role": "user", "content": [{"type": "text", "text": "x"}, part]}])
    _, llm31 = mm_models["31b"]   # a checkpoint with a vision tower but no audio tower
    with pytest.raises(ValueError, match=r"messages\.0\.content\.0: an audio input, but this checkpoint has no audio"):
        llm31.chat([{"role": "user", "content": [_audio_part(WAV1)]}])
    text_only = gemmajax.LLM(gguf_file, dtype="float32", max_model_len=256, max_num_seqs=2, kv_cache_memory=1 << 24)
    with pytest.raises(ValueError, match=r"messages\.0\.content\.0: an image input, but this checkpoint has no image"):
        text_only.chat([{"role": "user", "content": [_image_part(IMG1)]}])
