"""Chat templates: built-in Gemma 4 / Gemma 3 renders against strings written out by hand from reference
section 7.2 (and its sample renders), token ids of a render against the published 31B prompt skeleton,
and a checkpoint's own jinja template taking precedence."""

import json

import pytest

from gemmajax.tools.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    format_tool_declaration,
    render_chat,
    strip_thinking,
)

Q = '<|"|>'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City"},
                           "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
# Reference section 7.2, verbatim.
WEATHER_DECL = ('<|tool>declaration:get_weather{description:<|"|>Get weather<|"|>,parameters:{properties:{city:'
                '{description:<|"|>City<|"|>,type:<|"|>STRING<|"|>},unit:{enum:[<|"|>c<|"|>,<|"|>f<|"|>],type:'
                '<|"|>STRING<|"|>}},required:[<|"|>city<|"|>],type:<|"|>OBJECT<|"|>}}<tool|>')


def call(name, arguments, id=None):
    c = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if id is not None:
        c["id"] = id
    return c


CASES = {
    "small_plain": (
        {"messages": [{"role": "user", "content": "Hi"}]},
        "<bos><|turn>user\nHi<turn|>\n<|turn>model\n"),
    # reference sample render (big-model template)
    "large_thinking_off": (
        {"messages": [{"role": "user", "content": "Hi"}], "model_size": "large"},
        "<bos><|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"),
    # reference sample render
    "large_system_thinking_on": (
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         "enable_thinking": True, "model_size": "large"},
        "<bos><|turn>system\n<|think|>\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"),
    "thinking_without_system": (
        {"messages": [{"role": "user", "content": "Hi"}], "enable_thinking": True},
        "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"),
    "developer_and_text_parts": (
        {"messages": [{"role": "developer", "content": "  You are terse.\n"},
                      {"role": "user", "content": [{"type": "text", "text": " Hello "},
                                                   {"type": "text", "text": "there"}]}]},
        "<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\nHellothere<turn|>\n<|turn>model\n"),
    "tool_declaration": (
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL]},
        f"<bos><|turn>system\n{WEATHER_DECL}<turn|>\n<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n"),
    "tool_call_and_response_no_generation_prompt": (
        {"messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None,
             "tool_calls": [call("get_weather", '{"city": "Paris", "unit": "c"}', id="c1")]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20, "sky": "clear"}'}],
            "model_size": "large"},
        ("<bos><|turn>system\nS<turn|>\n<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n"
         "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,unit:<|\"|>c<|\"|>}<tool_call|>"
         "<|tool_response>response:get_weather{sky:<|\"|>clear<|\"|>,temp:20}<tool_response|>")),
    "answer_after_tool_continues_turn": (
        {"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris"}, id="c1")]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
            {"role": "assistant", "content": "It is 20°C."},
            {"role": "user", "content": "Thanks"}]},
        ("<bos><|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n"
         "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>"
         "<|tool_response>response:get_weather{temp:20}<tool_response|>It is 20°C.<turn|>\n"
         "<|turn>user\nThanks<turn|>\n<|turn>model\n")),
    "thinking_stripped_and_reasoning_reemitted": (
        {"messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<|channel>thought\nold thinking<channel|>Answer one."},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "", "reasoning_content": "need weather",
             "tool_calls": [call("get_weather", {"city": "Oslo"})]},
            {"role": "tool", "name": "get_weather", "content": "sunny"}],
            "enable_thinking": True, "model_size": "large"},
        ("<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nQ1<turn|>\n<|turn>model\nAnswer one.<turn|>\n"
         "<|turn>user\nQ2<turn|>\n<|turn>model\n<|channel>thought\nneed weather\n<channel|>"
         "<|tool_call>call:get_weather{city:<|\"|>Oslo<|\"|>}<tool_call|>"
         "<|tool_response>response:get_weather{value:<|\"|>sunny<|\"|>}<tool_response|>")),
    "pending_tool_calls_nested_arguments": (
        {"messages": [
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": None, "tool_calls": [
                call("plan", json.dumps({"b": [1, 2.5, {"z": None, "Y": True}], "a": {"k": "v"}, "C": False})),
                call("now", "")]}]},
        ("<bos><|turn>user\nGo<turn|>\n<|turn>model\n"
         "<|tool_call>call:plan{a:{k:<|\"|>v<|\"|>},b:[1,2.5,{Y:true,z:null}],C:false}<tool_call|>"
         "<|tool_call>call:now{}<tool_call|><|tool_response>")),
    "responses_by_id_and_old_reasoning_dropped": (
        {"messages": [
            {"role": "user", "content": "A"},
            {"role": "assistant", "reasoning_content": "r1",
             "tool_calls": [call("f", {"q": 1}, id="x"), call("g", {}, id="y")]},
            {"role": "tool", "tool_call_id": "y", "content": "[1, 2]"},
            {"role": "tool", "tool_call_id": "x", "content": '{"ok": true}'},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "B"}],
            "model_size": "large"},
        ("<bos><|turn>user\nA<turn|>\n<|turn>model\n<|tool_call>call:f{q:1}<tool_call|><|tool_call>call:g{}"
         "<tool_call|><|tool_response>response:g{value:<|\"|>[1, 2]<|\"|>}<tool_response|>"
         "<|tool_response>response:f{ok:true}<tool_response|>Done.<turn|>\n<|turn>user\nB<turn|>\n"
         "<|turn>model\n<|channel>thought\n<channel|>")),
    "open_turn_closed_before_user": (
        {"messages": [
            {"role": "user", "content": "A"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [call("f", {}, id="1")]},
            {"role": "tool", "tool_call_id": "1", "content": "x"},
            {"role": "user", "content": "B"}], "add_generation_prompt": False},
        ("<bos><|turn>user\nA<turn|>\n<|turn>model\nLet me look.<|tool_call>call:f{}<tool_call|>"
         "<|tool_response>response:f{value:<|\"|>x<|\"|>}<tool_response|><turn|>\n<|turn>user\nB<turn|>\n")),
    "gemma3_system_folded": (
        {"messages": [{"role": "system", "content": "Be nice."}, {"role": "user", "content": " Hi "},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
         "family": "gemma3"},
        ("<bos><start_of_turn>user\nBe nice.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
         "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")),
    "gemma3_no_generation_prompt": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "family": "gemma3",
         "add_generation_prompt": False},
        "<bos><start_of_turn>user\nHi<end_of_turn>\n"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_builtin_render(name):
    kwargs, expected = CASES[name]
    assert render_chat(**kwargs) == expected


def test_render_encodes_to_published_skeleton(gemma4_tok):
    """Reference section 10: the 31B templated prompt is [2,105,2364,107,...,106,107,105,4368,107,100,45518,107,101]."""
    text = render_chat([{"role": "user", "content": "What is the capital of France?"}], model_size="large")
    ids = gemma4_tok.encode(text)
    assert ids[:4] == [2, 105, 2364, 107]
    assert ids[-9:] == [106, 107, 105, 4368, 107, 100, 45518, 107, 101]
    assert gemma4_tok.decode(ids) == text


def test_tool_syntax_helpers():
    decl = format_tool_declaration({"name": "find", "description": "Find", "parameters": {
        "type": "object", "required": ["q"], "properties": {
            "q": {"type": ["string", "null"], "description": "Query"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "opts": {"type": "object", "properties": {"Limit": {"type": "integer"}, "deep": {"type": "boolean"}},
                     "required": ["deep"]}}}})
    assert decl == (
        f"declaration:find{{description:{Q}Find{Q},parameters:{{properties:{{opts:{{properties:{{deep:{{type:"
        f"{Q}BOOLEAN{Q}}},Limit:{{type:{Q}INTEGER{Q}}}}},required:[{Q}deep{Q}],type:{Q}OBJECT{Q}}},q:{{description:"
        f"{Q}Query{Q},nullable:true,type:{Q}STRING{Q}}},tags:{{items:{{type:{Q}STRING{Q}}},type:{Q}ARRAY{Q}}}}},"
        f"required:[{Q}q{Q}],type:{Q}OBJECT{Q}}}}}")
    assert strip_thinking(" a<|channel>x<channel|>b <|channel>unclosed") == "ab"


def test_errors():
    with pytest.raises(ChatTemplateError, match="must follow an assistant"):
        render_chat([{"role": "user", "content": "a"}, {"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="unknown role 'function'"):
        render_chat([{"role": "function", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="JSON object"):
        render_chat([{"role": "user", "content": "a"},
                     {"role": "assistant", "tool_calls": [call("f", "not json")]}])
    with pytest.raises(ChatTemplateError, match="image_url"):
        render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ChatTemplateError, match="alternate"):
        render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], family="gemma3")
    with pytest.raises(ChatTemplateError, match="model_size"):
        render_chat([{"role": "user", "content": "a"}], model_size="medium")
    with pytest.raises(ChatTemplateError, match="tools"):
        render_chat([{"role": "user", "content": "a"}], family="gemma3", tools=[WEATHER_TOOL])


TINY_JINJA = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}]{{ m['content'] }}\n{% endfor %}"
    "{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}"
    "{% if enable_thinking %}THINK\n{% endif %}"
    "{% if messages | length > 3 %}{{ raise_exception('too many messages') }}{% endif %}"
    "{% if add_generation_prompt %}[MODEL]{{ greeting | default('') }}{% endif %}")


def test_checkpoint_chat_template_jinja_is_used(tmp_path):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    (tmp_path / "chat_template.jinja").write_text(TINY_JINJA)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<BOS>"}, "eos_token": "<EOS>", "chat_template": "ignored: jinja file wins"}))
    tpl = ChatTemplate.from_checkpoint(tmp_path, "gemma4", "large")
    assert not tpl.is_builtin and tpl.bos_token == "<BOS>"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tpl.render(msgs, tools=tools, enable_thinking=True, greeting="!") == (
        '<BOS>[SYSTEM]S\n[USER]Hi\nTOOLS=[{"type": "function", "function": {"name": "f"}}]\nTHINK\n[MODEL]!')
    assert tpl.render(msgs, add_generation_prompt=False) == "<BOS>[SYSTEM]S\n[USER]Hi\n"
    with pytest.raises(ChatTemplateError, match="too many messages"):
        tpl.render(msgs * 2)
    # without the .jinja file, tokenizer_config.json's chat_template is used
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "X{{ messages[0]['content'] }}"}))
    assert ChatTemplate.from_checkpoint(tmp_path, "gemma4").render(msgs) == "XS"
    # with neither, the built-in renderer of the family
    (tmp_path / "tokenizer_config.json").unlink()
    builtin = ChatTemplate.from_checkpoint(tmp_path, "gemma4", "large")
    assert builtin.is_builtin
    assert builtin.render([{"role": "user", "content": "Hi"}]) == CASES["large_thinking_off"][1]
    assert ChatTemplate.from_checkpoint(None, "gemma3").render(msgs) == (
        "<bos><start_of_turn>user\nS\n\nHi<end_of_turn>\n<start_of_turn>model\n")
    # render_chat with an explicit template string; sandbox forbids mutating the messages
    assert render_chat(msgs, chat_template="{{ messages | length }}") == "2"
    with pytest.raises(Exception, match="unsafe|not safely|immutable|append"):
        render_chat(msgs, chat_template="{{ messages.append(1) }}")


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
def test_media_parts_are_refused_not_dropped(part):
    """A jinja template that renders text parts only would silently drop the picture; the render refuses it,
    naming the part, with the checkpoint's template and the built-in one alike."""
    drop_media = ("{{ bos_token }}{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'text' %}"
                  "{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    for tpl in (ChatTemplate("gemma4", "small", drop_media), ChatTemplate("gemma4", "small")):
        with pytest.raises(ChatTemplateError, match=rf"messages\.0\.content\.1: content part of type '{part['type']}'"):
            tpl.render(msgs)
    assert ChatTemplate("gemma4", "small", drop_media).render([
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]) == "<bos>Hi"
