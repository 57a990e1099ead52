"""Text completions through a real server and the openai client, over the scripted fake engine."""

from __future__ import annotations

import openai
import pytest

from tests.server.fake_engine import CHAR_OFFSET, FakeEngineClient


def test_completion_string_prompt(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    r = client.completions.create(model="fake-gemma", prompt="Say hi", max_tokens=50)
    assert r.object == "text_completion"
    assert r.choices[0].text == "Hello there!" and r.choices[0].finish_reason == "stop"
    assert engine.calls[0][1] == [ord(c) + CHAR_OFFSET for c in "Say hi"]
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 12 and r.usage.total_tokens == 18
    # OpenAI's default of 16 new tokens
    client.completions.create(model="fake-gemma", prompt="Say hi")
    assert engine.calls[1][2].max_tokens == 16


def test_completion_token_ids_and_batches(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    r = client.completions.create(model="fake-gemma", prompt=[201, 202, 203], max_tokens=2)
    assert engine.calls[0][1] == [201, 202, 203] and r.choices[0].text == "He"
    engine.calls.clear()
    engine.reply = lambda prompt, params: prompt.upper()
    r = client.completions.create(model="fake-gemma", prompt=["ab", "cd"], n=2, max_tokens=5)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["AB", "AB", "CD", "CD"]
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 8
    engine.calls.clear()
    r = client.completions.create(model="fake-gemma", prompt=[[100 + ord("x")], [100 + ord("y"), 100 + ord("z")]])
    assert [c.text for c in r.choices] == ["X", "YZ"]


def test_completion_echo_and_logprobs(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    r = client.completions.create(model="fake-gemma", prompt="Q: ", max_tokens=3, echo=True, logprobs=1)
    assert r.choices[0].text == "Q: Hel"
    lp = r.choices[0].logprobs
    assert lp.tokens == ["H", "e", "l"]
    assert lp.token_logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert lp.top_logprobs == [{"H": pytest.approx(-0.1)}, {"e": pytest.approx(-0.2)}, {"l": pytest.approx(-0.3)}]
    assert lp.text_offset == [3, 4, 5]
    assert engine.calls[0][2].logprobs == 1
    r = client.completions.create(model="fake-gemma", prompt=[100 + ord("Z")], max_tokens=1, echo=True)
    assert r.choices[0].text == "ZH"


def test_completion_stream(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    chunks = list(client.completions.create(model="fake-gemma", prompt="x", max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello t"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == 1


def test_completion_errors(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-gemma", prompt="x", suffix="tail")
    assert e.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-gemma", prompt="x" * 250)
    msg = e.value.body["message"]
    assert "200" in msg and "250" in msg and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-gemma", prompt=["ok", "y" * 300])
    assert e.value.body["param"] == "prompt.1" and "300" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-gemma", prompt="x", logprobs=50)
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["param"] == "model" and "gpt-4" in e.value.body["message"]
    # capped, not rejected: 190 prompt tokens leave 10 of the 200
    client.completions.create(model="fake-gemma", prompt="z" * 190, max_tokens=100)
    assert engine.calls[-1][2].max_tokens == 10
    assert not engine.aborted
