"""The official openai client sends images as data URLs (and audio as base64 WAV) to `gemmajax serve` over a tiny
random E2B-like Gemma 4 with vision and audio towers: the streamed answer equals LLM.chat offline, token for token;
bad media, too many images and http URLs the server may not fetch are 400s naming the part."""
from __future__ import annotations

import openai
import pytest
import torch

import gemmajax
from gemmajax.engine.async_engine import AsyncEngineClient
from gemmajax.server.app import build_app
from gemmajax.tools.tokenizer import gguf_to_gemma4_sp
from tests.engine.test_multimodal_engine import IMG1, IMG2, WAV1, _audio_part, _image_part
from tests.golden import hf_multimodal as hm
from tests.server.conftest import running_server

MODEL = "tiny-mm"
KW = dict(dtype="float32", max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=1024, page_size=16,
          kv_cache_memory=1 << 26, token_buckets=(64, 1024), seq_buckets=(4,))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, gguf_file):
    model, _ = hm.build_mm("e2b", seed=0, real_vocab=True)
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight.mul_(0.1)
    d = tmp_path_factory.mktemp("mm_server")
    model.save_pretrained(d)
    (d / "tokenizer.model").write_bytes(gguf_to_gemma4_sp(gguf_file))
    return str(d)


@pytest.fixture(scope="module")
def served(ckpt):
    llm = gemmajax.LLM(ckpt, **KW)
    client = AsyncEngineClient(llm.engine, model_name=MODEL, chat_template=llm.chat_template(),
                               tokenizer=llm.tokenizer)
    client.media_limits = {"image": 2}
    with running_server(build_app(client)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    client.shutdown()


@pytest.fixture(scope="module")
def offline(ckpt):
    return gemmajax.LLM(ckpt, **KW)


def test_image_and_audio_stream_equals_offline(served, offline):
    for content in ([_image_part(IMG1), {"type": "text", "text": "What is this?"}],
                    [{"type": "text", "text": "Listen"}, _audio_part(WAV1)]):
        messages = [{"role": "user", "content": content}]
        ref = offline.chat(messages, gemmajax.SamplingParams(max_tokens=8, ignore_eos=True))[0]
        chunks = list(served.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.content
        assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids) == 8


@pytest.mark.parametrize("part,msg", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "not a decodable image"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "fetching URLs is off"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "mp3"}}, "mp3"),
])
def test_bad_media_are_400s_naming_the_part(served, part, msg):
    with pytest.raises(openai.BadRequestError) as e:
        served.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "x"}, part]}])
    body = e.value.body if isinstance(e.value.body, dict) else {}
    err = body.get("error", body)
    assert err["param"] == "messages.0.content.1" and msg in err["message"], err


def test_more_images_than_the_limit_is_a_400(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            _image_part(IMG1), _image_part(IMG2), _image_part(IMG1)]}])
    assert "more than 2 image" in str(e.value)
    r = served.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
        _image_part(IMG1), _image_part(IMG2)]}])                    # at the limit: served
    assert r.usage.completion_tokens == 2


def test_fetcher_allows_only_its_domains_and_caps_the_size(tmp_path):
    import http.server
    import threading

    from gemmajax.server.media_fetch import allowed, make_fetcher
    (tmp_path / "a.png").write_bytes(IMG1)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/a.png"
    try:
        assert allowed("https://img.example.com/x", ["example.com"]) and not allowed("https://evil.com/x",
                                                                                      ["example.com"])
        assert make_fetcher(["127.0.0.1"])(url) == IMG1
        with pytest.raises(ValueError, match="not in --allowed-media-domains"):
            make_fetcher(["example.com"])(url)
        with pytest.raises(ValueError, match="larger than 100 bytes"):
            make_fetcher(["127.0.0.1"], max_bytes=100)(url)
        with pytest.raises(ValueError, match="could not be fetched"):
            make_fetcher(["127.0.0.1"])(url.replace("a.png", "missing.png"))
    finally:
        srv.shutdown()
