"""The offline API: `LLM(ckpt, ...)`, `.generate(prompts, params)`, `.chat(messages, params, tools, enable_thinking)`.

A thin driver over `LLMEngine`: it adds every request, steps until all are done, and returns results in the
order given. Chat renders with the checkpoint's chat template and parses Gemma 4 reasoning and tool calls.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

from gemmajax.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from gemmajax.engine.runner import LayerStack, unstack_layers
from gemmajax.engine.sampling_params import SamplingParams
from gemmajax.engine.spec_decode import SpecConfig
from gemmajax.model.gemma import unfuse_projections
from gemmajax.model.loader import Model
from gemmajax.quant.array import int4_halves_tree


class _ServedModel(Model):
    """`LLM.model` once its engine holds the weights in its own form (runner.stack_layers, on XLA:CPU), so that the
    process keeps one copy of them. `.weights` is the standard tree (int4 in half-split bytes), rebuilt from the
    engine's at each access (the stacked leaves copied out per layer, fused projections split, int4 words repacked:
    read it once and keep it); `.engine_weights` is the engine's form."""

    def __init__(self, model: Model, engine: LLMEngine):   # not Model.__init__: it assigns .weights
        self.config, self.dtype, self.path, self.quant = model.config, model.dtype, model.path, model.quant
        self._engine = engine

    @property
    def engine_weights(self):
        return self._engine.runner.weights

    @property
    def weights(self):
        return int4_halves_tree(unfuse_projections(unstack_layers(self._engine.runner.weights), self.config))


@dataclass
class CompletionOutput:
    """One prompt's result. With SamplingParams.n > 1, `outputs` holds the n completions (each with these fields)
    and the fields above it are those of the first; with n == 1, `outputs` is [self]."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str               # "stop" | "length" (or "abort" / "error")
    logprobs: list[dict] | None = None
    stop_reason: Any = None
    error: str | None = None
    index: int = 0                   # which of the n completions
    outputs: list["CompletionOutput"] = field(default_factory=list, repr=False)


@dataclass
class ChatOutput:
    """One conversation's answer, parsed; `outputs` as in CompletionOutput (n choices)."""

    content: str | None
    reasoning_content: str | None
    tool_calls: list[dict]
    finish_reason: str               # "stop" | "length" | "tool_calls"
    text: str                        # the raw generated text (special tokens kept)
    token_ids: list[int]
    prompt_token_ids: list[int]
    index: int = 0
    num_reasoning_tokens: int = 0
    outputs: list["ChatOutput"] = field(default_factory=list, repr=False)


class LLM:
    """Offline batch generation on the serving engine (continuous batching, paged KV cache)."""

    def __init__(self, ckpt: str | None = None, quant: str = "none", kv_dtype: str = "auto", dtype: str = "bfloat16",
                 max_model_len: int = 8192, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 page_size: int = 32, kv_cache_memory: int | None = None, enable_prefix_caching: bool = True,
                 attn_impl: str = "auto", seed: int = 0, tokenizer=None, speculative_config: dict | None = None,
                 token_buckets: tuple[int, ...] | None = None, seq_buckets: tuple[int, ...] | None = None,
                 tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
                 num_scheduler_steps: int = EngineConfig.num_scheduler_steps):
        """token_buckets / seq_buckets: the step shapes compiled for (EngineConfig's; default: the engine's
        ladders). Fewer buckets, fewer compiles: tests pin them.

        num_scheduler_steps: greedy decode steps one device program may run once every sequence is decoding
        (EngineConfig's; vLLM's name): the host schedules and reads tokens once per program. 1 = one step each.

        tensor_parallel_size N > 1: the weights are split over the first N devices (gemmajax/parallel.py: heads,
        MLP columns / rows, vocabulary) and the KV pages by KV head; kv_cache_memory is then per device.
        enable_expert_parallel: a MoE model's experts are split over those devices (whole experts each) instead
        of along their MLP width. Across hosts, call `gemmajax.parallel.init_distributed` first; every process
        then builds the same LLM and makes the same generate calls."""
        import jax

        from gemmajax.model.loader import load_model
        from gemmajax.tools.tokenizer import load_tokenizer
        _enable_compilation_cache()
        if ckpt is None:
            from gemmajax.model.gguf import default_model_path
            ckpt = default_model_path()
        self.model = load_model(ckpt, dtype=dtype, quant=quant)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(ckpt)
        self.mm_config, mm_weights = _load_towers(ckpt, dtype, self.model.quant)
        self.ckpt = ckpt
        cfg = self.model.config
        if kv_cache_memory is None:
            kv_cache_memory = _default_kv_memory()
        # ---- tensor / expert parallelism (gemmajax/parallel.py): place the weights, size the cache per device
        self.plan = _shard_plan(cfg, tensor_parallel_size, enable_expert_parallel, speculative_config)
        if self.plan is not None:
            self.model.weights = self.plan.place(self.model.weights)
            mm_weights = None if mm_weights is None else self.plan.replicate(mm_weights)
            kv_cache_memory = int(kv_cache_memory / self.plan.kv_device_fraction())
        if jax.process_count() > 1:            # every host must plan the same cache (the same programs)
            from gemmajax.parallel import agree_min
            kv_cache_memory = agree_min(kv_cache_memory)
        self.engine = LLMEngine(cfg, self.model.weights, self.tokenizer, EngineConfig(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            page_size=page_size, kv_dtype=kv_dtype, kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching, attn_impl=attn_impl, seed=seed,
            speculative=SpecConfig.parse(speculative_config), token_buckets=token_buckets, seq_buckets=seq_buckets,
            parallel=self.plan, num_scheduler_steps=num_scheduler_steps),
            multimodal=None if self.mm_config is None else (self.mm_config, mm_weights))
        if isinstance(self.engine.runner.weights.layers, LayerStack):   # one copy held: the engine's
            self.model = _ServedModel(self.model, self.engine)
        self._ids = itertools.count()
        self._template = None

    @property
    def config(self):
        return self.model.config

    def spec_decode_stats(self) -> dict[str, int]:
        """Cumulative speculative-decoding counts: {"num_drafts", "num_draft_tokens", "num_accepted_tokens"}."""
        return self.engine.spec_decode_stats()

    # ------------------------------------------------------------------ generate
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        """prompts: str | list[str] | list[list[int]]; params: one SamplingParams or one per prompt.
        One CompletionOutput per prompt, in order (n completions in its `outputs`)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        plist = self._params_list(params, len(prompts), "prompts")
        groups = self._run([self._encode(p) for p in prompts], plist)
        results = []
        for group in groups:
            outs = [CompletionOutput(o.prompt_token_ids, o.token_ids, o.text, o.finish_reason, o.logprobs,
                                     o.stop_reason, o.error, index=j) for j, o in enumerate(group)]
            for o in outs:
                o.outputs = [o]
            outs[0].outputs = outs
            results.append(outs[0])
        return results

    @staticmethod
    def _params_list(params, n: int, what: str) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * n
        if len(plist) != n:
            raise ValueError(f"params: got {len(plist)} SamplingParams for {n} {what}")
        return plist

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=True)
        return [int(t) for t in prompt]

    def _run(self, ids: list[list[int]], plist: list[SamplingParams], media: list | None = None
             ) -> list[list[RequestOutput]]:
        """Run every prompt's n completions; per prompt, its n final outputs in choice order. Choice j > 0 of a
        prompt waits for choice 0's prompt pages (prefix cache) and, when seeded, uses seed + j (as the server).
        media: per prompt, its processed images / audio (or None)."""
        groups = []
        for k, (toks, p) in enumerate(zip(ids, plist)):
            base = f"llm-{next(self._ids)}"
            rids = []
            for j in range(p.n):
                one = dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + j)
                rid = base if p.n == 1 else f"{base}.{j}"
                self.engine.add_request(rid, toks, one, after=rids[0] if rids else None,
                                        media=media[k] if media else None)
                rids.append(rid)
            groups.append(rids)
        final: dict[str, RequestOutput] = {}
        logprobs: dict[str, list[dict]] = {}   # an output's logprobs are those of its new tokens: gather them
        want = sum(len(g) for g in groups)
        while len(final) < want:
            for out in self.engine.step():
                if out.logprobs:
                    logprobs.setdefault(out.request_id, []).extend(out.logprobs)
                if out.finished:
                    final[out.request_id] = dataclasses.replace(out, logprobs=logprobs.pop(out.request_id, None))
        return [[final[r] for r in g] for g in groups]

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
        """Prompt ids of a text conversation (media parts: see `chat_prompt`)."""
        return self.chat_prompt(messages, tools, enable_thinking, add_generation_prompt, **kwargs)[0]

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None, enable_thinking: bool = False,
                    add_generation_prompt: bool = True, **kwargs) -> tuple[list[int], list]:
        """(prompt ids, processed media in prompt order) of a conversation: image_url / input_audio parts are
        decoded and processed (engine/chat.py prepare_media), rendered as placeholders and expanded to their soft
        tokens, as HF's processor does."""
        from gemmajax.engine.chat import expand_media_prompt, prepare_media
        messages, items = prepare_media(messages, self.mm_config)
        text = self.chat_template().render(messages, tools=tools, enable_thinking=enable_thinking,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
        if items:
            text = expand_media_prompt(text, items)
        return self.tokenizer.encode(text, add_bos=False), items

    def chat(self, messages, params: SamplingParams | list[SamplingParams] | None = None, tools=None,
             enable_thinking: bool = False, tool_choice: Any = "auto", parallel_tool_calls: bool = True
             ) -> list[ChatOutput]:
        """messages: one OpenAI-style message list, or a list of them. One ChatOutput per conversation.

        The same rules as the server's /v1/chat/completions (gemmajax/engine/chat.py): SamplingParams.json_schema
        and tool_choice "required" / a named function are enforced by a grammar (behind a free thought channel
        when thinking is on, closed at thinking_token_budget or half of max_tokens), reasoning and tool calls are
        parsed from the Gemma 4 output."""
        from gemmajax.engine.chat import chat_finish_reason, chat_grammar, chat_params
        from gemmajax.engine.thinking import ThoughtTracker
        from gemmajax.tools.parser import parse_gemma4
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        plist = self._params_list(params, len(convs), "conversations")
        gemma4 = getattr(self.tokenizer, "family", "gemma4") == "gemma4"
        tools_active = bool(tools) and tool_choice != "none"
        ids, adj, media = [], [], []
        for conv, p in zip(convs, plist):
            prompt, items = self.chat_prompt(conv, tools=tools if tools_active else None,
                                             enable_thinking=enable_thinking)
            ids.append(prompt)
            media.append(items)
            grammar = p.grammar
            if grammar is None:
                grammar, _ = chat_grammar(json_schema=p.json_schema, tools=tools, tool_choice=tool_choice,
                                          parallel_tool_calls=parallel_tool_calls, thinking=enable_thinking)
            adj.append(chat_params(p, gemma4=gemma4, parse=tools_active or enable_thinking,
                                   thinking=enable_thinking, grammar=grammar))
        results = []
        for prompt, group in zip(ids, self._run(ids, adj, media)):
            tracker = ThoughtTracker.for_request(self.tokenizer, prompt, None)
            in_reasoning = enable_thinking and tracker is not None and tracker.in_thought
            outs = []
            for j, o in enumerate(group):
                if gemma4:
                    msg = parse_gemma4(o.text, reasoning=enable_thinking, prompt_in_reasoning=in_reasoning)
                    content, reasoning, calls = msg.content, msg.reasoning_content, msg.tool_calls
                    if not parallel_tool_calls:
                        calls = calls[:1]
                else:
                    content, reasoning, calls = o.text, None, []
                outs.append(ChatOutput(content, reasoning, calls, chat_finish_reason(o.finish_reason, bool(calls)),
                                       o.text, o.token_ids, o.prompt_token_ids, j, o.num_reasoning_tokens))
            for o in outs:
                o.outputs = [o]
            outs[0].outputs = outs
            results.append(outs[0])
        return results


def _shard_plan(cfg, tensor_parallel_size: int, enable_expert_parallel: bool, speculative_config):
    """The ShardPlan for LLM(tensor_parallel_size=..., enable_expert_parallel=...), or None on one device."""
    import logging
    if int(tensor_parallel_size) < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if enable_expert_parallel and not cfg.enable_moe:
        raise ValueError(f"enable_expert_parallel=True: model {cfg.name or cfg.model_type} has no experts "
                         f"(num_experts=0); drop the flag")
    if int(tensor_parallel_size) == 1:
        if enable_expert_parallel:
            logging.getLogger(__name__).info("enable_expert_parallel with tensor_parallel_size=1: one device holds "
                                             "every expert; nothing to split")
        return None
    if speculative_config and "model" in speculative_config:
        raise ValueError("speculative_config with a draft model is not supported with tensor_parallel_size > 1 "
                         "(the drafter is not sharded); use {'method': 'ngram', ...} or tensor_parallel_size=1")
    from gemmajax.parallel import ShardPlan
    return ShardPlan.create(cfg, int(tensor_parallel_size), bool(enable_expert_parallel))


def _load_towers(ckpt, dtype: str, quant: str):
    """The checkpoint's vision / audio towers (model/multimodal.py): (MultimodalConfig, MultimodalWeights), or
    (None, None) for a text-only checkpoint, a GGUF or a converted directory (which hold none)."""
    import json
    import os
    path = os.path.join(os.fspath(ckpt), "config.json")
    if not os.path.isfile(path) or os.path.exists(os.path.join(os.fspath(ckpt), "gemmajax.json")):
        return None, None
    from gemmajax.model.multimodal import MultimodalConfig, load_multimodal
    with open(path) as f:
        hf = json.load(f)
    if str(hf.get("model_type", "")).startswith("gemma3"):   # Gemma 3: its text decoder only (no tower support)
        return None, None
    if not MultimodalConfig.from_hf(hf).param_shapes():
        return None, None
    scheme = (quant or "none").split("+")[0]
    return load_multimodal(ckpt, dtype=dtype, quant=scheme)


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


def _enable_compilation_cache(name: str = "jax") -> None:
    """Persistent XLA compilation cache ($GEMMAJAX_CACHE/<name>, default ~/.cache/gemmajax/jax): a restarted server
    or a second `gemmajax generate` skips recompiling the step programs. Nothing changes if one is already set."""
    import os
    import jax

    from gemmajax.model.gguf import DEFAULT_CACHE
    if jax.config.jax_compilation_cache_dir:
        return
    d = os.path.join(os.path.expanduser(os.environ.get("GEMMAJAX_CACHE", DEFAULT_CACHE)), name)
    try:
        os.makedirs(d, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", d)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    except Exception:  # noqa: BLE001 — a read-only home only loses the cache
        pass
