"""Load a bench/ script as a module for its tests.

From its file, never by putting bench/ on sys.path: bench/kernels.py would then shadow the `kernels` package that
transformers imports, and every later test in the session that builds an HF model would fail (CI did, once)."""
import importlib.util
import os

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def load_bench(name: str):
    """bench/<name>.py as a fresh module named bench_<name>."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
