"""Chat to token ids, in one place: rendered as the engine renders it, refused when the template fails or never
finishes, and the same tokens for LLM.chat and the cache autopsy."""

import sys
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.chat import chat_prompts, chat_token_ids, render_chat_template
from minivllm.tools.cache_autopsy import explain_cache

CONVERSATION = [{"role": "system", "content": "Answer in verse."}, {"role": "user", "content": "Who is there?"}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture
def evil_tokenizer(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", NESTED_LOOPS)
    return llm.tokenizer


def test_rendering_is_the_template_with_the_generation_prompt(llm):
    tokenizer = llm.tokenizer
    expected = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert render_chat_template(tokenizer, CONVERSATION) == expected
    assert chat_token_ids(tokenizer, CONVERSATION) == tokenizer(expected, add_special_tokens=False).input_ids
    without = render_chat_template(tokenizer, CONVERSATION, add_generation_prompt=False)
    assert expected.startswith(without) and expected != without


def test_a_template_that_loops_for_hours_is_refused_after_its_deadline(evil_tokenizer):
    start = time.monotonic()
    with pytest.raises(ValueError, match="chat template.*did not finish rendering within 1 s"):
        render_chat_template(evil_tokenizer, CONVERSATION)
    assert time.monotonic() - start < 10  # a hang guard, not a timing: unbounded, this runs for hours
    with pytest.raises(ValueError, match=r"within 0\.2 s"):
        render_chat_template(evil_tokenizer, CONVERSATION, deadline_s=0.2)


def test_llm_chat_refuses_a_hanging_template_before_any_request_is_added(llm, evil_tokenizer):
    with pytest.raises(ValueError, match="chat template"):
        llm.chat(CONVERSATION, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_the_render_restores_the_tracer_it_found(llm, evil_tokenizer):
    outer = lambda frame, event, arg: None  # noqa: E731 (a stand-in for a debugger's tracer)
    sys.settrace(outer)
    try:
        with pytest.raises(ValueError):
            render_chat_template(evil_tokenizer, CONVERSATION, deadline_s=0.1)
        assert sys.gettrace() is outer
    finally:
        sys.settrace(None)


@pytest.mark.parametrize("template, message", [
    ("{{ raise_exception('no system messages') }}", "failed to render: TemplateError: no system messages"),
    ("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}", "failed to render"),
])
def test_a_template_that_fails_is_a_value_error_naming_the_template(llm, monkeypatch, template, message):
    monkeypatch.setattr(llm.tokenizer, "chat_template", template)
    with pytest.raises(ValueError, match=f"the chat template of .*{message}"):
        render_chat_template(llm.tokenizer, CONVERSATION)


@pytest.mark.parametrize("conversations, where", [
    ([[]], r"messages\[0\]: a conversation is a non-empty list"),
    ([CONVERSATION, [{"role": "user"}]], r"messages\[1\]\[0\]: each message needs"),
    ([[{"role": "user", "content": 3}]], r"messages\[0\]\[0\]"),
])
def test_bad_conversations_are_refused_before_any_is_rendered(llm, conversations, where):
    with pytest.raises(ValueError, match=where):
        chat_prompts(llm.tokenizer, conversations)


def test_no_template_is_a_clear_error(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template|has none"):
        chat_token_ids(llm.tokenizer, CONVERSATION)


def test_llm_chat_and_the_autopsy_see_the_same_tokens(llm):
    [out] = llm.chat(CONVERSATION, SamplingParams(max_tokens=1), use_tqdm=False)
    autopsy = explain_cache(llm.tokenizer, CONVERSATION, CONVERSATION, block_size=4)
    assert out.prompt_token_ids == autopsy.tokens_a == chat_token_ids(llm.tokenizer, CONVERSATION)
    assert autopsy.first_different_token is None


@pytest.mark.parametrize("block_size", [0, -1, 2.5])
def test_the_autopsy_refuses_a_bad_block_size_and_empty_prompts(llm, block_size):
    with pytest.raises(ValueError, match="block_size"):
        explain_cache(llm.tokenizer, "a", "b", block_size=block_size)
    with pytest.raises(ValueError, match="prompt A has no tokens"):
        explain_cache(llm.tokenizer, [], "ROMEO", block_size=4)
    with pytest.raises(ValueError, match="each message needs"):
        explain_cache(llm.tokenizer, [{"role": "user", "content": "hi"}], [{}], block_size=4)


# ------------------------------------------------------------------------------ bounded rendering (issue 41)
LLAMA3_LIKE = """{{- bos_token if bos_token is defined else '' }}
{%- if strftime_now("%Y")|int < 2000 %}{{ raise_exception('a clock before 2000') }}{% endif %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}
{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- tools|tojson(indent=4) }}{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant'] %}{{ raise_exception('user or assistant') }}{%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""
QWEN_LIKE = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == "user" %}{%- set ns.multi_step_tool = false %}
{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == "assistant" %}{% generation %}{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.reasoning_content is defined %}
{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content ~ '<|im_end|>\\n' }}{% endgeneration %}
{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}
{%- if loop.index0 > 10 %}{% break %}{% endif %}
{%- endfor %}
{{- dict(a=1, b=[2, 3])|tojson }}{{- messages|map(attribute='role')|join(',') }}{{ '=' * 8 }}{{ ns.last_query_index }}
{{- '%s-%d'|format('x', 3) ~ '{:>6}'.format('pad') ~ ('%05.1f' % 2.5) ~ 'ab'.center(6, '*') }}
{{- messages|selectattr('role', 'equalto', 'user')|list|length }}{{ eos_token }}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
REASONING = CONVERSATION + [{"role": "assistant", "content": "Bernardo.", "reasoning_content": "\\nA guard.\\n",
                              "name": None}, {"role": "user", "content": "  Long live the king!  "}]


@pytest.mark.parametrize("template", [LLAMA3_LIKE, QWEN_LIKE])
@pytest.mark.parametrize("conversation", [CONVERSATION, REASONING])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_bounded_render_gives_what_transformers_gives(llm, monkeypatch, template, conversation,
                                                           add_generation_prompt):
    """The sandbox with bounds renders real templates' constructs (namespace, loop controls, generation tags,
    tojson, dict, format, trim, reasoning fields, special tokens) exactly as tokenizer.apply_chat_template."""
    monkeypatch.setattr(llm.tokenizer, "chat_template", template)
    expected = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False)
    assert render_chat_template(llm.tokenizer, conversation, add_generation_prompt) == expected


HUGE = [  # each asks one C-level operation for gigabytes (or a loop for terabytes of output)
    ("{{ 'x' * 10**9 }}", r"'\*' 1,000,000,000 times"),
    ("{% set s = 'x' * 1000000 %}{{ s * 1000 }}", r"'\*' 1,000 times"),
    ("{{ 2 ** 1000000000 }}", r"'\*\*' with an integer result of more than"),
    ("{{ '%*s' % (10**9, 'x') }}", r"a '%' format with a '\*' width"),
    ("{{ '%1000000000s' % 'x' }}", r"the format '%1000000000s'"),
    ("{{ '{:>1000000000}'.format('x') }}", r"the format '\{:>1000000000\}'"),
    ("{{ 'x'.ljust(10**9) }}", r"str.ljust\(1000000000\)"),
    ("{{ 'x'|center(10**9) }}", r"the filter 'center' with the number 1,000,000,000"),
    ("{{ ('\t' * 100000).expandtabs(100000) }}", r"str.expandtabs"),
    ("{% set s = 'x' * 999999 %}{{ s.replace('x', s) }}", r"str.replace"),
    ("{% set s = 'x' * 999999 %}{{ s|replace('x', s) }}", r"the filter 'replace'"),
    ("{% set s = '\n' * 999999 %}{{ s|indent(999999) }}", r"the filter 'indent'"),
    ("{% set l = ['x' * 999999] * 999999 %}{{ l|join }}", r"'\*' 999,999 times"),
    ("{{ (['a'] * 99999)|join('y' * 99999) }}", r"the filter 'join'"),
    ("{{ ('y' * 99999).join(['a'] * 99999) }}", r"str.join of 99,999 items"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", r"'~'"),
    ("{% set ns = namespace(l=[1]) %}{% for i in range(60) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
     r"printing a value"),
    ("{{ [1]|batch(10**9, 'x')|list }}", r"the filter 'batch' with the number"),
    ("{{ (1).to_bytes(999999999, 'big') }}", r"calling to_bytes with the number"),
    ("{{ messages|tojson(indent=10**9) }}", r"the filter 'tojson' with the number"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 100000 }}{% endfor %}{% endfor %}",
     r"its output passed 1,048,576 characters"),
]


@pytest.mark.parametrize("template, what", HUGE)
def test_a_template_that_asks_for_gigabytes_is_refused_before_it_gets_them(llm, monkeypatch, template, what):
    import tracemalloc

    monkeypatch.setattr(llm.tokenizer, "chat_template", template)
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(ValueError, match=f"the chat template of .*was refused: {what}"):
            render_chat_template(llm.tokenizer, CONVERSATION)
        seconds, (_, peak) = time.monotonic() - start, tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seconds < 1.0 and peak < 64 * 2**20, (seconds, peak)  # loose sanity bounds: unbounded, GBs and seconds


def test_the_size_bound_grows_with_the_conversation(llm, monkeypatch):
    """A long conversation may render (and a template may copy it a few times); the bound is 4 times its size."""
    long = [{"role": "user", "content": "To be, or not to be. " * 100_000}]  # 2.1 million characters
    monkeypatch.setattr(llm.tokenizer, "chat_template", "{% for m in messages %}{{ m.content * 3 }}{% endfor %}")
    assert len(render_chat_template(llm.tokenizer, long)) == 3 * len(long[0]["content"])
    monkeypatch.setattr(llm.tokenizer, "chat_template", "{% for m in messages %}{{ m.content * 5 }}{% endfor %}")
    with pytest.raises(ValueError, match=r"was refused: '\*' 5 times"):
        render_chat_template(llm.tokenizer, long)
