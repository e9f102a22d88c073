"""Tool calling in chat: the schemas a tool choice constrains the reply to, the parser of the calls models write,
the checks of tools and tool choices, the chat template's view of them, the gRPC mapping, and (slow, on the embedded
SmolLM2) constrained calls end to end through ``LLM.chat`` and the gRPC ``Chat``."""

import json
import logging
import re

import jsonschema
import msgspec
import pytest
from test_grpc import ServerThread, assert_invalid, collect, refusal

from spindle import LLM, SamplingParams
from spindle.client import SpindleClient
from spindle.frontend.engine.connection import start_backend
from spindle.frontend.grpc.mapping import (
    ResponseBuilder,
    messages_from_proto,
    tool_choice_from_proto,
    tools_from_proto,
)
from spindle.frontend.http.app import _ChatShaper
from spindle.frontend.processing.input_processor import InputProcessor
from spindle.frontend.processing.output_processor import OutputProcessor, RequestState
from spindle.frontend.processing.tokenizer import Tokenizer
from spindle.frontend.processing.tools import MAX_PARAMETERS_DEPTH, ChatTools, parse_tool_calls
from spindle.shared import FinishReason, StructuredOutput, ToolCall
from spindle.shared.config import EngineConfig
from spindle.shared.errors import InvalidRequestError
from spindle.shared.json_depth import MAX_JSON_DEPTH
from spindle.shared.protocol import SequenceDelta
from spindle.v1 import spindle_pb2

pytest_plugins = ["fixtures_tokenizer"]

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEGMENT = {
    "type": "object",
    "properties": {"start": {"$ref": "#/$defs/Point"}, "end": {"$ref": "#/$defs/Point"}},
    "required": ["start", "end"],
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city now.", "parameters": WEATHER},
    },
    {"name": "now", "description": "The time."},  # bare, and without parameters
    {"type": "function", "function": {"name": "length", "parameters": SEGMENT}},
]
NAMES = ["get_weather", "now", "length"]
CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")

# A Hermes-style template: the tools as JSON lines, assistant calls in <tool_call> blocks, tool turns with their id.
TOOL_TEMPLATE = """{{ bos_token }}
{%- if tools %}<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
{% endif %}
{%- for message in messages %}<{{ message.role }}>{{ message.content }}
{%- for call in message.tool_calls or [] %}<tool_call>{{ {"id": call.id, "name": call.function.name,
"arguments": call.function.arguments} | tojson }}</tool_call>{% endfor %}
{%- if message.tool_call_id %} [{{ message.tool_call_id }}]{% endif %}
{% endfor %}
{%- if add_generation_prompt %}<assistant>{% endif %}"""

CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo, and the time?"},
    {
        "role": "assistant",
        "content": None,  # as OpenAI's clients send a turn that only calls tools
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
            },
            ToolCall("call_2", "now", "{}"),
        ],
    },
    {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"},
    {"role": "tool", "content": "09:12", "tool_call_id": "call_2"},
]
# The conversation as Hugging Face templates take it: arguments as dicts, no null content.
CONVERSATION_FOR_HF = [
    CONVERSATION[0],
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}},
            },
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
        ],
    },
    *CONVERSATION[2:],
]


@pytest.fixture(scope="module")
def tool_tokenizer(llama_style_tokenizer) -> Tokenizer:
    return Tokenizer(llama_style_tokenizer.backend, TOOL_TEMPLATE, llama_style_tokenizer.special_tokens)


@pytest.fixture(scope="module")
def processor(tool_tokenizer) -> InputProcessor:
    return InputProcessor(tool_tokenizer, 100_000, tool_tokenizer.vocab_size)


def chat_tools(tool_choice: str | dict) -> ChatTools:
    tools = ChatTools.from_request(TOOLS, tool_choice, SamplingParams())
    assert tools is not None
    return tools


def nested(depth: int) -> dict:
    """Tool parameters nested ``depth`` levels deep: object schemas, each holding the next under ``x``."""
    value: dict = {"type": "object"}
    for _ in range(depth - 1):
        value = {"type": "object", "x": value}
    return value


def calls_of(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    """The calls' names and decoded arguments, after checking their ids."""
    assert all(CALL_ID.fullmatch(call.id) for call in calls)
    assert len({call.id for call in calls}) == len(calls)
    return [(call.name, json.loads(call.arguments)) for call in calls]


POINT = {"x": 1}
SEGMENT_ARGUMENTS = {"start": POINT, "end": {"x": 4}}


@pytest.mark.parametrize(
    "tool_choice,instance,valid",
    [
        ("required", [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}], True),
        ("required", [{"name": "now", "arguments": {}}, {"name": "length", "arguments": SEGMENT_ARGUMENTS}], True),
        ("required", [], False),  # at least one call
        ("required", {"name": "now", "arguments": {}}, False),  # an array, even of one call
        ("required", [{"name": "get_weather", "arguments": {"city": "Oslo"}}], False),  # its own schema applies
        ("required", [{"name": "now", "arguments": {"city": "Oslo"}}], True),  # an empty schema allows anything...
        ("required", [{"name": "sleep", "arguments": {}}], False),  # ...but only the given tools
        ("required", [{"name": "now"}], False),
        ("required", [{"name": "now", "arguments": {}, "why": "because"}], False),
        ("required", [{"name": "length", "arguments": {"start": {"x": "one"}, "end": POINT}}], False),  # via $defs
        ("get_weather", {"city": "Oslo", "unit": "fahrenheit"}, True),
        ("get_weather", {"city": "Oslo", "unit": "kelvin"}, False),
        ("get_weather", [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}], False),
        ("now", {}, True),
        ("now", [], False),
        ("length", SEGMENT_ARGUMENTS, True),
        ("length", {"start": POINT, "end": {"y": 2}}, False),
    ],
)
def test_the_constraint_accepts_exactly_the_valid_calls(tool_choice, instance, valid):
    schema = chat_tools(tool_choice).output_schema()
    validator = jsonschema.Draft202012Validator(schema)
    validator.check_schema(schema)
    assert validator.is_valid(instance) == valid


@pytest.mark.parametrize("tool_choice", ["required", "get_weather", {"type": "function", "function": {"name": "now"}}])
def test_constrain_sets_the_schema_on_a_copy(tool_choice):
    params = SamplingParams(temperature=0.5, max_tokens=7, stop=["\n\n"])
    tools = chat_tools(tool_choice)
    constrained = tools.constrain(params)
    assert constrained.structured_output == StructuredOutput(json_schema=tools.output_schema())
    assert msgspec.structs.replace(constrained, structured_output=None) == params
    assert params.structured_output is None


def test_auto_constrains_nothing():
    params = SamplingParams(structured_output=StructuredOutput(json_object=True))
    tools = ChatTools.from_request(TOOLS, "auto", params)
    assert tools.output_schema() is None and tools.constrain(params) is params


WEATHER_OSLO = ("get_weather", {"city": "Oslo", "unit": "celsius"})
CALL_OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
CALL_NOW = '{"name": "now", "arguments": {}}'


@pytest.mark.parametrize(
    "text,expected",
    [
        (f"Let me check.\n<tool_call>\n{CALL_OSLO}\n</tool_call>", [WEATHER_OSLO]),
        (f"<tool_call>{CALL_OSLO}</tool_call>\n<tool_call>{CALL_NOW}</tool_call>", [WEATHER_OSLO, ("now", {})]),
        (f"<tool_call>[{CALL_NOW}, {CALL_OSLO}]</tool_call>", [("now", {}), WEATHER_OSLO]),
        (f"<tool_call>{CALL_OSLO}", [WEATHER_OSLO]),  # unterminated: eos or a stop string came first
        (f"<tool_call>{CALL_OSLO}</tool_call><tool_call>{{broken</tool_call>", [WEATHER_OSLO]),
        ('{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}', [WEATHER_OSLO]),  # Llama 3
        (f"  [{CALL_OSLO}, {CALL_NOW}]\n", [WEATHER_OSLO, ("now", {})]),
        (f"{CALL_NOW}; {CALL_OSLO}", [("now", {}), WEATHER_OSLO]),
        (f"```json\n{CALL_OSLO}\n```", [WEATHER_OSLO]),
        (f"[TOOL_CALLS] [{CALL_OSLO}]", [WEATHER_OSLO]),  # Mistral
        (f"<|python_tag|>{CALL_NOW}", [("now", {})]),  # Llama 3.1
        ('{"type": "function", "function": {"name": "now", "arguments": "{}"}}', [("now", {})]),
        ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"unit\\": \\"celsius\\"}"}', [WEATHER_OSLO]),
        ('{"name": "now"}', [("now", {})]),
        (f'[{{"name": "sleep", "arguments": {{}}}}, {CALL_NOW}]', [("now", {})]),  # only the given tools
        ('{"name": "now", "arguments": [1, 2]}', []),
        ('{"name": "now", "arguments": "not json"}', []),
        ('{"answer": 42}', []),
        (f"Sure, here it is: {CALL_OSLO}", []),  # JSON inside prose is not a call
        ("<tool_call>{broken</tool_call>", []),
        ("The weather in Oslo is cold.", []),
        ("", []),
        # Nested past the recursion limit, as logit_bias can push a reply: text, as any other JSON that does not parse.
        ("[" * 5000, []),
        ("[" * 5000 + "]" * 5000, []),
        (f"<tool_call>{'[' * 5000}</tool_call>", []),
        ('{"name": "now", "arguments": "' + "[" * 5000 + "]" * 5000 + '"}', []),
    ],
)
def test_the_auto_parser_reads_the_common_formats(text, expected):
    assert calls_of(parse_tool_calls(text, NAMES)) == expected
    assert calls_of(chat_tools("auto").parse(text)) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ('{"city": "Oslo", "unit": "celsius"}', '{"city": "Oslo", "unit": "celsius"}'),
        ('  {"city":"Oslo","unit":"celsius"}\n', '{"city":"Oslo","unit":"celsius"}'),
        ('{"city": "Oslo", "unit"', None),  # cut by max_tokens
        ("[1, 2]", None),
        ('{"city": ' + "[" * 5000, None),  # nested past the recursion limit
    ],
)
def test_a_named_choice_reads_the_reply_as_the_arguments(text, expected):
    calls = chat_tools("get_weather").parse(text)
    assert [call.arguments for call in calls] == ([] if expected is None else [expected])
    assert all(call.name == "get_weather" and CALL_ID.fullmatch(call.id) for call in calls)


def test_a_required_choice_reads_the_constrained_array():
    text = json.dumps([{"name": "now", "arguments": {}}, {"name": "length", "arguments": SEGMENT_ARGUMENTS}])
    assert calls_of(chat_tools("required").parse(text)) == [("now", {}), ("length", SEGMENT_ARGUMENTS)]


@pytest.mark.parametrize(
    "tools,tool_choice",
    [(None, "auto"), (None, "none"), ([], None), (TOOLS, "none")],
    ids=["no-tools", "no-tools-none", "empty-tools", "none"],
)
def test_without_tools_or_under_none_there_is_nothing_to_do(tools, tool_choice):
    assert ChatTools.from_request(tools, tool_choice, SamplingParams()) is None


def test_a_tool_named_like_a_mode_is_chosen_by_the_dict_form():
    tools = [{"name": "none"}, {"name": "auto"}]
    assert ChatTools.from_request(tools, "none", SamplingParams()) is None
    named = ChatTools.from_request(tools, {"type": "function", "function": {"name": "none"}}, SamplingParams())
    assert (named.choice, named.name) == ("named", "none")


def test_tools_reach_the_template_in_openai_form():
    tools = chat_tools("auto").tools
    assert [tool["type"] for tool in tools] == ["function"] * 3
    assert tools[0]["function"] == TOOLS[0]["function"]
    assert tools[1]["function"] == {**TOOLS[1], "parameters": {"type": "object", "properties": {}}}
    assert tools[2]["function"]["parameters"] is SEGMENT


STRUCTURED = SamplingParams(structured_output=StructuredOutput(regex="[a-z]+"))


@pytest.mark.parametrize(
    "tools,tool_choice,params,fields,message",
    [
        ({"name": "now"}, "auto", None, ("tools",), "tools must be a list of tool dicts, not dict"),
        (["now"], "auto", None, ("tools[0]",), "tools[0] must be {'type': 'function', 'function'"),
        ([{"type": "function", "function": "now"}], "auto", None, ("tools[0]",), "not {'type'"),
        (
            [{"type": "retrieval", "function": {"name": "now"}}],
            "auto",
            None,
            ("tools[0]",),
            "has type 'retrieval': only 'function' tools",
        ),
        ([{"name": " "}], "auto", None, ("tools[0].name",), "tools[0] needs a non-empty str name, got ' '"),
        ([{"description": "x"}], "auto", None, ("tools[0].name",), "needs a non-empty str name, got None"),
        (
            [*TOOLS, {"name": "now"}],
            "auto",
            None,
            ("tools[3].name",),
            "tools[3] is named 'now', as tools[1] is: tool names must be unique",
        ),
        ([{"name": "now", "description": 3}], "auto", None, ("tools[0].description",), "must be a str, not int"),
        (
            [{"name": "now", "parameters": {"type": "array"}}],
            "auto",
            None,
            ("tools[0].parameters",),
            "must be a JSON schema of type 'object' (the arguments are a JSON object), got 'array'",
        ),
        ([{"name": "now", "parameters": "{}"}], "auto", None, ("tools[0].parameters",), "got 'str'"),
        ([{"name": "now", "parameters": {"x": {1, 2}}}], "auto", None, ("tools[0].parameters",), "are not JSON"),
        (
            [{"name": "now", "parameters": nested(MAX_PARAMETERS_DEPTH + 1)}],
            "auto",
            None,
            ("tools[0].parameters",),
            f"tools[0].parameters is nested deeper than {MAX_PARAMETERS_DEPTH} levels",
        ),
        (
            [{"name": "now", "parameters": nested(100_000)}],  # json.dumps would raise RecursionError
            "required",
            None,
            ("tools[0].parameters",),
            "is nested deeper than",
        ),
        (None, "required", None, ("tool_choice",), "tool_choice='required' needs tools to call"),
        (TOOLS, "sleep", None, ("tool_choice.function_name",), "nor the name of a given tool (the tools are ["),
        (None, "now", None, ("tool_choice.function_name",), "'now' is neither 'auto', 'none' nor 'required'"),
        (TOOLS, {"type": "function", "function": {}}, None, ("tool_choice.function_name",), "a named tool choice is"),
        (TOOLS, {"type": "function"}, None, ("tool_choice.function_name",), "a named tool choice is"),
        (TOOLS, 1, None, ("tool_choice",), "tool_choice must be 'auto', 'none', 'required', a tool's name or"),
        (
            TOOLS,
            "required",
            STRUCTURED,
            ("tool_choice", "sampling_params.structured_output"),
            "conflicts with sampling_params.structured_output",
        ),
        (TOOLS, "now", STRUCTURED, ("tool_choice", "sampling_params.structured_output"), "constrains the reply"),
    ],
)
def test_bad_tools_and_choices_are_refused_naming_the_field(processor, tools, tool_choice, params, fields, message):
    params = params or SamplingParams()
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as error:
        processor.process_chat(CONVERSATION[:1], params, tools=tools, tool_choice=tool_choice)
    assert error.value.fields == fields


def test_tool_parameters_as_deep_as_allowed_fit_the_schema_of_required_calls():
    deepest = [{"name": "deep", "parameters": nested(MAX_PARAMETERS_DEPTH)}]
    tools = ChatTools.from_request(deepest, "required", SamplingParams())
    schema = tools.constrain(
        SamplingParams()
    ).structured_output.json_schema  # within MAX_JSON_DEPTH, or this would raise
    assert json.loads(schema) == tools.output_schema()


def with_call(**changes) -> list[dict]:
    """CONVERSATION[:2] with the first tool call's function changed (``None`` drops a key)."""
    call = CONVERSATION[1]["tool_calls"][0]
    function = {key: value for key, value in {**call["function"], **changes}.items() if value is not None}
    return [CONVERSATION[0], {**CONVERSATION[1], "tool_calls": [{**call, "function": function}]}]


@pytest.mark.parametrize(
    "messages,field,message",
    [
        (with_call(arguments='{"city": '), "messages[1].tool_calls[0].arguments", "arguments are not JSON"),
        (with_call(arguments="[1]"), "messages[1].tool_calls[0].arguments", "must be a JSON object, got [1]"),
        (
            with_call(arguments='{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
            "messages[1].tool_calls[0].arguments",
            f"is nested deeper than {MAX_JSON_DEPTH} levels",
        ),
        (
            with_call(arguments=nested(MAX_JSON_DEPTH + 1)),
            "messages[1].tool_calls[0].arguments",
            f"is nested deeper than {MAX_JSON_DEPTH} levels",
        ),
        (with_call(name=None), "messages[1].tool_calls[0].name", "needs a non-empty str name, got None"),
        (
            [CONVERSATION[0], {**CONVERSATION[1], "tool_calls": ["call"]}],
            "messages[1].tool_calls[0]",
            "or a ToolCall, not 'call'",
        ),
        (
            [CONVERSATION[0], {**CONVERSATION[1], "tool_calls": [{"id": 7, "name": "now"}]}],
            "messages[1].tool_calls[0].id",
            "id must be a str, got 7",
        ),
        (
            [CONVERSATION[0], {**CONVERSATION[1], "tool_calls": {"name": "now"}}],
            "messages[1].tool_calls",
            "tool_calls must be a list, not dict",
        ),
        (
            [CONVERSATION[0], {"role": "assistant", "content": None, "tool_calls": []}],
            "messages[1].content",
            "messages[1] needs a str 'content', got None",
        ),
        (
            [CONVERSATION[0], {"role": "tool", "content": "1", "tool_call_id": 1}],
            "messages[1].tool_call_id",
            "tool_call_id must be a str, got 1",
        ),
    ],
)
def test_bad_tool_calls_in_messages_are_refused_naming_the_field(processor, messages, field, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as error:
        processor.process_chat(messages, SamplingParams(), tools=TOOLS)
    assert error.value.fields == (field,)


@pytest.mark.parametrize("tool_choice", ["auto", "required", "length", "none"])
def test_the_template_receives_tools_and_calls_as_transformers_passes_them(processor, hf_llama_style, tool_choice):
    processed = processor.process_chat(CONVERSATION, SamplingParams(), tools=TOOLS, tool_choice=tool_choice)
    shown = None if tool_choice == "none" else ChatTools.from_request(TOOLS, "auto", SamplingParams()).tools
    expected = hf_llama_style.apply_chat_template(
        CONVERSATION_FOR_HF, tools=shown, chat_template=TOOL_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert processed.prompt == expected
    assert ('"name": "get_weather", "description"' in expected) == (tool_choice != "none")
    assert '"arguments": {"city": "Oslo", "unit": "celsius"}}</tool_call>' in expected
    assert processed.tools == (None if tool_choice == "none" else chat_tools(tool_choice))


def test_a_conversation_without_tools_renders_as_before(processor):
    messages = [{"role": "user", "content": "hi", "name": "ana"}]
    processed = processor.process_chat(messages, SamplingParams())
    assert processed.prompt == processor.tokenizer.apply_chat_template(messages) and processed.tools is None


TEXTS = [f"<tool_call>{CALL_NOW}</tool_call>", "It is late."]


def steps(tokenizer: Tokenizer, request_id: str = "r") -> list[list[SequenceDelta]]:
    """Three steps of a request with n=2: completion 0 (a call) ends in the second, completion 1 in the third."""
    zero, one = (tokenizer.encode(text, add_special_tokens=False) for text in TEXTS)
    stop = FinishReason.STOP
    return [
        [SequenceDelta(request_id, 0, zero[:3]), SequenceDelta(request_id, 1, one[:2])],
        [SequenceDelta(request_id, 0, zero[3:], finish_reason=stop), SequenceDelta(request_id, 1, one[2:4])],
        [SequenceDelta(request_id, 1, one[4:], finish_reason=stop)],
    ]


@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
def test_each_completion_carries_its_calls_from_where_it_finishes(tool_tokenizer, delta):
    processor = OutputProcessor(tool_tokenizer)
    processor.add_request(
        RequestState("r", None, [1], SamplingParams(n=2), tool_tokenizer, 0.0, delta, tools=chat_tools("auto"))
    )
    outputs = [processor.process(step).outputs[0] for step in steps(tool_tokenizer)]
    first, second, third = ([c.tool_calls for c in output.outputs] for output in outputs)
    assert first == [None, None]
    assert calls_of(second[0]) == [("now", {})] and second[1] is None
    assert third == ([None, []] if delta else [second[0], []])
    text = "".join(output.outputs[0].text for output in outputs) if delta else outputs[-1].outputs[0].text
    assert text == TEXTS[0]  # the text stays as generated

    if delta:  # the gRPC stream: the calls come in the message where the choice ends, once
        builder = ResponseBuilder()
        messages = [builder.build(output) for output in outputs]
        sent = [[(d.index, [(c.id, c.name, c.arguments) for c in d.tool_calls]) for d in m.choices] for m in messages]
        call = second[0][0]
        assert sent == [[(0, []), (1, [])], [(0, [(call.id, "now", "{}")]), (1, [])], [(1, [])]]


CALL_PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
STREAMED_REPLIES = {  # (reply, tool choice, the reply's start that makes its first call whole)
    "hermes": (f"<tool_call>{CALL_NOW}</tool_call>\n<tool_call>{CALL_PARIS}</tool_call>", "auto", "</tool_call>"),
    "json-array": (f"[{CALL_NOW}, {CALL_PARIS}]", "required", CALL_NOW[-1]),
}


def stream_by_character(tokenizer: Tokenizer, text: str, tools: ChatTools, delta: bool) -> list:
    """The outputs of a reply streamed a character at a time (``[(characters so far, completion output)]``)."""
    processor = OutputProcessor(tokenizer)
    processor.add_request(RequestState("r", None, [1], SamplingParams(), tokenizer, 0.0, delta, tools=tools))
    ids = tokenizer.encode(text, add_special_tokens=False)
    outputs = []
    for i, token in enumerate(ids):
        end = FinishReason.STOP if i == len(ids) - 1 else None
        for output in processor.process([SequenceDelta("r", 0, [token], finish_reason=end)]).outputs:
            outputs.append((tokenizer.decode(ids[: i + 1]), output.outputs[0]))
    return outputs


@pytest.mark.parametrize("form", STREAMED_REPLIES)
@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
def test_each_call_streams_as_soon_as_it_is_whole(tool_tokenizer, form, delta):
    """The first call comes in the output whose text closes it, long before the reply ends; ids never change."""
    text, choice, closing = STREAMED_REPLIES[form]
    outputs = stream_by_character(tool_tokenizer, text, chat_tools(choice), delta)
    firsts = [i for i, (_, completion) in enumerate(outputs) if completion.tool_calls]
    whole = text[: text.index(CALL_NOW) + len(CALL_NOW)]
    whole += closing if closing == "</tool_call>" else ""
    closed = next(i for i, (so_far, _) in enumerate(outputs) if so_far.startswith(whole))
    assert firsts[0] == closed < len(outputs) - 1
    if delta:
        streamed = [call for _, completion in outputs for call in completion.tool_calls or []]
        assert outputs[-1][1].tool_calls is not None  # the end says so, even with nothing new
    else:
        streamed = outputs[-1][1].tool_calls
        assert all(
            outputs[i + 1][1].tool_calls[: len(c.tool_calls)] == c.tool_calls
            for i, (_, c) in enumerate(outputs[:-1])
            if c.tool_calls
        )
    assert calls_of(streamed) == [("now", {}), ("get_weather", {"city": "Paris", "unit": "celsius"})]


def openai_stream(tokenizer: Tokenizer, text: str, tools: ChatTools, max_calls: int | None = None) -> list[dict]:
    """The chat chunks' choices of a reply streamed a character at a time through the OpenAI route's shaper."""
    shaper = _ChatShaper("chatcmpl-1", "m", SamplingParams(), 0, tools, max_calls)
    outputs = stream_by_character(tokenizer, text, tools, True)
    return [chunk for chunk in (shaper.part(0, c, None) for _, c in outputs) if chunk is not None], shaper


@pytest.mark.parametrize("form", STREAMED_REPLIES)
def test_the_openai_stream_sends_each_calls_arguments_as_they_are_written(tool_tokenizer, form):
    """As vLLM streams them: index, id and name once the arguments start, then their text in fragments."""
    text, choice, _ = STREAMED_REPLIES[form]
    sent, shaper = openai_stream(tool_tokenizer, text, chat_tools(choice))
    deltas = [call for chunk in sent for call in chunk["delta"].get("tool_calls", [])]
    heads = [d for d in deltas if "id" in d]
    assert [(d["index"], d["function"]["name"]) for d in heads] == [(0, "now"), (1, "get_weather")]
    arguments = ["".join(d["function"]["arguments"] for d in deltas if d["index"] == i) for i in (0, 1)]
    assert arguments == ["{}", '{"city": "Paris", "unit": "celsius"}']  # as written, whole once joined
    fragments = [d for d in deltas if d["index"] == 1]
    assert len(fragments) > 10 and all(set(d) == {"index", "function"} for d in fragments[1:])
    assert sent[-1]["finish_reason"] == "tool_calls" and "content" not in sent[-1]["delta"]
    assert all(chunk["finish_reason"] is None for chunk in sent[:-1])
    message = shaper.response()["choices"][0]["message"]
    assert [c["id"] for c in message["tool_calls"]] == [d["id"] for d in heads] and message["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [json.loads(a) for a in arguments]


def test_a_named_choice_streams_its_arguments_and_parallel_false_keeps_one_call(tool_tokenizer):
    named, _ = openai_stream(tool_tokenizer, '{"city": "Paris"}', chat_tools("get_weather"))
    deltas = [call for chunk in named for call in chunk["delta"].get("tool_calls", [])]
    assert deltas[0]["function"]["name"] == "get_weather" and len(deltas) > 5
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    text = STREAMED_REPLIES["hermes"][0]
    one, _ = openai_stream(tool_tokenizer, text, chat_tools("auto"), max_calls=1)
    assert {call["index"] for chunk in one for call in chunk["delta"].get("tool_calls", [])} == {0}


def test_a_call_given_as_a_string_of_json_comes_whole(tool_tokenizer):
    """Arguments written as a JSON string cannot be followed as an object: the call comes once it is whole."""
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
    sent, _ = openai_stream(tool_tokenizer, text, chat_tools("auto"))
    [delta] = [call for chunk in sent for call in chunk["delta"].get("tool_calls", [])]
    assert json.loads(delta["function"]["arguments"]) == {"city": "Paris"} and delta["id"].startswith("call_")


def test_requests_without_tools_carry_no_calls(tool_tokenizer):
    processor = OutputProcessor(tool_tokenizer)
    processor.add_request(RequestState("r", None, [1], SamplingParams(), tool_tokenizer, 0.0, False))
    ids = tool_tokenizer.encode(TEXTS[0], add_special_tokens=False)
    [output] = processor.process([SequenceDelta("r", 0, ids, finish_reason=FinishReason.STOP)]).outputs
    assert output.finished and output.outputs[0].tool_calls is None


class BrokenTools(ChatTools):
    """Tools whose parser has a bug: it raises on any reply."""

    def parse(self, text: str) -> list[ToolCall]:
        raise KeyError("a parser bug")


class FinishedRequests:
    """A step listener that keeps the ids of the requests that ended."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def on_tokens(self, state: RequestState, num_new_tokens: int, now: float) -> None:
        pass

    def on_finished(self, state: RequestState, now: float) -> None:
        self.ids.append(state.request_id)


@pytest.mark.parametrize(
    "tools,extra_delta,failing_step,cause",
    [
        (BrokenTools(chat_tools("auto").tools, "auto"), None, 1, KeyError),  # parsing the finished completion 0 raises
        (None, SequenceDelta("bad", 7, [5]), 0, IndexError),  # a delta for a completion the request does not have
    ],
    ids=["parser", "delta"],
)
def test_a_request_whose_output_cannot_be_processed_fails_alone(
    tool_tokenizer, caplog, tools, extra_delta, failing_step, cause
):
    def state(request_id: str, tools: ChatTools | None = None) -> RequestState:
        return RequestState(request_id, None, [1], SamplingParams(n=2), tool_tokenizer, 0.0, True, tools=tools)

    alone = OutputProcessor(tool_tokenizer)
    alone.add_request(state("good"))
    expected = [alone.process(step).outputs[0].outputs for step in steps(tool_tokenizer, "good")]

    processor, listener = OutputProcessor(tool_tokenizer), FinishedRequests()
    processor.listeners.append(listener)
    processor.add_request(state("bad", tools))
    processor.add_request(state("good"))
    bad_steps = steps(tool_tokenizer, "bad")
    if extra_delta is not None:
        bad_steps[0].append(extra_delta)
    for number, (bad, good) in enumerate(zip(bad_steps, steps(tool_tokenizer, "good"), strict=True)):
        with caplog.at_level(logging.ERROR):
            outputs, _, failed = processor.process(bad + good)
        assert [output.outputs for output in outputs if output.request_id == "good"] == [expected[number]]
        if number < failing_step:
            assert failed == [] and "bad" in processor.requests
        elif number == failing_step:
            assert [(error.request_id, type(error.__cause__)) for error in failed] == [("bad", cause)]
            assert "bad" not in processor.requests and "could not be processed" in str(failed[0])
        else:  # its late deltas are dropped, as an aborted request's
            assert failed == [] and all(output.request_id == "good" for output in outputs)
    logged = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert [(record.request_id, record.exc_info[0]) for record in logged] == [("bad", cause)]
    assert listener.ids == ["bad", "good"]


class CapturingStub:
    """Stands in for the gRPC stub: keeps the ChatRequest the client built."""

    def Chat(self, request: spindle_pb2.ChatRequest, **kwargs) -> list:  # noqa: N802
        self.request = request
        return []


@pytest.mark.parametrize(
    "tool_choice,expected",
    [
        (None, "auto"),
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ("now", {"type": "function", "function": {"name": "now"}}),
        ({"type": "function", "function": {"name": "now"}}, {"type": "function", "function": {"name": "now"}}),
    ],
)
def test_the_grpc_request_carries_what_the_python_api_takes(processor, tool_choice, expected):
    """SpindleClient.chat builds the ChatRequest; the server's mapping gives back the same conversation and tools."""
    client = SpindleClient("localhost:1")
    client.stub = CapturingStub()
    client.chat(CONVERSATION, tools=TOOLS, tool_choice=tool_choice, temperature=0)
    request = client.stub.request
    assert tool_choice_from_proto(request) == expected
    tools = tools_from_proto(request)
    assert tools == [
        TOOLS[0],
        {"type": "function", "function": TOOLS[1]},
        {"type": "function", "function": {"name": "length", "parameters": SEGMENT}},
    ]
    messages = messages_from_proto(request)
    assert messages[2:] == CONVERSATION[2:]
    by_grpc = processor.process_chat(messages, SamplingParams(), tools=tools, tool_choice=expected)
    by_python = processor.process_chat(CONVERSATION, SamplingParams(), tools=TOOLS, tool_choice=tool_choice)
    assert by_grpc == by_python
    client.close()


@pytest.mark.parametrize(
    "parameters,message",
    [("{", "tools[1].parameters is not JSON"), ("[" * 100_000, "tools[1].parameters is nested deeper than")],
    ids=["bad", "deep"],
)
def test_grpc_tools_with_bad_json_or_an_unknown_mode_are_refused(parameters, message):
    tools = [spindle_pb2.Tool(name="a"), spindle_pb2.Tool(name="b", parameters=parameters)]
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as error:
        tools_from_proto(spindle_pb2.ChatRequest(tools=tools))
    assert error.value.fields == ("tools[1].parameters",)
    request = spindle_pb2.ChatRequest(tool_choice=spindle_pb2.ToolChoice(mode=9))
    with pytest.raises(InvalidRequestError, match="not a ToolChoiceMode") as error:
        tool_choice_from_proto(request)
    assert error.value.fields == ("tool_choice.mode",)


# End to end on the embedded SmolLM2, whose chat template ignores tools: the system turn describes them, and the
# constraint makes the reply a valid call whatever the model would have said.
E2E_MESSAGES = [
    {
        "role": "system",
        "content": 'You call tools. get_weather(city: str, unit: "celsius" | "fahrenheit") gives the weather in a city;'
        " now() gives the time.",
    },
    {"role": "user", "content": "What is the weather like in Paris, in celsius?"},
]
E2E_TOOLS = TOOLS[:2]  # length's integers could grow as long as max_tokens lets them
E2E_PARAMS = {"temperature": 0, "max_tokens": 96}
E2E_CONFIG = {"dtype": "float32", "kv_cache_memory": "256MiB", "max_model_len": 2048}


def assert_valid_calls(calls: list[tuple[str, str]], tool_choice: str) -> None:
    """Each ``(name, arguments)`` calls one of E2E_TOOLS (the named one, for a named choice) with valid arguments."""
    assert calls and (tool_choice == "required" or {name for name, _ in calls} == {tool_choice})
    tools = ChatTools.from_request(E2E_TOOLS, "auto", SamplingParams()).tools
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    return LLM(**E2E_CONFIG)


@pytest.fixture(scope="module")
def smollm2_server():
    process, address = start_backend(EngineConfig.of(**E2E_CONFIG))
    server = ServerThread(address)
    yield server
    server.close()
    process.terminate()
    process.wait(30)


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
def test_llm_chat_constrains_the_reply_to_valid_calls(smollm2, tool_choice):
    [output] = smollm2.chat(
        E2E_MESSAGES, SamplingParams(**E2E_PARAMS), use_tqdm=False, tools=E2E_TOOLS, tool_choice=tool_choice
    )
    completion = output.outputs[0]
    assert completion.finish_reason == "stop", completion.text
    assert_valid_calls([(call.name, call.arguments) for call in completion.tool_calls], tool_choice)
    assert all(CALL_ID.fullmatch(call.id) for call in completion.tool_calls)
    # The text stays as generated: the array of calls, or the one call's arguments.
    expected = [json.loads(call.arguments) for call in completion.tool_calls]
    text = json.loads(completion.text)
    assert [call["arguments"] for call in text] == expected if tool_choice == "required" else [text] == expected


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
def test_grpc_chat_streams_valid_calls(smollm2_server, tool_choice):
    """Each call comes once, in the message where it is whole (the last, at the latest); together they are valid."""
    with smollm2_server.client(timeout=120) as client:
        choices, messages = collect(client.chat(E2E_MESSAGES, tools=E2E_TOOLS, tool_choice=tool_choice, **E2E_PARAMS))
    assert choices[0]["finish"] == [(spindle_pb2.FINISH_REASON_STOP, None)], choices[0]["text"]
    [final] = [delta for message in messages for delta in message.choices if delta.finish_reason]
    assert final in messages[-1].choices
    calls = [call for message in messages for delta in message.choices for call in delta.tool_calls]
    assert len({call.id for call in calls}) == len(calls)
    assert_valid_calls([(call.name, call.arguments) for call in calls], tool_choice)


@pytest.mark.slow
def test_grpc_chat_refuses_tool_parameters_that_are_not_json(smollm2_server):
    bad = [spindle_pb2.Tool(name="now"), spindle_pb2.Tool(name="get_weather", parameters="{'city': str}")]
    with smollm2_server.client(timeout=30) as client:
        error = refusal(lambda: client.chat(E2E_MESSAGES, tools=bad, tool_choice="required"))
    assert_invalid(error, ["tools[1].parameters"], "tools[1].parameters is not JSON")
