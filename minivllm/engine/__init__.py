"""The engine: the model runner (batch, forward, sampler), the output processor (stop checks, incremental
detokenization, outputs), LLMEngine (one step = schedule, execute, update) and AsyncLLM."""
