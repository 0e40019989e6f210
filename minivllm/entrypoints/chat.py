"""Chat prompts: a conversation to the token ids the engine sees, in one place (`LLM.chat`, the cache autopsy,
and whatever else renders a chat). Plumbing, not taught.

Conversations are checked before any work is done. The chat template is code that came with the checkpoint
(a GGUF file, a hub folder), so it is rendered under a deadline: transformers renders it in jinja2's sandbox,
which stops a template from touching Python objects but not from looping for hours (two nested
`range(100000)` loops are 10^10 steps). Every Python line the render executes checks the clock, so a template
that runs past the deadline is stopped in that thread, its own, and refused with a ValueError.
"""

import sys
import time

RENDER_DEADLINE_S = 1.0  # a real chat template renders in about a millisecond


class _Overdue(BaseException):
    """Raised inside the render when it runs past its deadline; a BaseException, so that no `except Exception`
    in the template's machinery can swallow it."""


def check_conversation(conversation, where: str = "messages") -> None:
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"{where}: a conversation is a non-empty list of {{'role', 'content'}} messages")
    for j, message in enumerate(conversation):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}[{j}]: each message needs a 'role' and a 'content', both strings")


def _template_name(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    source = template if isinstance(template, str) else repr(template)
    first_line = source.strip().splitlines()[0][:60] if source.strip() else ""
    return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'this tokenizer'} ({first_line!r}...)"


def render_chat_template(tokenizer, conversation, add_generation_prompt: bool = True,
                         deadline_s: float = RENDER_DEADLINE_S) -> str:
    """The conversation as text, through the tokenizer's chat template, with the prompt that opens the
    assistant's turn (as vLLM and `LLM.chat` render it). Refuses a template that fails or runs past deadline_s."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("a chat needs a tokenizer with a chat template; this checkpoint has none")
    check_conversation(conversation)
    stop_at = time.monotonic() + deadline_s

    def tick(frame, event, arg):  # the trace function of every frame the render runs: each line checks the clock
        if time.monotonic() > stop_at:
            raise _Overdue
        return tick

    outer = sys.gettrace()  # a debugger's or coverage's tracer, restored afterwards
    sys.settrace(tick)
    try:
        return tokenizer.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except _Overdue:
        raise ValueError(f"{_template_name(tokenizer)} did not finish rendering within {deadline_s:g} s: "
                         f"refused (a template that loops without bound)") from None
    except Exception as error:  # jinja2's errors, raise_exception() in the template, a missing variable
        raise ValueError(f"{_template_name(tokenizer)} failed to render: {type(error).__name__}: {error}") from error
    finally:
        sys.settrace(outer)


def chat_token_ids(tokenizer, conversation, add_generation_prompt: bool = True) -> list[int]:
    """The token ids the engine sees for a conversation: the rendered template already holds the special
    tokens it wants, so the tokenizer adds none."""
    text = render_chat_template(tokenizer, conversation, add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def chat_prompts(tokenizer, conversations) -> list[list[int]]:
    """`LLM.chat`: the token ids of each conversation, all checked before any is rendered."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("LLM.chat needs a tokenizer with a chat template; this checkpoint has none")
    for i, conversation in enumerate(conversations):
        check_conversation(conversation, f"messages[{i}]")
    return [chat_token_ids(tokenizer, conversation) for conversation in conversations]
