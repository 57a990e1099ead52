"""gemmajax.tools.media against HF's Gemma 4 processors (transformers 5.24, PIL image backend): pixel values,
patch positions, log-mel features and masks equal bit for bit; prompt ids with expanded placeholders equal."""
from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from gemmajax.tools import media
from tests.golden import hf_multimodal as hm

PIL = pytest.importorskip("PIL")
from PIL import Image

RNG = np.random.default_rng(0)


def _image(h, w, mode, seed=0):
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 4), dtype=np.uint8)
    return Image.fromarray(a, "RGBA").convert(mode)


# (height, width, mode): downscale, upscale, transparency onto white, grey, square, extreme aspect (both edge rules)
IMAGES = [(90, 140, "RGB"), (200, 60, "RGBA"), (37, 1000, "L"), (480, 640, "RGB"), (144, 144, "P"),
          (5000, 20, "RGB"), (20, 3000, "RGB")]


@pytest.mark.parametrize("max_soft_tokens", [70, 280])
def test_image_pixels_and_positions_equal_hf(max_soft_tokens):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    proc = Gemma4ImageProcessorPil(max_soft_tokens=max_soft_tokens)
    for i, (h, w, mode) in enumerate(IMAGES):
        img = _image(h, w, mode, seed=i)
        ref = proc([img], return_tensors="np")
        ours = media.preprocess_image(img, max_soft_tokens)
        assert ours.pixel_values.shape == ref["pixel_values"][0].shape, (h, w, mode)
        np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"][0], err_msg=f"{h}x{w} {mode}")
        np.testing.assert_array_equal(ours.position_ids, ref["image_position_ids"][0], err_msg=f"{h}x{w} {mode}")
        assert ours.num_soft_tokens == ref["num_soft_tokens_per_image"][0]
        assert 0 < ours.num_soft_tokens <= max_soft_tokens


def test_image_array_input_equals_pil_input():
    img = _image(64, 100, "RGB")
    a = media.preprocess_image(img, 70)
    b = media.preprocess_image(np.asarray(img), 70)
    np.testing.assert_array_equal(a.pixel_values, b.pixel_values)


def test_unified_merge_equals_hf_patches_merge():
    """The 12B's merged patches: HF's own patches_merge applied to HF's 16x16 patches of the same image."""
    import torch
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    hm.stub_torchvision()
    from transformers.models.gemma4_unified.image_processing_gemma4_unified import patches_merge
    for i, (h, w) in enumerate([(100, 333), (500, 90)]):
        img = _image(h, w, "RGB", seed=10 + i)
        ref = Gemma4ImageProcessorPil(max_soft_tokens=70)([img], return_tensors="np")
        n = int(ref["num_soft_tokens_per_image"][0])
        keep = (ref["image_position_ids"][0] != -1).all(-1)
        merged, pos = patches_merge(torch.as_tensor(ref["pixel_values"][0][keep])[None],
                                    torch.as_tensor(ref["image_position_ids"][0][keep])[None], n)
        ours = media.preprocess_image(img, 70, unified=True)
        assert ours.pixel_values.shape == (70, 6912) and ours.num_soft_tokens == n
        np.testing.assert_array_equal(ours.pixel_values[:n], merged[0].numpy())
        np.testing.assert_array_equal(ours.position_ids[:n], pos[0].numpy())
        assert (ours.pixel_values[n:] == 0).all() and (ours.position_ids[n:] == -1).all()


def test_decode_image_like_hf_load_image(tmp_path):
    from transformers.image_utils import load_image
    img = _image(30, 50, "RGBA")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    path = tmp_path / "x.png"
    path.write_bytes(buf.getvalue())
    ref = np.asarray(load_image(str(path)))
    np.testing.assert_array_equal(np.asarray(media.decode_image(buf.getvalue())), ref)
    np.testing.assert_array_equal(np.asarray(media.decode_image(path)), ref)
    np.testing.assert_array_equal(media.preprocess_image(buf.getvalue(), 70).pixel_values,
                                  media.preprocess_image(Image.open(path).convert("RGB"), 70).pixel_values)


def test_bad_images_are_named_errors():
    with pytest.raises(ValueError, match=r"image \(12 bytes\): not a decodable image"):
        media.decode_image(b"not an image")
    buf = io.BytesIO()
    _image(40, 40, "RGB").save(buf, format="PNG")
    with pytest.raises(ValueError, match="not a decodable image"):
        media.decode_image(buf.getvalue()[:60])  # truncated
    with pytest.raises(ValueError, match="max_soft_tokens: expected one of"):
        media.preprocess_image(_image(10, 10, "RGB"), 100)
    with pytest.raises(ValueError, match=r"image array: expected uint8 \[height, width, 1 \| 3 \| 4\]"):
        media.preprocess_image(np.zeros((4, 4, 2), np.uint8))


@pytest.mark.parametrize("n", [100, 400, 16000, 16123, 50000, 485_000])
def test_audio_features_equal_hf(n):
    """Shorter than one frame, a few frames, 1 s, off the 128-sample grid, ~3 s, past the 30 s truncation."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    wav = (np.random.default_rng(n).standard_normal(n) * 0.2).astype(np.float32)
    ref = Gemma4AudioFeatureExtractor()([wav], return_tensors="np")
    ours = media.audio_features(wav)
    np.testing.assert_array_equal(ours.features, ref["input_features"][0])
    np.testing.assert_array_equal(ours.mask, ref["input_features_mask"][0])


def test_audio_batch_padding_is_only_masked_frames():
    """HF pads a batch to its longest clip; each clip's rows equal ours, the rest are zero and masked."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    wavs = [RNG.standard_normal(9000).astype(np.float64) * 0.3, RNG.standard_normal(3000).astype(np.float64) * 0.3]
    ref = Gemma4AudioFeatureExtractor()(wavs, return_tensors="np")
    for i, wav in enumerate(wavs):
        ours = media.audio_features(wav)
        F = len(ours.features)
        np.testing.assert_array_equal(ours.features, ref["input_features"][i][:F])
        np.testing.assert_array_equal(ours.mask, ref["input_features_mask"][i][:F])
        assert not ref["input_features_mask"][i][F:].any() and (ref["input_features"][i][F:] == 0).all()


def test_unified_audio_frames_equal_hf():
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
        Gemma4UnifiedAudioFeatureExtractor,
    )
    wav = RNG.standard_normal(2000).astype(np.float32)
    ref = Gemma4UnifiedAudioFeatureExtractor()([wav], return_tensors="np")
    ours = media.audio_features(wav, unified=True)
    np.testing.assert_array_equal(ours.features, ref["input_features"][0])
    np.testing.assert_array_equal(ours.mask, ref["input_features_mask"][0])
    assert ours.num_soft_tokens == 4


def _wav_bytes(x: np.ndarray, rate: int, width: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(x.shape[1] if x.ndim == 2 else 1)
        f.setsampwidth(width)
        f.setframerate(rate)
        scale = 2 ** (8 * width - 1) - 1
        f.writeframes((np.round(x * scale)).astype({2: "<i2", 4: "<i4"}[width]).tobytes())
    return buf.getvalue()


def _float_wav(x: np.ndarray, rate: int) -> bytes:
    data = x.astype("<f4").tobytes()
    fmt = (b"fmt " + (16).to_bytes(4, "little") + (3).to_bytes(2, "little") + (1).to_bytes(2, "little")
           + rate.to_bytes(4, "little") + (rate * 4).to_bytes(4, "little") + (4).to_bytes(2, "little")
           + (32).to_bytes(2, "little"))
    body = b"WAVE" + fmt + b"data" + len(data).to_bytes(4, "little") + data
    return b"RIFF" + len(body).to_bytes(4, "little") + body


def test_decode_wav_pcm_float_stereo_and_resampling(tmp_path):
    t = np.arange(16000) / 16000
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    got = media.decode_audio(_wav_bytes(tone, 16000, 2))
    np.testing.assert_allclose(got, tone, atol=1 / 32767)
    stereo = np.stack([tone, -0.5 * tone], axis=1)
    np.testing.assert_allclose(media.decode_audio(_wav_bytes(stereo, 16000, 4)), 0.25 * tone, atol=1e-6)
    p = tmp_path / "f.wav"
    p.write_bytes(_float_wav(tone, 16000))
    np.testing.assert_allclose(media.decode_audio(p), tone, atol=1e-7)
    # 8 kHz and 44.1 kHz files come back at 16 kHz: the same 440 Hz tone, away from the edges
    for rate in (8000, 44100):
        src = 0.5 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)
        out = media.decode_audio(_wav_bytes(src, rate, 2))
        assert len(out) == 16000
        np.testing.assert_allclose(out[400:-400], tone[400:-400], atol=1e-4)
    # a 9 kHz tone in a 48 kHz file is above the new Nyquist: filtered out, not aliased to 7 kHz
    alias = media.resample(np.sin(2 * np.pi * 9000 * np.arange(48000) / 48000), 48000, 16000)
    assert np.sqrt(np.mean(alias[400:-400] ** 2)) < 1e-3


def test_bad_audio_is_a_named_error():
    with pytest.raises(ValueError, match=r"audio \(4 bytes\): unknown audio format: expected a RIFF/WAVE file"):
        media.decode_audio(b"OggS")
    bad = bytearray(_float_wav(np.zeros(10), 16000))
    bad[20:22] = (2).to_bytes(2, "little")      # ADPCM
    with pytest.raises(ValueError, match="unsupported WAV encoding"):
        media.decode_audio(bytes(bad))
    with pytest.raises(ValueError, match="expected 16000 Hz, got 8000 Hz"):
        media.audio_features(np.zeros(100, np.float32), sampling_rate=8000)
    with pytest.raises(ValueError, match="expected mono"):
        media.audio_features(np.zeros((100, 2), np.float32))


def test_expansion_counts_must_match():
    with pytest.raises(ValueError, match=r"prompt: 1 <\|image\|> placeholder\(s\) but 2 image input\(s\) given"):
        media.expand_prompt("a <|image|>", [3, 4])
    assert media.expand_prompt("a<|image|>b<|audio|>", [2], [1]) == \
        "a<|image><|image|><|image|><image|>b<|audio><|audio|><audio|>"


@pytest.fixture(scope="module")
def hf_tok(gemma4_dir):
    pytest.importorskip("transformers")
    return hm.hf_gemma4_tokenizer(str(gemma4_dir))


def test_processor_ids_equal_hf(hf_tok, gemma4_tok):
    """HF's Gemma4Processor on a prompt with two images and two clips (real Gemma 4 vocabulary): input ids,
    mm_token_type_ids, pixel values and audio features all equal ours."""
    proc = hm.hf_processor(hf_tok, max_soft_tokens=70)
    imgs = [_image(90, 140, "RGB", 1), _image(300, 100, "RGB", 2)]
    wavs = [RNG.standard_normal(12000).astype(np.float32) * 0.2, RNG.standard_normal(5000).astype(np.float32) * 0.2]
    text = "<bos><|turn>user\nCompare <|image|> with <|image|>, then hear <|audio|> and <|audio|><turn|>\n"
    ref = proc(text=[text], images=[imgs], audio=wavs, return_tensors="np")

    pi = [media.preprocess_image(im, 70) for im in imgs]
    pa = [media.audio_features(w) for w in wavs]
    expanded = media.expand_prompt(text, [p.num_soft_tokens for p in pi], [p.num_soft_tokens for p in pa])
    ids = gemma4_tok.encode(expanded)
    assert ids == ref["input_ids"][0].tolist()
    unexpanded = hf_tok(text)["input_ids"]
    assert media.expand_ids(unexpanded, [p.num_soft_tokens for p in pi], [p.num_soft_tokens for p in pa]) == ids
    types = ref["mm_token_type_ids"][0]
    assert ((types == 1) == (np.asarray(ids) == 258880)).all() and ((types == 3) == (np.asarray(ids) == 258881)).all()
    for i, p in enumerate(pi):
        np.testing.assert_array_equal(p.pixel_values, ref["pixel_values"][i])
        np.testing.assert_array_equal(p.position_ids, ref["image_position_ids"][i])
    for i, p in enumerate(pa):
        F = len(p.features)
        np.testing.assert_array_equal(p.features, ref["input_features"][i][:F])
        assert p.num_soft_tokens == _audio_run(ids, i)


def _audio_run(ids, i):
    """Length of the i-th run of audio placeholders in ids."""
    runs, n = [], 0
    for t in ids + [0]:
        if t == 258881:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs[i]


def test_unified_processor_audio_ids_equal_hf(hf_tok, gemma4_tok):
    proc = hm.hf_processor(hf_tok, max_soft_tokens=70, unified=True)
    wav = RNG.standard_normal(3000).astype(np.float32)
    text = "listen: <|audio|> done"
    ref = proc(text=[text], audio=[wav], return_tensors="np")
    pa = media.audio_features(wav, unified=True)
    assert gemma4_tok.encode(media.expand_prompt(text, [], [pa.num_soft_tokens])) == ref["input_ids"][0].tolist()
