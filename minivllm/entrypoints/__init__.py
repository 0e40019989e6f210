"""What users call, on top of everything else: `LLM` (the offline API) and the OpenAI-compatible server.
They choose the engine; nothing below imports them."""
