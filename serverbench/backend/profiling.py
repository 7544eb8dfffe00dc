"""--profile: the PyTorch profiler around the backend's serving, every thread's work in one Chrome trace."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from serverbench.config.options import BenchConfig
from serverbench.device.layer import DeviceLayer
from serverbench.schema.messages import BackendReport

log = logging.getLogger("backend")


def profile_trace_path(cfg: BenchConfig, instance: int = 0) -> Path:
    # The whole config: the trace is named after the run, as its row's files are (folder, file, design, rank).
    stamp = time.strftime("%Y%m%dT%H%M%S")
    rank = "" if cfg.rank is None else f"_rank{cfg.rank.rank}"  # under torchrun the ranks may share a folder
    rank += f"_instance{instance}" if cfg.instances > 1 else ""  # so may the instances, in the same second
    return Path(cfg.results_dir) / f"{Path(cfg.output_file).stem}_{cfg.design}{rank}_{stamp}_trace.json"


@contextlib.contextmanager
def maybe_profile(cfg: BenchConfig, layer: DeviceLayer, report: BackendReport, instance: int = 0) -> Iterator[None]:
    if not cfg.profile:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if layer.is_cuda else [])
    try:  # the profiler is per thread unless told otherwise; the designs' work runs on worker threads
        experimental = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        experimental = None
        log.warning(
            "this torch cannot profile all threads: the trace has the backend's main thread only "
            "(and every CUDA kernel)"
        )
    with profile(activities=activities, experimental_config=experimental) as prof:
        yield
    path = profile_trace_path(cfg, instance)
    prof.export_chrome_trace(str(path))
    report.profile_trace = str(path)
