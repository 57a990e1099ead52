"""bench/fit_table.py's partial regeneration: rows a run does not compile keep their lines from the file it replaces."""
from __future__ import annotations

import json

import pytest

from tests.bench_scripts import load_bench


@pytest.fixture(scope="module")
def ft():
    return load_bench("fit_table")


def _row(model: str, quant: str, chip: str, *, fits: bool, kv: int, reason: str) -> dict:
    gib = 1 << 30
    return {"model": model, "quant": quant, "chip": chip, "weight_bytes": 3 * gib, "fits": fits, "compiled": True,
            "kv_tokens": kv, "kv_tokens_vllm_style": kv // 2, "kv_bytes_per_token_ours": 2048,
            "kv_bytes_per_token_vllm": 4096, "projection": {"tok_s_1": 100.0, "tok_s_16": 1500.0},
            "reason": reason, "compiles": []}


def test_rows_not_rerun_are_kept_marked_and_dated(ft):
    old = {"e2b|none|v5e": _row("e2b", "none", "v5e", fits=True, kv=111_111, reason="fits: old e2b"),
           "12b|w8a8|v6e": _row("12b", "w8a8", "v6e", fits=True, kv=222_222, reason="fits: old 12b")}
    first = ft.render(old).replace(ft.datetime.date.today().isoformat(), "2026-01-02")
    meas = "8.94 GiB; 144 / 2,008 tok/s"        # ANCHORS' e2b bf16 v5e cell, rebuilt on a kept row
    assert meas in first
    first = first.replace(meas, "a stale anchor")
    earlier = ft.earlier_rows(first)
    assert set(earlier) == {"e2b|none|v5e", "12b|w8a8|v6e"}      # "not run" rows are not carried over

    new = {"12b|w8a8|v6e": _row("12b", "w8a8", "v6e", fits=False, kv=0, reason="does not fit: new\n  12b")}
    doc = ft.render(new, earlier)
    lines = doc.splitlines()
    e2b = [ln for ln in lines if ln.startswith("| e2b")
           and [c.strip() for c in ln.split("|")[1:4]] == ["e2b" + ft.KEPT, "none", "v5e"]]
    assert len(e2b) == 1 and "111,111" in e2b[0]                  # kept, marked
    assert meas in e2b[0] and "a stale anchor" not in doc
    b12 = [ln for ln in lines if ln.startswith("| 12b | w8a8 | v6e |")]
    assert len(b12) == 1 and "222,222" not in b12[0] and "| no |" in b12[0]   # regenerated: the new result wins
    assert "- `e2b|none|v5e`: fits: old e2b (kept from the run of 2026-01-02)" in lines
    assert "- `12b|w8a8|v6e`: does not fit: new 12b" in lines and "fits: old 12b" not in doc   # one line
    assert "1 rows marked" in doc

    # a second partial run over that file keeps the row once, marked once, with its original date
    again = ft.render({}, ft.earlier_rows(doc))
    assert again.count("111,111") == 1 and ("e2b" + ft.KEPT * 2) not in again
    assert again.count("(kept from the run of 2026-01-02)") == 1
    today = ft.datetime.date.today().isoformat()
    assert f"- `12b|w8a8|v6e`: does not fit: new 12b (kept from the run of {today})" in again.splitlines()


def test_a_kv_dtype_table_shows_its_rows_only(ft, tmp_path):
    """--kv-dtype / --margin-mib other than the main table's: the settings in its header, only the rows it ran (no
    "not run" rows, nothing kept from the main table), --slices refused, and the module's settings back to the main
    table's after the run."""
    cache = tmp_path / "cache.json"
    out = tmp_path / "fp8.md"
    row = _row("26b-a4b", "w4a16+emb4", "v5e", fits=True, kv=69_749, reason="fits: fp8")
    cache.write_text(json.dumps({"26b-a4b|w4a16+emb4|v5e": row}))
    assert ft.main(["--kv-dtype", "fp8_e4m3", "--margin-mib", "64", "--render-only", "--cache", str(cache),
                    "--out", str(out)]) == 0
    doc = out.read_text()
    assert "KV cache fp8_e4m3, margin 64 MiB" in doc
    rows = [ln for ln in doc.splitlines() if ln.startswith("| ") and not ln.startswith("| model")]
    assert len(rows) == 1 and rows[0].startswith("| 26b-a4b | w4a16+emb4 | v5e |") and "69,749" in rows[0]
    assert "not run" not in doc and ft.KEPT not in doc
    assert ft.SETTINGS == ft.DEFAULT_SETTINGS and "KV cache bf16, margin 0.25 GiB" in ft.render({})
    with pytest.raises(SystemExit):
        ft.main(["--kv-dtype", "fp8_e4m3", "--slices", "--render-only", "--cache", str(cache)])
    assert ft.SETTINGS == ft.DEFAULT_SETTINGS
