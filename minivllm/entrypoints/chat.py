"""Chat prompts for `LLM.chat` (the appendix): plumbing, not taught. Conversations are checked before any work
is done, then rendered with the tokenizer's chat template and its generation prompt."""


def chat_prompts(tokenizer, conversations) -> list[list[int]]:
    """The token ids of each conversation, ready to generate the assistant's next turn."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("LLM.chat needs a tokenizer with a chat template; this checkpoint has none")
    prompts = []
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError(f"messages[{i}]: a conversation is a non-empty list of {{'role', 'content'}} messages")
        for j, message in enumerate(conversation):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ValueError(f"messages[{i}][{j}]: each message needs a 'role' and a 'content', both strings")
        text = tokenizer.apply_chat_template(list(conversation), add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts
