"""Makes this Python look like the lent GPU machine's: the packages that machine lacks cannot be imported (nor found
by importlib.util.find_spec). Put this folder first on PYTHONPATH; spawned children inherit it, so every process of
a run sees the same. tests/test_gpu_image.py runs the core this way; docs/gpu.md lists the machine's packages."""

from __future__ import annotations

import os
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

# A test's own: packages a bare Python lacks too (comma-separated import names), to show what a run does without them
MISSING |= frozenset(filter(None, os.environ.get("GPU_IMAGE_ALSO_MISSING", "").split(",")))

# The same packages as distributions (importlib.metadata's names, normalised: lower case, "-" for "_" and ".").
MISSING_DISTRIBUTIONS = frozenset(
    ("uvicorn", "h11", "httptools", "orjson", "tritonclient", "python-rapidjson", "mlcommons-loadgen")
    + ("import-linter", "grimp", "ruff")
)


def normalised(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class WithoutMissing:
    """sys.meta_path's finders, except that the missing packages are found by none of them: `import` raises
    ModuleNotFoundError, importlib.util.find_spec returns None and importlib.metadata knows no such distribution, as
    on a machine without them."""

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

    def find_distributions(self, *args, **kwargs):
        """importlib.metadata asks every finder on sys.meta_path for distributions: the others' answers, less the
        missing ones."""
        for finder in self.finders:
            find = getattr(finder, "find_distributions", None)
            for distribution in find(*args, **kwargs) if find is not None else ():
                if normalised(distribution.metadata["Name"] or "") not in MISSING_DISTRIBUTIONS:
                    yield distribution


sys.meta_path[:] = [WithoutMissing(list(sys.meta_path))]
