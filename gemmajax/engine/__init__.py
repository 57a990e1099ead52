"""The serving engine: requests, scheduler, paged KV pages, sampling, the jitted step, `LLM`."""
