"""Where a request's output stands in Gemma 4's thought channel, for the thinking budget and usage's
reasoning_tokens.

A thought is the tokens between `<|channel>` and `<channel|>` (gemma4-architecture.md section 7). The engine feeds
every sampled token to `ThoughtTracker.advance`; once a thought holds `budget` tokens, `must_close` asks the
sampler to force `<channel|>` (SamplingParams.thinking_token_budget, vLLM's name). A prompt that ends inside an
open channel (templates that open `<|channel>thought\\n` after a tool response) starts the output in the thought.
"""
from __future__ import annotations

OPEN = "<|channel>"
CLOSE = "<channel|>"
# Tags after which a prompt is no longer inside a channel.
_CLOSERS = (CLOSE, "<|turn>", "<turn|>", "<|tool_response>", "<tool_response|>")


class ThoughtTracker:
    """Thought-channel state of one request.

    Attributes:
      open_id, close_id: the `<|channel>` / `<channel|>` token ids.
      budget: the most tokens one thought may hold (None = unlimited).
      in_thought: the output is inside a channel now.
      count: tokens in the current thought.
      total: tokens inside thoughts so far (usage's completion_tokens_details.reasoning_tokens).
    """

    def __init__(self, open_id: int, close_id: int, budget: int | None, in_thought: bool = False) -> None:
        self.open_id, self.close_id, self.budget = open_id, close_id, budget
        self.in_thought = in_thought
        self.count = 0
        self.total = 0

    @classmethod
    def for_request(cls, tokenizer, prompt_ids: list[int], budget: int | None) -> ThoughtTracker | None:
        """A tracker for a tokenizer that has the channel tags (Gemma 4), else None."""
        if not hasattr(tokenizer, "piece_to_id") or OPEN not in tokenizer or CLOSE not in tokenizer:
            return None
        open_id, close_id = tokenizer.piece_to_id(OPEN), tokenizer.piece_to_id(CLOSE)
        closers = {tokenizer.piece_to_id(t) for t in _CLOSERS if t in tokenizer}
        in_thought = False
        for t in reversed(prompt_ids[-256:]):
            if t == open_id:
                in_thought = True
                break
            if t in closers:
                break
        return cls(open_id, close_id, budget, in_thought)

    def advance(self, token: int) -> None:
        if self.in_thought:
            if token == self.close_id:
                self.in_thought, self.count = False, 0
            else:
                self.count += 1
                self.total += 1
        elif token == self.open_id:
            self.in_thought, self.count = True, 0

    def must_close(self) -> bool:
        """The next token must be `<channel|>`: the thought reached its budget."""
        return self.in_thought and self.budget is not None and self.count >= self.budget

    def safe_to_look_ahead(self, n: int = 2) -> bool:
        """No token of the next n (n >= 2) can need forcing, whatever they are: greedy lookahead steps (sampled on
        the device before the host sees the tokens before them) may sample them. The first of them is the one whose
        forcing was already decided (the step on the device). In a thought of c tokens, the j-th is forced when
        c + j - 1 reaches the budget; outside one, a thought opened by the first has j - 2 tokens at the j-th."""
        if self.budget is None:
            return True
        return self.count + n - 1 < self.budget if self.in_thought else n - 2 < self.budget
