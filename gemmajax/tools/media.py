"""Media input handling without torch: image / WAV decoding, HF-equal Gemma 4 preprocessing, placeholder expansion.

Matches transformers 5.24: `Gemma4ImageProcessorPil` (the image processor transformers uses without torchvision:
Pillow bicubic resize to the largest size that keeps the aspect ratio within max_soft_tokens * k^2 patches with
sides multiple of 16k, x / 255, 16x16 patches, (x, y) positions, padding to a fixed length), the 12B's merge of
k x k patches into one 48x48 patch (`Gemma4UnifiedImageProcessor`'s `patches_merge`; HF has that processor only with
torchvision's resize, which rounds a little differently from Pillow's), `Gemma4AudioFeatureExtractor` (semicausal
framing, periodic Hann, |rfft| @ HTK mel filters, log(x + 1e-3), with the same numpy dtypes), the unified extractor
(raw 640-sample frames) and the processor's prompt expansion `<|image>` + `<|image|>` x N + `<image|>`.

The outputs are `ProcessedImage` / `ProcessedAudio` (numpy arrays), which `gemmajax.model.multimodal.embed_multimodal`
takes as they are. Errors name the input part that failed, what was expected and what was found.
"""
from __future__ import annotations

import dataclasses
import io
import math
import os
import re
import struct
from collections.abc import Sequence

import numpy as np

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
SAMPLING_RATE = 16000
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = "<|image|>", "<|image>", "<image|>"
AUDIO_TOKEN, BOA_TOKEN, EOA_TOKEN = "<|audio|>", "<|audio>", "<audio|>"


@dataclasses.dataclass(frozen=True)
class ProcessedImage:
    """One image as the vision encoder takes it (HF's pixel_values / image_position_ids row)."""

    pixel_values: np.ndarray      # [T, C] float32 in [0, 1]; T = max_soft_tokens * k^2 (12B: max_soft_tokens)
    position_ids: np.ndarray      # [T, 2] int64 (x, y) patch coordinates, (-1, -1) for padding rows
    num_soft_tokens: int          # placeholders this image takes in the prompt
    size: tuple[int, int]         # (height, width) after resizing
    kind: str = "image"


@dataclasses.dataclass(frozen=True)
class ProcessedAudio:
    """One clip as the audio encoder takes it (HF's input_features / input_features_mask row)."""

    features: np.ndarray          # [F, 128] float32 log-mel (12B: [M, 640] raw waveform frames)
    mask: np.ndarray              # [F] bool, True for frames fully inside the clip
    num_soft_tokens: int          # placeholders this clip takes in the prompt
    kind: str = "audio"


# ---------------------------------------------------------------------------- images

def decode_image(data: bytes | str | os.PathLike):
    """Encoded bytes or a file path -> an RGB PIL image, as HF's `load_image` does (EXIF orientation applied, then
    `convert("RGB")`). Raises ValueError naming the input when Pillow cannot read it."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    label = f"{len(data)} bytes" if isinstance(data, (bytes, bytearray)) else repr(os.fspath(data))
    try:
        img = Image.open(io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else os.fspath(data))
        img.load()
    except FileNotFoundError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"image ({label}): not a decodable image (expected PNG, JPEG, WebP, GIF, BMP, ...): {e}"
                         ) from None
    return ImageOps.exif_transpose(img).convert("RGB")


def _to_rgb_array(image) -> np.ndarray:
    """PIL image or HWC array -> HWC uint8 RGB, the way HF's `convert_to_rgb` (PIL backend) does it: transparent
    images are composited onto white, grey is repeated to three channels."""
    from PIL import Image

    if isinstance(image, Image.Image):
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        else:
            image = image.convert("RGB")
        return np.asarray(image)
    a = np.asarray(image)
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[-1] not in (1, 3, 4) or a.dtype != np.uint8:
        raise ValueError(f"image array: expected uint8 [height, width, 1 | 3 | 4], got {a.dtype} {list(a.shape)}")
    if a.shape[-1] == 1:
        return np.repeat(a, 3, axis=-1)
    if a.shape[-1] == 4:
        alpha = a[..., 3:4] / 255
        return np.round(alpha * a[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return a


def target_size(height: int, width: int, max_soft_tokens: int = 280, patch_size: int = 16,
                pooling_kernel_size: int = 3) -> tuple[int, int]:
    """(height, width) HF resizes to: the largest sides, multiples of k * patch_size, whose patch count
    (h / p) * (w / p) stays within max_soft_tokens * k^2, keeping the aspect ratio (rounded down); a side that
    rounds to zero becomes one block and the other takes floor(ratio) blocks, capped at the budget."""
    k, p = pooling_kernel_size, patch_size
    budget = max_soft_tokens * k * k * p * p
    f = math.sqrt(budget / (height * width))
    side = k * p
    th = math.floor(f * height / side) * side
    tw = math.floor(f * width / side) * side
    if th == 0 and tw == 0:
        raise ValueError(f"image {height}x{width}: resizes to 0x0 at {max_soft_tokens} soft tokens")
    longest = max_soft_tokens * side
    if th == 0:
        th, tw = side, min(math.floor(width / height) * side, longest)
    elif tw == 0:
        th, tw = min(math.floor(height / width) * side, longest), side
    if th * tw > budget:
        raise ValueError(f"image {height}x{width}: resized to {th}x{tw}, more than {max_soft_tokens * k * k} patches")
    return th, tw


def _patchify(img: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray]:
    """HWC float -> (patches [(H/p)(W/p), p*p*C] raster order, each row-major (row, col, channel); positions (x, y))."""
    H, W, C = img.shape
    ph, pw = H // p, W // p
    patches = img.reshape(ph, p, pw, p, C).transpose(0, 2, 1, 3, 4).reshape(ph * pw, p * p * C)
    ys, xs = np.meshgrid(np.arange(ph), np.arange(pw), indexing="ij")
    return patches, np.stack([xs.reshape(-1), ys.reshape(-1)], axis=-1).astype(np.int64)


def preprocess_image(image, max_soft_tokens: int = 280, *, patch_size: int = 16, pooling_kernel_size: int = 3,
                     unified: bool = False) -> ProcessedImage:
    """A PIL image, HWC uint8 array, encoded bytes or path -> ProcessedImage, equal to HF's Gemma 4 processor.

    Gemma 4 (E2B / E4B / 26B / 31B): T = max_soft_tokens * k^2 rows of 16x16x3 patches. unified (12B): k x k
    patches merged into one (16k)x(16k)x3 patch, T = max_soft_tokens rows. num_soft_tokens = (h / 16k) * (w / 16k).
    """
    from PIL import Image

    if max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
        raise ValueError(f"max_soft_tokens: expected one of {SUPPORTED_SOFT_TOKENS}, got {max_soft_tokens}")
    if isinstance(image, (bytes, bytearray, str, os.PathLike)):
        image = decode_image(image)
    rgb = _to_rgb_array(image)
    h, w = rgb.shape[:2]
    th, tw = target_size(h, w, max_soft_tokens, patch_size, pooling_kernel_size)
    if (th, tw) != (h, w):
        rgb = np.asarray(Image.fromarray(rgb).resize((tw, th), resample=Image.BICUBIC))
    pixels = (rgb.astype(np.float64) * (1 / 255)).astype(np.float32)   # HF rescales in float64, then float32
    k = pooling_kernel_size
    n_soft = (th // (patch_size * k)) * (tw // (patch_size * k))
    patches, pos = _patchify(pixels, patch_size * k if unified else patch_size)
    rows = max_soft_tokens if unified else max_soft_tokens * k * k
    pv = np.zeros((rows, patches.shape[1]), np.float32)
    pv[:len(patches)] = patches
    pid = np.full((rows, 2), -1, np.int64)
    pid[:len(pos)] = pos
    return ProcessedImage(pv, pid, n_soft, (th, tw))


# ---------------------------------------------------------------------------- audio

def decode_audio(data: bytes | str | os.PathLike, sampling_rate: int = SAMPLING_RATE) -> np.ndarray:
    """A WAV file (bytes or path: PCM 8 / 16 / 24 / 32-bit or IEEE float 32 / 64, any channel count) -> mono
    float32 [-1, 1] at `sampling_rate` (channels averaged; resampled by `resample` when the file's rate differs).

    HF resamples files with soxr when it loads them; our windowed-sinc resampler is close to it, not bit-equal.
    Waveforms already at 16 kHz need no decoding here: pass them to `audio_features` directly."""
    if isinstance(data, (bytes, bytearray)):
        label, raw = f"audio ({len(data)} bytes)", bytes(data)
    else:
        label = f"audio {os.fspath(data)!r}"
        with open(data, "rb") as f:
            raw = f.read()
    wav, rate = _parse_wav(raw, label)
    if wav.ndim == 2:
        wav = wav.mean(axis=1, dtype=np.float64).astype(np.float32)
    return resample(wav, rate, sampling_rate) if rate != sampling_rate else wav


def _parse_wav(raw: bytes, label: str) -> tuple[np.ndarray, int]:
    if len(raw) < 12 or raw[:4] not in (b"RIFF", b"RF64") or raw[8:12] != b"WAVE":
        head = raw[:12]
        raise ValueError(f"{label}: unknown audio format: expected a RIFF/WAVE file, found header {head!r} "
                         "(decode other formats yourself and pass a 16 kHz float waveform to audio_features)")
    fmt = data = None
    off = 12
    while off + 8 <= len(raw):
        cid, size = raw[off:off + 4], struct.unpack("<I", raw[off + 4:off + 8])[0]
        body = raw[off + 8:off + 8 + size]
        if cid == b"fmt ":
            fmt = body
        elif cid == b"data":
            data = body
        off += 8 + size + (size & 1)
    if fmt is None or len(fmt) < 16 or data is None:
        raise ValueError(f"{label}: WAV without a {'fmt' if fmt is None or len(fmt) < 16 else 'data'} chunk")
    tag, channels, rate, _, align, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == 0xFFFE and len(fmt) >= 26:  # WAVE_FORMAT_EXTENSIBLE: the sub-format's first two bytes
        tag = struct.unpack("<H", fmt[24:26])[0]
    if channels < 1 or rate < 1 or align != channels * (bits // 8):
        raise ValueError(f"{label}: inconsistent WAV header ({channels} channels, {rate} Hz, {bits} bits, "
                         f"block align {align})")
    n = len(data) // align
    data = data[:n * align]
    if tag == 1 and bits in (8, 16, 32):
        dt = {8: np.uint8, 16: "<i2", 32: "<i4"}[bits]
        x = np.frombuffer(data, dt).astype(np.float32)
        x = (x - 128) / 128 if bits == 8 else x / np.float32(2 ** (bits - 1))
    elif tag == 1 and bits == 24:
        b = np.frombuffer(data, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v) / np.float32(1 << 23)).astype(np.float32)
    elif tag == 3 and bits in (32, 64):
        x = np.frombuffer(data, "<f4" if bits == 32 else "<f8").astype(np.float32)
    else:
        raise ValueError(f"{label}: unsupported WAV encoding (format tag {tag}, {bits} bits); expected PCM "
                         "8 / 16 / 24 / 32-bit or IEEE float 32 / 64")
    x = x.reshape(n, channels)
    return (x[:, 0] if channels == 1 else x), rate


def resample(wave: np.ndarray, rate_in: int, rate_out: int, half_width: int = 32) -> np.ndarray:
    """Band-limited resampling (Kaiser-windowed sinc, `half_width` zero crossings each side). wave: [N] float."""
    wave = np.asarray(wave, np.float64)
    n_out = math.ceil(len(wave) * rate_out / rate_in)
    cut = min(1.0, rate_out / rate_in)                        # low-pass at the lower Nyquist
    t = np.arange(n_out) * (rate_in / rate_out)               # output instants in input samples
    reach = math.ceil(half_width / cut)
    base = np.floor(t).astype(np.int64)
    out = np.zeros(n_out)
    for j in range(-reach + 1, reach + 1):
        idx = base + j
        d = t - idx
        r = np.clip(d / reach, -1.0, 1.0)
        win = np.i0(8.6 * np.sqrt(1.0 - r * r)) / np.i0(8.6)                 # Kaiser window, beta 8.6
        h = cut * np.sinc(cut * d) * np.where(np.abs(d) <= reach, win, 0.0)
        ok = (idx >= 0) & (idx < len(wave))
        out += np.where(ok, wave[np.clip(idx, 0, len(wave) - 1)], 0.0) * h
    return out.astype(np.float32)


def _hz_to_mel(f):
    return 2595.0 * np.log10(1.0 + f / 700.0)


def mel_filters(num_bins: int = 257, num_mels: int = 128, sampling_rate: int = SAMPLING_RATE,
                f_min: float = 0.0, f_max: float = 8000.0) -> np.ndarray:
    """[num_bins, num_mels] float64 triangular HTK-mel filters, unnormalized, triangles in Hz (HF's
    `mel_filter_bank(norm=None, mel_scale="htk")`): bin b of filter m rises from edge m to m + 1, falls to m + 2."""
    mels = np.linspace(_hz_to_mel(f_min), _hz_to_mel(f_max), num_mels + 2)
    edges = 700.0 * (np.power(10, mels / 2595.0) - 1.0)
    bins = np.linspace(0, sampling_rate // 2, num_bins)
    rel = edges[None, :] - bins[:, None]                                 # [num_bins, num_mels + 2]
    width = np.diff(edges)
    rise = -rel[:, :-2] / width[:-1]
    fall = rel[:, 2:] / width[1:]
    return np.maximum(0.0, np.minimum(rise, fall))


_MEL_CACHE: dict[tuple, np.ndarray] = {}


def audio_features(wave: np.ndarray, *, sampling_rate: int = SAMPLING_RATE, unified: bool = False,
                   max_samples: int | None = 480_000, frame_length_ms: float = 20.0, hop_length_ms: float = 10.0,
                   num_mels: int = 128, mel_floor: float = 1e-3, pad_to_multiple_of: int = 128,
                   per_bin_mean: Sequence[float] | None = None, per_bin_stddev: Sequence[float] | None = None,
                   frame_size: int = 640) -> ProcessedAudio:
    """A mono 16 kHz waveform [N] -> ProcessedAudio, equal to HF's Gemma4AudioFeatureExtractor row for it.

    Gemma 4: truncate to max_samples (30 s), zero-pad to a multiple of 128 samples, prepend 160 zeros (semicausal),
    321-sample frames every 160 (the first 320 used), periodic Hann, |rfft_512| @ 128 HTK mel filters (0-8 kHz),
    log(x + mel_floor), optional per-bin normalization; a frame is valid when its last sample is real audio, and
    invalid frames are zeroed. Soft tokens = valid frames after two stride-2 subsamplings (HF's processor rule).
    unified (12B): [ceil(N / 640), 640] raw frames, all valid."""
    x = np.asarray(wave)
    if x.ndim != 1:
        raise ValueError(f"audio waveform: expected mono [samples], got shape {list(x.shape)} (average the channels)")
    if sampling_rate != SAMPLING_RATE:
        raise ValueError(f"audio waveform: expected {SAMPLING_RATE} Hz, got {sampling_rate} Hz (use resample())")
    if x.dtype == np.float64:
        x = x.astype(np.float32)                                          # HF's padding step does this
    if unified:
        x = np.pad(x, (0, -len(x) % frame_size)).astype(np.float32)
        frames = x.reshape(-1, frame_size)
        return ProcessedAudio(frames, np.ones(len(frames), bool), len(frames))
    if max_samples is not None:
        x = x[:-(-max_samples // pad_to_multiple_of) * pad_to_multiple_of]
    n_real = len(x)
    x = np.pad(x, (0, -n_real % pad_to_multiple_of))
    frame = round(sampling_rate * frame_length_ms / 1000.0)
    hop = round(sampling_rate * hop_length_ms / 1000.0)
    fft = 2 ** math.ceil(math.log2(frame))
    x = np.pad(x, (frame // 2, 0))
    real = np.zeros(len(x), bool)
    real[frame // 2:frame // 2 + n_real] = True
    n_frames = (len(x) - (frame + 1)) // hop + 1
    if n_frames <= 0:
        return ProcessedAudio(np.zeros((0, num_mels), np.float32), np.zeros(0, bool), 0)
    starts = np.arange(n_frames) * hop
    frames = x[starts[:, None] + np.arange(frame)[None, :]]               # [F, frame] (the unfold's first 320)
    window = np.hanning(frame + 1)[:-1].astype(np.float32)
    spec = np.abs(np.fft.rfft(frames * window, n=fft, axis=-1))
    key = (fft // 2 + 1, num_mels, sampling_rate)
    if key not in _MEL_CACHE:
        _MEL_CACHE[key] = mel_filters(*key)
    logmel = np.log(spec @ _MEL_CACHE[key] + np.float64(mel_floor))
    if per_bin_mean is not None:
        logmel = logmel - np.asarray(per_bin_mean).reshape(1, num_mels)
    if per_bin_stddev is not None:
        logmel = logmel / np.asarray(per_bin_stddev).reshape(1, num_mels)
    mask = real[starts + frame]
    feats = logmel.astype(np.float32) * mask[:, None]
    return ProcessedAudio(feats, mask, audio_soft_tokens(mask))


def audio_soft_tokens(mask: np.ndarray) -> int:
    """Soft tokens for a clip's frame mask: the valid entries of mask[::2][::2] (the encoder's two stride-2 convs)."""
    return int(np.asarray(mask)[::2][::2].sum())


# ---------------------------------------------------------------------------- prompt expansion

def expand_prompt(text: str, image_tokens: Sequence[int] = (), audio_tokens: Sequence[int] = (), *,
                  image_token: str = IMAGE_TOKEN, boi: str = BOI_TOKEN, eoi: str = EOI_TOKEN,
                  audio_token: str = AUDIO_TOKEN, boa: str = BOA_TOKEN, eoa: str = EOA_TOKEN) -> str:
    """Replace the i-th `<|image|>` by `<|image>` + `<|image|>` x image_tokens[i] + `<image|>`, and the i-th
    `<|audio|>` likewise with audio_tokens[i] (HF's processor). The counts must match the placeholders."""
    counts = {image_token: list(image_tokens), audio_token: list(audio_tokens)}
    for tok, ns in counts.items():
        found = text.count(tok)
        if found != len(ns):
            what = "image" if tok == image_token else "audio"
            raise ValueError(f"prompt: {found} {tok} placeholder(s) but {len(ns)} {what} input(s) given")
    wrap = {image_token: (boi, eoi), audio_token: (boa, eoa)}
    its = {tok: iter(ns) for tok, ns in counts.items()}

    def sub(m):
        tok = m.group(0)
        b, e = wrap[tok]
        return b + tok * next(its[tok]) + e

    return re.sub("|".join(re.escape(t) for t in counts), sub, text)


def expand_ids(ids: Sequence[int], image_tokens: Sequence[int] = (), audio_tokens: Sequence[int] = (), *,
               image_id: int = 258880, boi_id: int = 255999, eoi_id: int = 258882, audio_id: int = 258881,
               boa_id: int = 256000, eoa_id: int = 258883) -> list[int]:
    """`expand_prompt` on token ids: each image / audio placeholder id becomes begin + placeholder x N + end."""
    ids = list(ids)
    wrap = {image_id: (boi_id, eoi_id, list(image_tokens)), audio_id: (boa_id, eoa_id, list(audio_tokens))}
    for pid, (_, _, ns) in wrap.items():
        if ids.count(pid) != len(ns):
            raise ValueError(f"prompt ids: {ids.count(pid)} placeholder(s) {pid} but {len(ns)} input(s) given")
    its = {pid: iter(ns) for pid, (_, _, ns) in wrap.items()}
    out: list[int] = []
    for t in ids:
        if t in wrap:
            b, e, _ = wrap[t]
            out += [b] + [t] * next(its[t]) + [e]
        else:
            out.append(t)
    return out
