"""Deviceless TPU compiles (libtpu, no TPU) of the vision and audio encoders at the published sizes, for v5e:1x1
and v6e:1x1, through `gemmajax.aot.compile_encoders` (what `gemmajax aot` reports): one 280-token image for E2B's
and 31B's towers and the 12B's embedder, one 30 s clip (3,072 log-mel frames, 768 soft-token rows) for E2B's audio
tower, bf16 weights, batch 1. Mosaic / XLA's TPU compiler decides the program and its HBM use: the weights plus
temporaries fit a v5e's 16 GiB with room for the text model, and the compiled program is the encoder (its cost
analysis counts at least its matmul FLOPs). The byte figures are printed (pytest -s); measured 2026-12-01
(weights / temporaries, v5e and v6e): E2B vision 322 MiB / 29 and 23 MiB, 31B vision 1098 / 63 and 127 MiB, 12B
embedder 95 / 0 and 17 MiB, E2B audio 586 / 79 and 66 MiB."""
import pytest

from gemmajax import aot
from gemmajax.model import audio as au
from gemmajax.model import vision as vi
from gemmajax.model.multimodal import MultimodalConfig

pytest.importorskip("libtpu", reason="libtpu is needed for deviceless TPU compiles")

pytestmark = [pytest.mark.tpu_compile, pytest.mark.slow]   # about 10 min on 2 loaded cores: make test-slow
GiB = 1 << 30


@pytest.fixture(scope="module", params=["v5e", "v6e"])
def tpu(request):
    return aot.Target.create(request.param)   # a libtpu failure fails


def _compile(target, **towers):
    (enc,) = aot.compile_encoders(target, MultimodalConfig(**towers))
    assert enc.ok, enc.oom or enc.error
    return enc


def _check(name, target, enc, flops_at_least):
    print(f"{name} on {target.chip.name}: weights {enc.weight_bytes / 2**20:.0f} MiB, temporaries "
          f"{enc.temp_bytes / 2**20:.0f} MiB")
    assert enc.weight_bytes + enc.temp_bytes < 4 * GiB, (name, enc.weight_bytes, enc.temp_bytes)
    assert enc.flops >= flops_at_least, (name, enc.flops, flops_at_least)


@pytest.mark.parametrize("size", ["e2b", "31b"])
def test_vision_towers_compile(tpu, size):
    cfg = vi.VisionConfig.preset(size)
    enc = _compile(tpu, vision=cfg)
    T = 280 * cfg.pooling_kernel_size ** 2
    assert enc.input_shape == (1, T, cfg.patch_dim)
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    _check(f"vision {size}", tpu, enc, 2 * T * cfg.num_layers * mlp)


def test_unified_embedder_compiles(tpu):
    cfg = vi.UNIFIED_VISION_PRESETS["12b"]
    enc = _compile(tpu, vision=cfg)
    assert enc.input_shape == (1, 280, cfg.patch_dim)
    _check("unified vision 12b", tpu, enc, 2 * 280 * cfg.patch_dim * cfg.embed_dim)


def test_audio_tower_compiles(tpu):
    cfg = au.AudioConfig.preset("e2b")
    enc = _compile(tpu, audio=cfg)
    assert enc.input_shape == (1, 3072, 128) and enc.soft_tokens == 768
    _check("audio e2b", tpu, enc, 2 * 768 * cfg.text_hidden_size * cfg.output_proj_dims)
