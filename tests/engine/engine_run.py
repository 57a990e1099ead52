"""Driving an LLMEngine to the end in tests that compare two engines' outputs."""


def tokens_and_logprobs(eng, prompts, params) -> list[tuple[list[int], list[dict]]]:
    """Adds request r<i> for each (prompt ids, SamplingParams), steps the engine until every request finishes, and
    returns per request (its output token ids, the logprob entries of all its tokens): `RequestOutput.logprobs`
    holds only each step's new tokens', so they are gathered over the steps."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    done, lps = {}, {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            lps[o.request_id] += o.logprobs or []
            if o.finished:
                done[o.request_id] = o
    return [(done[f"r{i}"].token_ids, lps[f"r{i}"]) for i in range(len(prompts))]
