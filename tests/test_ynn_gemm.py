"""bench/ynn_gemm.py: every GEMM form whose time the README quotes computes x . W^T (each against numpy on seeded
random operands, in whatever orientation the form returns), its check rejects a wrong product, and its reading of
`perf report` keeps the share and the symbol."""
import numpy as np
import pytest

from tests.bench_scripts import load_bench

ynn = load_bench("ynn_gemm")


@pytest.mark.parametrize("m, n, seed", [(2, 512, 0), (16, 1024, 1), (5, 264, 2)])
def test_every_form_matches_numpy(m, n, seed):
    fs = ynn.forms(m, n, seed)
    assert len(fs) == 6
    for name, (f, x, w, ref, exact) in fs.items():
        y = np.asarray(f(x, w))
        assert y.shape == ref.shape, name
        ynn.check(name, y, ref, exact)  # raises ValueError when off


def test_check_rejects_a_wrong_product():
    fs = ynn.forms(4, 256, 3)
    f, x, w, ref, exact = fs["bf16 x.W^T, W [N,K]"]
    y = np.asarray(f(x, w)).copy()
    y[1, 7] += 0.01 * np.abs(ref).max()  # 10x the tolerance in one entry
    with pytest.raises(ValueError, match="max error"):
        ynn.check("bf16", y, ref, exact)
    f, x, w, ref, exact = fs["int8 W.x^T (vocab rows)"]
    y = np.asarray(f(x, w)).copy()
    y[5, 2] += 1  # int8 products are exact: one unit off is wrong
    with pytest.raises(ValueError, match="differ"):
        ynn.check("int8", y, ref, exact)


def test_check_rejects_a_wrong_shape_and_the_table_names_every_form(capsys):
    fs = ynn.forms(3, 256, 4)
    f, x, w, ref, exact = fs["bf16 W.x^T (vocab rows)"]
    with pytest.raises(ValueError, match="shape"):
        ynn.check("vocab rows, not transposed back", np.asarray(f(x, w))[:1], ref[:1].T, exact)  # broadcastable
    ynn.time_rows([2], 256, 1)
    out = capsys.readouterr().out
    assert all(f"| {name} | " in out for name in ynn.FORMS)


def test_perf_report_line_parsing():
    line = "    55.47%  [.] ynn::transpose_x32_avx512                          -      -            "
    share, sym = ynn._PERF_LINE.match(line).groups()
    assert share == "55.47%"
    assert ynn._PERF_COLUMNS.split(sym)[0] == "ynn::transpose_x32_avx512"
    spaced = "     0.40%  [.] ynn::run_dot<ynn::(anonymous namespace)::make_dot_impl(ynn::dot_type, bool)>  -  -"
    assert ynn._PERF_COLUMNS.split(ynn._PERF_LINE.match(spaced).group(2))[0].endswith("(ynn::dot_type, bool)>")
    assert ynn._PERF_LINE.match("# Samples: 13K of event 'cpu-clock'") is None
