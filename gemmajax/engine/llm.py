"""The offline API: `LLM(ckpt, ...)`, `.generate(prompts, params)`, `.chat(messages, params, tools, enable_thinking)`.

A thin driver over `LLMEngine`: it adds every request, steps until all are done, and returns results in the
order given. Chat renders with the checkpoint's chat template and parses Gemma 4 reasoning and tool calls.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence as Seq

from gemmajax.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from gemmajax.engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str               # "stop" | "length" (or "abort" / "error")
    logprobs: list[dict] | None = None
    stop_reason: Any = None
    error: str | None = None


@dataclass
class ChatOutput:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[dict]
    finish_reason: str               # "stop" | "length" | "tool_calls"
    text: str                        # the raw generated text (special tokens kept)
    token_ids: list[int]
    prompt_token_ids: list[int]


class LLM:
    """Offline batch generation on the serving engine (continuous batching, paged KV cache)."""

    def __init__(self, ckpt: str | None = None, quant: str = "none", kv_dtype: str = "bf16", dtype: str = "bfloat16",
                 max_model_len: int = 8192, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 page_size: int = 32, kv_cache_memory: int | None = None, enable_prefix_caching: bool = True,
                 attn_impl: str = "auto", seed: int = 0, tokenizer=None):
        from gemmajax.model.loader import load_model
        from gemmajax.tools.tokenizer import load_tokenizer
        _enable_compilation_cache()
        if ckpt is None:
            from gemmajax.model.gguf import default_model_path
            ckpt = default_model_path()
        self.model = load_model(ckpt, dtype=dtype, quant=quant)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(ckpt)
        self.ckpt = ckpt
        cfg = self.model.config
        if kv_cache_memory is None:
            kv_cache_memory = _default_kv_memory()
        self.engine = LLMEngine(cfg, self.model.weights, self.tokenizer, EngineConfig(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            page_size=page_size, kv_dtype=kv_dtype, kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching, attn_impl=attn_impl, seed=seed))
        self._ids = itertools.count()
        self._template = None

    @property
    def config(self):
        return self.model.config

    # ------------------------------------------------------------------ generate
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        """prompts: str | list[str] | list[list[int]]; params: one SamplingParams or one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: got {len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [self._encode(p) for p in prompts]
        finals = self._run(ids, plist)
        return [CompletionOutput(o.prompt_token_ids, o.token_ids, o.text, o.finish_reason, o.logprobs,
                                 o.stop_reason, o.error) for o in finals]

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=True)
        return [int(t) for t in prompt]

    def _run(self, ids: list[list[int]], plist: list[SamplingParams]) -> list[RequestOutput]:
        rids = []
        for toks, p in zip(ids, plist):
            rid = f"llm-{next(self._ids)}"
            rids.append(rid)
            self.engine.add_request(rid, toks, p)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(rids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in rids]

    # ------------------------------------------------------------------ chat
    def chat_template(self):
        if self._template is None:
            from gemmajax.tools.chat_template import ChatTemplate
            cfg = self.model.config
            size = "small" if cfg.ple_dim else "large"   # E2B/E4B templates add no empty thought block
            self._template = ChatTemplate.from_checkpoint(self.ckpt, getattr(self.tokenizer, "family", cfg.family),
                                                          size)
        return self._template

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, enable_thinking: bool = False,
                    add_generation_prompt: bool = True, **kwargs) -> list[int]:
        text = self.chat_template().render(messages, tools=tools, enable_thinking=enable_thinking,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
        return self.tokenizer.encode(text, add_bos=False)

    def chat(self, messages, params: SamplingParams | list[SamplingParams] | None = None, tools=None,
             enable_thinking: bool = False) -> list[ChatOutput]:
        """messages: one OpenAI-style message list, or a list of them. One ChatOutput per conversation."""
        import dataclasses
        from gemmajax.tools.parser import parse_gemma4
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(convs)
        gemma4 = getattr(self.tokenizer, "family", "gemma4") == "gemma4"
        ids, adj = [], []
        for conv, p in zip(convs, plist):
            ids.append(self.render_chat(conv, tools=tools, enable_thinking=enable_thinking))
            changes = {}
            if gemma4 and (tools or enable_thinking):
                changes["skip_special_tokens"] = False  # the parser needs <|tool_call>, <|channel> (vLLM #45832)
            if p.json_schema is not None and p.grammar is None:
                from gemmajax.tools.constrained import json_schema_grammar, thinking_then
                g = json_schema_grammar(p.json_schema)
                changes["grammar"] = thinking_then(g) if enable_thinking else g
            adj.append(dataclasses.replace(p, **changes) if changes else p)
        outs = self._run(ids, adj)
        results = []
        for o in outs:
            if gemma4:
                msg = parse_gemma4(o.text, reasoning=enable_thinking)
                content, reasoning, calls = msg.content, msg.reasoning_content, msg.tool_calls
            else:
                content, reasoning, calls = o.text, None, []
            reason = "tool_calls" if calls else o.finish_reason
            results.append(ChatOutput(content, reasoning, calls, reason, o.text, o.token_ids, o.prompt_token_ids))
        return results


def _default_kv_memory() -> int:
    """KV budget when none is given: 2 GiB on the CPU; on an accelerator, 60% of free device memory."""
    import jax
    dev = jax.devices()[0]
    try:
        st = dev.memory_stats() or {}
        if dev.platform != "cpu" and st.get("bytes_limit"):
            return int(0.6 * (st["bytes_limit"] - st.get("bytes_in_use", 0)))
    except Exception:  # noqa: BLE001 — some backends have no memory_stats
        pass
    return 2 << 30


def _enable_compilation_cache() -> None:
    """Persistent XLA compilation cache ($GEMMAJAX_CACHE/jax, default ~/.cache/gemmajax/jax): a restarted server
    or a second `gemmajax generate` skips recompiling the step programs."""
    import os
    import jax
    if jax.config.jax_compilation_cache_dir:
        return
    d = os.path.join(os.path.expanduser(os.environ.get("GEMMAJAX_CACHE", "~/.cache/gemmajax")), "jax")
    try:
        os.makedirs(d, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", d)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    except Exception:  # noqa: BLE001 — a read-only home only loses the cache
        pass
