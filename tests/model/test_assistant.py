"""The Gemma 4 drafter (gemmajax/model/assistant.py) against Hugging Face's Gemma4AssistantForCausalLM.

HF's drafter forward is called directly, step by step, with the untrimmed K/V of exactly the positions before the
drafted token (tests/golden/hf_assistant.py), never through HF's generate (which hands it a trimmed sliding buffer
and rejected drafts' K/V). Lengths 6, 13 and 21 put the sliding window (8, so 9 positions seen) at, inside and
well past the start of the sequence.
"""
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemmajax
from gemmajax.config import ConfigError
from gemmajax.kv.attention import make_ragged_meta, ragged_paged_attention
from gemmajax.kv.layout import KVLayout, write_kv
from gemmajax.model import CheckpointError, gemma
from gemmajax.model import assistant as A
from gemmajax.model.safetensors_io import index_checkpoint, load_tensor, save_file
from tests.golden.hf_assistant import (
    SINKS,
    build_agreeing_pair,
    build_assistant,
    build_target,
    hf_draft,
    hf_target_state,
)
from tests.golden.hf_models import save_text_checkpoint

LENGTHS = (6, 13, 21)
STEPS = 4
KINDS = {"sliding": "sliding_attention", "full": "full_attention"}


@functools.partial(jax.jit, static_argnames="cfg")
def _target_forward(w, cfg, ids):
    """gemmajax's target over ids [B, T] at positions 0..T-1: (final-normed hidden [B, T, D], DenseKVCache)."""
    B, T = ids.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    full = jnp.full((B,), T, jnp.int32)

    def attend(spec, q, k, v, slot):
        kv = slot if k is None else (k, v)
        return gemma.dense_attention(q, *kv, positions, full, spec, cfg.attn_scale, None), kv

    cache = gemma.init_dense_cache(cfg, B, T, jnp.float32)
    h, kv = gemma.decoder(w, cfg, ids, positions, attend, tuple(zip(cache.k, cache.v)))
    return h, gemma.DenseKVCache(k=tuple(a for a, _ in kv), v=tuple(b for _, b in kv), lengths=full)


_draft_step = jax.jit(A.draft_step, static_argnames=("acfg",))


def _load_pair(tmp_path, target, tcfg, drafter):
    drafter.save_pretrained(str(tmp_path / "drafter"))
    acfg, aw = A.load_assistant(str(tmp_path / "drafter"))
    model = gemmajax.load_model(save_text_checkpoint(target, tcfg, str(tmp_path / "target")), dtype="float32")
    return acfg, aw, model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """pair(variant, ordered) -> (target, its config dict, HF drafter, AssistantConfig, AssistantWeights, gemmajax
    target Model), built once per module."""
    built = {}

    def get(variant, ordered):
        if (variant, ordered) not in built:
            target, tcfg = build_target(variant, seed=0)
            drafter, _ = build_assistant(tcfg, seed=1, ordered=ordered)
            acfg, aw, model = _load_pair(tmp_path_factory.mktemp(f"{variant}-{ordered}"), target, tcfg, drafter)
            built[variant, ordered] = target, tcfg, drafter, acfg, aw, model
        return built[variant, ordered]
    return get


def _hf_kv(states, ps, S, rng):
    """HF's hidden at p - 1 [B, D] and its shared_kv_states as a TargetKV, rows padded to S with garbage."""
    hiddens, k, v = [], {kind: [] for kind in KINDS}, {kind: [] for kind in KINDS}
    for (h, kv), p in zip(states, ps):
        hiddens.append(h[0, 0].numpy())
        for kind, hf_kind in KINDS.items():
            for dst, t in zip((k, v), kv[hf_kind]):
                a = t[0].transpose(0, 1).numpy()                              # [p, K, H]
                pad = rng.standard_normal((S - p, *a.shape[1:])).astype(np.float32) * 100  # must not leak in
                dst[kind].append(np.concatenate([a, pad]))
    tkv = A.TargetKV(k={kind: jnp.asarray(np.stack(x)) for kind, x in k.items()},
                     v={kind: jnp.asarray(np.stack(x)) for kind, x in v.items()}, lengths=jnp.asarray(ps, jnp.int32))
    return jnp.asarray(np.stack(hiddens)), tkv


@pytest.mark.parametrize("variant,ordered", [("e2b", True), ("31b", False), ("12b", True)])
def test_drafts_match_hf(variant, ordered, pair):
    """Drafted tokens, every step's logits and the first step's projected hidden equal HF's, fed (a) HF's own
    target state and (b) gemmajax's target through TargetKV.from_dense_cache (which picks the layers: E2B-like
    5 sliding / 4 full, 31B-like and 12B-like 4 / 5)."""
    target, tcfg, drafter, acfg, aw, model = pair(variant, ordered)
    assert acfg.model_type == ("gemma4_unified_assistant" if variant == "12b" else "gemma4_assistant")
    assert A.target_layers(acfg, model.config) == ({"sliding": 5, "full": 4} if variant == "e2b" else
                                                   {"sliding": 4, "full": 5})
    rng = np.random.default_rng(0)
    S = max(LENGTHS)
    ids = rng.integers(3, tcfg["vocab_size"], size=(len(LENGTHS), S + 1))
    ids[:, 0] = 2
    ps = np.asarray(LENGTHS)
    tok0 = jnp.asarray(ids[np.arange(len(ps)), ps], jnp.int32)                # the token at position p

    states = [hf_target_state(target, row[:p]) for row, p in zip(ids, ps)]
    ref = [hf_draft(drafter, target, row[:p], int(row[p]), STEPS, st) for row, p, st in zip(ids, ps, states)]
    ref_toks = np.asarray([r[0] for r in ref])                                # [B, STEPS]
    ref_logits = np.stack([r[1] for r in ref])                                # [B, STEPS, V]
    ref_hidden = np.stack([r[2][0] for r in ref])                             # [B, D_t] after step 1
    assert len(set(ref_toks.ravel())) >= 6, ref_toks                          # the drafts are not one token

    hf_hidden, hf_kv = _hf_kv(states, ps, S, rng)
    h, cache = _target_forward(model.weights, model.config, jnp.asarray(ids[:, :S], jnp.int32))
    ours_kv = A.TargetKV.from_dense_cache(acfg, model.config, cache, lengths=jnp.asarray(ps, jnp.int32))
    ours_hidden = h[np.arange(len(ps)), ps - 1]
    for source, hidden, tkv in (("hf", hf_hidden, hf_kv), ("gemmajax", ours_hidden, ours_kv)):
        toks, logits = A.draft_greedy_dense(aw, acfg, model.weights.embed, hidden, tok0, jnp.asarray(ps), tkv, STEPS,
                                            return_logits=True)
        toks, logits = np.asarray(toks), np.asarray(logits)
        np.testing.assert_array_equal(toks, ref_toks, err_msg=f"{source} target state")
        for b in range(len(ps)):
            err = np.abs(logits[b] - ref_logits[b]).max()
            assert err <= 2e-4 * np.abs(ref_logits[b]).max(), (source, ps[b], err, np.abs(ref_logits[b]).max())
        _, nxt = _draft_step(aw, acfg, model.weights.embed, hidden, tok0, jnp.asarray(ps), tkv.by_kind())
        err = np.abs(np.asarray(nxt) - ref_hidden).max()
        assert err <= 2e-4 * np.abs(ref_hidden).max(), (source, err)
        if ordered:  # exactly top_k * V / C tokens get a logit; every other one holds the row's minimum
            V, J = acfg.text.vocab_size, acfg.centroid_top_k * acfg.tokens_per_centroid
            assert J < V
            np.testing.assert_array_equal((logits == logits.min(-1, keepdims=True)).sum(-1), V - J)


def test_paged_read_only_attention_is_the_documented_interface(pair):
    """The engine's path: a read-only ragged_paged_attention (k = v = None, one query per row, kv_lens = p, the
    drafter LayerSpec's window W + 1) over paged target K/V gives the dense drafts. Every slot the drafter must
    not read (positions >= p, and sliding positions before p - 1 - W) holds NaN, so reading one fails the test."""
    _, tcfg, _, acfg, aw, model = pair("e2b", True)
    cfg = model.config
    rng = np.random.default_rng(1)
    S = max(LENGTHS)
    ids = jnp.asarray(rng.integers(3, tcfg["vocab_size"], size=(len(LENGTHS), S + 1)), jnp.int32)
    ps = np.asarray(LENGTHS)
    h, cache = _target_forward(model.weights, cfg, ids[:, :S])
    hidden, tok0, pos = h[np.arange(len(ps)), ps - 1], ids[np.arange(len(ps)), ps], jnp.asarray(ps)
    dense = A.TargetKV.from_dense_cache(acfg, cfg, cache, lengths=jnp.asarray(ps, jnp.int32))
    want_t, want_l = A.draft_greedy_dense(aw, acfg, model.weights.embed, hidden, tok0, pos, dense, STEPS,
                                          return_logits=True)

    page_size, W = 4, acfg.sliding_window
    n_pages = -(-S // page_size)
    pages, metas = {}, {}
    perm = rng.permutation(len(ps) * n_pages) + 1                              # scattered pages; page 0 is null
    tables = [list(perm[b * n_pages:(b + 1) * n_pages]) for b in range(len(ps))]
    for kind, li in A.target_layers(acfg, cfg).items():
        spec = cfg.layers[li]
        lay = KVLayout(page_size=page_size, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype="float32")
        pool = jnp.full(lay.shape(len(perm) + 1), jnp.nan, jnp.float32)
        for b, p in enumerate(ps):
            lo = max(0, p - 1 - W) if kind == "sliding" else 0
            keep = np.arange(lo, p)
            slots = jnp.asarray(KVLayout.slots(np.asarray(tables[b]), keep, page_size), jnp.int32)
            pool = write_kv(pool, dense.k[kind][b, keep], dense.v[kind][b, keep], slots)
        pages[kind] = pool
        meta = make_ragged_meta([1] * len(ps), ps, tables, max_num_seqs=len(ps), pages_per_seq=n_pages)
        metas[kind] = dataclasses.replace(meta, decode_only=True)      # one query per sequence, as in decode steps

    def attend(spec, q, k, v, pool):                       # what the engine's runner does for KV-shared layers
        assert k is None and v is None
        out, _ = ragged_paged_attention(q[:, 0], None, None, pool, metas[spec.kind], sliding_window=spec.window,
                                        impl="ref")
        return out[:, None], pool

    got_t, got_l = jax.jit(lambda aw, pages: A.draft_greedy(aw, acfg, model.weights.embed, hidden, tok0, pos, pages,
                                                            STEPS, attend=attend, return_logits=True))(aw, pages)
    assert np.isfinite(np.asarray(got_l)).all()
    np.testing.assert_array_equal(np.asarray(got_t), np.asarray(want_t))
    assert np.abs(np.asarray(got_l) - np.asarray(want_l)).max() <= 2e-5 * np.abs(np.asarray(want_l)).max()


def test_drafts_agree_with_target(tmp_path):
    """A drafter built to agree with its target (tests/golden/hf_assistant.py: a sink head makes the next token a
    function of the current and the first token, and the drafter copies the target's layers) drafts exactly the
    target's greedy continuation, from every state of it. Two prompts differing only in their first token give
    different continuations and the same drafter follows each: only the target's K/V tells them apart."""
    target, tcfg, drafter, _ = build_agreeing_pair()
    acfg, aw, model = _load_pair(tmp_path, target, tcfg, drafter)
    rng = np.random.default_rng(0)
    P0, N = 10, 24
    prompt = rng.integers(max(SINKS) + 1, tcfg["vocab_size"], size=P0)
    ps = np.arange(P0, P0 + N - STEPS)                     # one drafting round from every state of the continuation
    B = len(ps)

    def tile(a):                                           # the same sequence, one row per round
        return jnp.broadcast_to(a, (B, *a.shape[1:]))

    conts, kvs = [], []
    for first in SINKS[:2]:
        seq = np.zeros(P0 + N, np.int64)
        seq[:P0], seq[0] = prompt, first
        for i in range(P0, P0 + N):                        # greedy continuation (causal: pad, read row i - 1)
            seq[i] = int(model.logits(seq[None])[0, i - 1].argmax())
        assert len(set(seq[P0:])) >= 16 and not set(seq[P0:]) & set(SINKS), seq[P0:]
        h, cache = _target_forward(model.weights, model.config, jnp.asarray(seq[None], jnp.int32))
        rows = gemma.DenseKVCache(k=tuple(map(tile, cache.k)), v=tuple(map(tile, cache.v)),
                                  lengths=jnp.asarray(ps, jnp.int32))
        kvs.append(A.TargetKV.from_dense_cache(acfg, model.config, rows))
        drafts = A.draft_greedy_dense(aw, acfg, model.weights.embed, h[0, ps - 1], jnp.asarray(seq[ps], jnp.int32),
                                      jnp.asarray(ps), kvs[-1], STEPS)
        np.testing.assert_array_equal(np.asarray(drafts), np.stack([seq[p + 1:p + 1 + STEPS] for p in ps]))
        conts.append(seq[P0:])
    assert (conts[0] != conts[1]).mean() > 0.5


# ---------------------------------------------------------------------------- config and loading

def _saved(tmp_path, **kw):
    """A 31B-like drafter saved by transformers: (path, its config.json dict, the target's config, drafter)."""
    _, tcfg = build_target("31b", seed=0)
    drafter, _ = build_assistant(tcfg, seed=1, **kw)
    path = str(tmp_path / "d")
    drafter.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        return path, json.load(f), tcfg, drafter


def test_config_both_dialects_and_geometry(tmp_path):
    """HF's saved config (per_layer_config) and the released dialect (global_head_dim /
    num_global_key_value_heads) give the same drafter; its layers are Q-only, sliding ones with window W + 1,
    and param_shapes is exactly the checkpoint's tensors (tied lm_head left out)."""
    path, hf, tcfg, drafter = _saved(tmp_path, ordered=True)
    acfg = A.AssistantConfig.from_hf(hf)
    released = json.loads(json.dumps(hf))
    text = released["text_config"]
    full = text["layer_types"].index("full_attention")
    over = text.pop("per_layer_config")[str(full)]
    text.update(global_head_dim=over["head_dim"], num_global_key_value_heads=over["num_key_value_heads"],
                num_kv_shared_layers=0)
    assert A.AssistantConfig.from_hf(released).text.layers == acfg.text.layers
    assert all(not s.owns_kv for s in acfg.text.layers)
    assert acfg.sliding_window == tcfg["sliding_window"] == 8
    assert [s.window for s in acfg.text.layers] == [9, None, 9, None]
    assert [(s.head_dim, s.num_kv_heads) for s in acfg.text.layers] == [(32, 2), (64, 1), (32, 2), (64, 1)]
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items() if k != "lm_head.weight"}
    assert acfg.param_shapes() == shapes
    assert acfg.param_shapes() == {k: i.shape for k, i in index_checkpoint(path).items()}
    aw = A.abstract_assistant_weights(acfg)
    assert aw.token_ordering.shape == (512,) and aw.text.layers[0].attn.k_proj is None


@pytest.mark.parametrize("field,value,needle", [
    ("num_kv_shared_layers", 2, "num_kv_shared_layers"),
    ("hidden_size_per_layer_input", 16, "hidden_size_per_layer_input"),
    ("enable_moe_block", True, "enable_moe_block"),
])
def test_config_rejects_what_hf_rejects(tmp_path, field, value, needle):
    _, hf, _, _ = _saved(tmp_path)
    hf["text_config"][field] = value
    with pytest.raises(ConfigError, match=needle):
        A.AssistantConfig.from_hf(hf)
    with pytest.raises(ConfigError, match="not a drafter"):
        A.AssistantConfig.from_hf({**hf, "model_type": "gemma4"})


def test_checkpoint_errors_name_every_tensor(tmp_path):
    path, _, _, _ = _saved(tmp_path, ordered=True)
    infos = index_checkpoint(path)
    sd = {k: np.asarray(load_tensor(i)) for k, i in infos.items()}
    sd.pop("masked_embedding.centroids.weight")
    sd["post_projection.weight"] = sd["post_projection.weight"][:, :-1]
    sd["extra.weight"] = np.zeros((2,), np.float32)
    os.remove(os.path.join(path, "model.safetensors"))
    save_file(sd, os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        A.load_assistant(path)
    msg = str(e.value)
    assert "missing tensor masked_embedding.centroids.weight" in msg
    assert "wrong shape post_projection.weight: expected (64, 32), found (64, 31)" in msg
    assert "unexpected tensor extra.weight" in msg


def test_target_mismatch_is_an_error(tmp_path):
    _, hf, _, _ = _saved(tmp_path)
    acfg = A.AssistantConfig.from_hf(hf)
    other = gemmajax.ModelConfig.from_hf(build_target("e2b", seed=0)[1])   # 1 KV head on sliding layers, not 2
    with pytest.raises(ConfigError, match="KV heads"):
        A.target_layers(acfg, other)
    with pytest.raises(ConfigError, match="backbone_hidden_size"):
        A.target_layers(A.AssistantConfig.from_hf({**hf, "backbone_hidden_size": 48}), other)
