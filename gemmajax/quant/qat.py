"""Exact repack of QAT q4_0 weights (Google's `-qat-q4_0-unquantized`) into int4 QuantArrays.

Those checkpoints hold bf16 values that already lie on a 4-bit grid per group of 32 along `in`. We recover each
group's step and levels so that dequantize(repack(w)) == w for every value, or leave the tensor unquantized:
an off-grid tensor is reported and never re-gridded. Design choices: the step is searched as amax / m (m = 1..8,
first m whose reconstruction error is within amax * 2**-7; the textbook amax / 8 silently re-grids groups whose
peak sits below level 8), refined by least squares, then chosen inside the interval of steps for which every
bf16(level * step) rounds back to the stored value -- a bf16 step when one exists, else a float32 one -- and
verified by the very arithmetic dequantize() runs. Host-side numpy, chunked, float64 for the interval math.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from gemmajax.quant.array import INT4_MAX, INT4_MIN, QuantArray, padded_in, padded_out

_BF16 = ml_dtypes.bfloat16
_CHUNK_GROUPS = 1 << 19


@dataclasses.dataclass
class RepackReport:
    """Running totals over the tensors given to repack_qat (pass the same report to every call)."""

    packed: int = 0  # tensors turned into int4 QuantArrays
    kept: int = 0  # tensors left unquantized because some group is off the grid
    kept_names: list[str] = dataclasses.field(default_factory=list)
    f32_scale_tensors: int = 0  # packed tensors that needed float32 steps (no bf16 step reproduces them)
    groups: int = 0
    off_grid_groups: int = 0
    values: int = 0  # values in packed tensors
    bit_identical: int = 0  # of those, bit-identical after dequantize (== value equality except for -0.0)

    def summary(self) -> str:
        kept = f" ({', '.join(self.kept_names[:8])}{', ...' if len(self.kept_names) > 8 else ''})" if self.kept else ""
        return (f"QAT repack: {self.packed} tensors packed ({self.f32_scale_tensors} with float32 steps), "
                f"{self.kept} kept{kept}; {self.off_grid_groups} of {self.groups} groups off-grid; "
                f"{self.bit_identical} of {self.values} values bit-identical")


def _verify(g: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Levels against step s and whether bf16(level * s) reproduces g. g f32 [n, group], s f32 [n]."""
    sd = np.where(s == 0, np.float32(1), s)[:, None]
    q = np.clip(np.rint(g / sd), INT4_MIN, INT4_MAX).astype(np.float32)
    q = np.where(s[:, None] == 0, np.float32(0), q)
    deq = (q * s[:, None]).astype(_BF16).astype(np.float32)  # exactly dequantize()'s arithmetic
    return np.all(deq == g, axis=1), q.astype(np.int8)


def _bf16_step(x: np.ndarray, ulps: int) -> np.ndarray:
    """Positive f32 -> the bf16 value `ulps` steps away from bf16(x), as f32."""
    b = x.astype(_BF16).view(np.uint16).astype(np.int32) + ulps
    return np.clip(b, 0, 0x7F7F).astype(np.uint16).view(_BF16).astype(np.float32)


def recover_groups(g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Recover the 4-bit grid of each group.

    g: float32 [n, group] holding bf16 values. Returns (levels int8 [n, group], step float32 [n], ok bool [n],
    bf16_ok bool [n]): ok where bf16(level * step) == g for the whole group; bf16_ok where step is a bf16 number.
    """
    g = np.asarray(g, np.float32)
    n = g.shape[0]
    amax = np.max(np.abs(g), axis=1)
    tol = amax * np.float32(2.0**-7)
    levels = np.zeros(g.shape, np.float32)
    found = amax == 0  # all-zero groups: step 0, levels 0
    for m in range(1, 9):  # first m whose grid reproduces the group within tol
        idx = np.nonzero(~found)[0]
        if idx.size == 0:
            break
        d = (amax[idx] / np.float32(m))[:, None]
        q = np.clip(np.rint(g[idx] / d), INT4_MIN, INT4_MAX)
        hit = np.max(np.abs(g[idx] - q * d), axis=1) <= tol[idx]
        levels[idx[hit]] = q[hit]
        found[idx[hit]] = True
    g64, q64 = g.astype(np.float64), levels.astype(np.float64)
    qq = np.sum(q64 * q64, axis=1)
    d_ls = np.where(qq > 0, np.sum(q64 * g64, axis=1) / np.where(qq > 0, qq, 1), 0.0)
    # The steps s with bf16(|q| s) == |g| for every nonzero level: |q| s within half a bf16 ulp of |g| on each side.
    a = np.abs(g)
    bits = a.astype(_BF16).view(np.uint16).astype(np.int32)
    up = np.clip(bits + 1, 0, 0x7F7F).astype(np.uint16).view(_BF16).astype(np.float64)
    dn = np.clip(bits - 1, 0, 0x7F7F).astype(np.uint16).view(_BF16).astype(np.float64)
    aq = np.abs(q64)
    nz = aq > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        lo = np.where(nz, (a + dn) / 2 / aq, -np.inf).max(axis=1)
        hi = np.where(nz, (a + up) / 2 / aq, np.inf).min(axis=1)
    c = np.clip(d_ls, lo, hi)
    c = np.where(np.isfinite(c), c, d_ls).astype(np.float32)
    step = np.zeros(n, np.float32)
    ok = np.zeros(n, bool)
    bf16_ok = np.zeros(n, bool)
    out_levels = np.zeros(g.shape, np.int8)
    zero = amax == 0
    ok[zero] = bf16_ok[zero] = True
    todo = found & ~zero
    candidates = [(_bf16_step(c, u), True) for u in (0, -1, 1)]
    fin = np.isfinite(lo) & np.isfinite(hi)
    mid = np.where(fin, (np.where(fin, lo, 0) + np.where(fin, hi, 0)) / 2, c)
    candidates += [(c, False), (mid.astype(np.float32), False)]
    for s, is_bf16 in candidates:
        idx = np.nonzero(todo)[0]
        if idx.size == 0:
            break
        good, q = _verify(g[idx], s[idx])
        sel = idx[good]
        step[sel], out_levels[sel], ok[sel], bf16_ok[sel] = s[idx][good], q[good], True, is_bf16
        todo[sel] = False
    return out_levels, step, ok, bf16_ok


def repack_qat(w, group: int = 32, *, report: RepackReport | None = None, name: str = "",
               pad_in_to: int | None = None) -> QuantArray | None:
    """Exact int4 repack of a QAT weight w [..., out, in] (bf16 values on a 4-bit grid per `group` along in).

    Returns the int4 QuantArray (bf16 steps when they reproduce every group, else float32 steps) with
    dequantize(q) == w for every value, or None when any group is off the grid (the caller keeps w dense).
    `report` accumulates counts; `name` labels the tensor in it; pad_in_to as in quantize().
    """
    report = report if report is not None else RepackReport()
    arr = np.asarray(jax.device_get(w))
    if arr.ndim < 2:
        raise ValueError(f"repack_qat: {name or 'weight'} must be [..., out, in], got shape {arr.shape}")
    *lead, out, inp = arr.shape
    label = name or f"tensor{list(arr.shape)}"
    if inp % group:
        report.kept += 1
        report.kept_names.append(f"{label} (in={inp} is not a multiple of the group {group})")
        return None
    g = arr.astype(np.float32).reshape(-1, group)
    levels = np.empty(g.shape, np.int8)
    steps = np.empty(g.shape[0], np.float32)
    ok = np.empty(g.shape[0], bool)
    bf16_ok = np.empty(g.shape[0], bool)
    for i in range(0, g.shape[0], _CHUNK_GROUPS):
        sl = slice(i, i + _CHUNK_GROUPS)
        levels[sl], steps[sl], ok[sl], bf16_ok[sl] = recover_groups(g[sl])
    report.groups += g.shape[0]
    off = int(np.count_nonzero(~ok))
    report.off_grid_groups += off
    if off:
        report.kept += 1
        report.kept_names.append(f"{label} ({off} off-grid groups)")
        return None
    use_bf16 = bool(np.all(bf16_ok))
    in_p, out_p = padded_in(inp, "int4", group, pad_in_to), padded_out(out)
    lv = np.zeros((*lead, out_p, in_p), np.int8)
    lv[..., :out, :inp] = levels.reshape(*lead, out, inp)
    sc = np.zeros((*lead, out_p, in_p // group), np.float32)
    sc[..., :out, : inp // group] = steps.reshape(*lead, out, inp // group)
    u = (lv.astype(np.int16) + 8).astype(np.uint8)
    h = in_p // 2
    packed = u[..., :h] | (u[..., h:] << 4)
    q = QuantArray(jnp.asarray(packed), jnp.asarray(sc.astype(_BF16) if use_bf16 else sc), "int4",
                   tuple(arr.shape), group, jnp.bfloat16)
    deq = (levels.astype(np.float32) * steps[:, None]).astype(_BF16)  # what dequantize() returns
    report.packed += 1
    report.f32_scale_tensors += 0 if use_bf16 else 1
    report.values += g.size
    report.bit_identical += int(np.count_nonzero(deq.view(np.uint16).reshape(-1)
                                                 == g.astype(_BF16).view(np.uint16).reshape(-1)))
    return q
