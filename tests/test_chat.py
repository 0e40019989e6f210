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
