"""Makes this Python look like the lent GPU machine's: the packages that machine lacks cannot be imported (nor found
by importlib.util.find_spec). Put this folder first on PYTHONPATH; spawned children inherit it, so every process of
a run sees the same. tests/test_gpu_image.py runs the core this way; docs/gpu.md lists the machine's packages."""

from __future__ import annotations

import sys

# Top-level modules of the packages missing on the GPU machine: the network door's (uvicorn, its h11, httptools,
# orjson, tritonclient and its rapidjson), MLPerf LoadGen (mlcommons-loadgen), and the linters (import-linter, ruff).
MISSING = frozenset(
    (
        "uvicorn",
        "h11",
        "httptools",
        "orjson",
        "tritonclient",
        "rapidjson",
        "mlperf_loadgen",
        "importlinter",
        "grimp",
        "ruff",
    )
)


class WithoutMissing:
    """sys.meta_path's finders, except that the missing packages are found by none of them: `import` raises
    ModuleNotFoundError and importlib.util.find_spec returns None, as on a machine without them."""

    def __init__(self, finders: list) -> None:
        self.finders = finders

    def find_spec(self, name: str, path=None, target=None):
        if name.partition(".")[0] in MISSING:
            return None
        for finder in self.finders:
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec
        return None


sys.meta_path[:] = [WithoutMissing(list(sys.meta_path))]
