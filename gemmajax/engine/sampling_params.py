"""Per-request sampling settings: the fields of API.md, vLLM's names and value ranges.

A plain mutable dataclass validated once in `__post_init__` (every error names the field, the allowed range
and the value given); `stop` is normalised to a list of strings and `stop_token_ids` to a list of ints so the
engine never branches on their types. Defaults follow API.md (greedy, 64 new tokens), not vLLM's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

MAX_LOGPROBS = 20
_F32_MAX = 3.4028234663852886e38   # the sampler works in float32: larger values would overflow to inf
_F32_TINY = 1.1754943508222875e-38


@dataclasses.dataclass
class SamplingParams:
    """How one request is decoded.

    Sampling order (vLLM's): allowed-token mask, repetition / frequency / presence penalties, then greedy
    argmax when `temperature == 0`, else temperature, min-p, top-k, top-p and a draw.

    Attributes:
      max_tokens: most new tokens to generate (>= 1).
      temperature: 0 = greedy; otherwise logits are divided by it.
      top_p: nucleus mass in (0, 1]; 1 = off.
      top_k: keep the k most likely tokens; 0 or -1 = off.
      min_p: drop tokens whose probability is below min_p x the top probability; 0 = off.
      seed: per-request seed; the same seed gives the same tokens whatever batch the request lands in.
      stop: strings that end generation (checked on the detokenized text by the runner).
      stop_token_ids: token ids that end generation (besides the model's EOS ids).
      ignore_eos: keep generating after the model's EOS ids (stop_token_ids still stop).
      presence_penalty, frequency_penalty: in [-2, 2], subtracted per generated-token occurrence (OpenAI).
      repetition_penalty: > 0; 1 = off; divides positive / multiplies negative logits of seen tokens.
      logprobs: None = none; k in 0..20 = the chosen token's logprob plus the k most likely tokens'.
      json_schema: constrain the output to this JSON schema (dict or JSON string).
      skip_special_tokens: drop special tokens from the detokenized text.
      grammar: internal: an llguidance grammar string (exclusive with json_schema).
      n: number of completions for the prompt (LLM.generate / LLM.chat and the server run n requests that share
        the prompt's KV pages through the prefix cache; LLMEngine.add_request takes n == 1).
      thinking_token_budget: the most tokens inside a thought channel (`<|channel>` ... `<channel|>`); at the
        budget the end-of-thought token is forced (and a grammar's answer part starts). None = no limit.
      min_tokens: stop tokens / EOS are suppressed until this many tokens were generated.
      include_stop_str_in_output: keep the matched stop string at the end of the text.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    json_schema: dict[str, Any] | str | None = None
    skip_special_tokens: bool = True
    grammar: str | None = None
    n: int = 1
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_float("temperature", self.temperature, lo=0.0, hi=_F32_MAX, what=">= 0 and finite in float32")
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True, what="in (0, 1]")
        _check_int("top_k", self.top_k, lo=-1, hi=2**31 - 1, what="in [-1, 2**31 - 1] (0 or -1 = off)")
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0, what="in [0, 1]")
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0, what="in [-2, 2]")
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0, what="in [-2, 2]")
        _check_float("repetition_penalty", self.repetition_penalty, lo=_F32_TINY, hi=_F32_MAX,
                     what="> 0 and a normal float32 (1 = off)")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        _check_int("n", self.n, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget, lo=0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**64 - 1)

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {s!r}")

        ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"SamplingParams.stop_token_ids must hold token ids (ints >= 0), got {t!r}")
        self.stop_token_ids = ids

        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str)):
            raise ValueError(
                f"SamplingParams.json_schema must be a dict or a JSON string, got {type(self.json_schema).__name__}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"SamplingParams.grammar must be a string, got {type(self.grammar).__name__}")
        if self.json_schema is not None and self.grammar is not None:
            raise ValueError("SamplingParams.json_schema and SamplingParams.grammar are exclusive; got both")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """True when any of the three penalties is switched on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None, what: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"SamplingParams.{name} must be an int, got {type(value).__name__} {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if what is None:
            what = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"SamplingParams.{name} must be {what}, got {value}")


def _check_float(name: str, value: Any, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False, what: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"SamplingParams.{name} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    bad = not math.isfinite(v)
    if lo is not None:
        bad |= v <= lo if lo_open else v < lo
    if hi is not None:
        bad |= v > hi
    if bad:
        raise ValueError(f"SamplingParams.{name} must be {what}, got {value}")
