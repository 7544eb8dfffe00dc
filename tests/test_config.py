"""Every invalid value ends with one clear line on stderr and exit status 2, before any process starts;
valid values resolve to what the row will report."""

from __future__ import annotations

import dataclasses
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, make_config

import server
from serverbench.config.build import build_config
from serverbench.config.inputs import DTYPES
from serverbench.system import process
from serverbench.transport.tensors import TORCH_DTYPES
from tests.helpers import RunsCode, exit_code

BAD_INPUTS = [
    (["--batch_size", "0"], "--batch_size 0"),
    (["--batch_size", "3", "--max_batch_size", "5"], "holds only one request of --batch_size 3"),
    (
        ["--batch_size", "1", "--max_batch_size", "4", "--max_queue_delay_ms", "10000", "--timeout_s", "3"],
        "longer than",
    ),
    (["--experiment", "résumé"], "use ASCII letters"),
    (["--batch_size", "-4"], "--batch_size -4"),
    (["--num_iters", "0"], "--num_iters 0"),
    (["--num_workers", "0"], "--num_workers 0"),
    (["--num_workers", "100000"], "--num_workers 100000: must be at most 1024"),
    (["--design", "serial", "--num_workers", "3"], "exactly one prediction worker"),
    (["--image_size", "0"], "--image_size 0"),
    (["--design", "batched"], "invalid choice"),
    (["--model", "resnet9000"], "not a torchvision classification model"),
    (["--device", "tpu"], "expected auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:99"], "cuda:99"),
    (["--checkpoint", "/nonexistent/resnet18.pth"], "no such file"),
    (["--model", "identity", "--checkpoint", __file__], "no weights"),
    (["--model_dir", "/nonexistent/folder"], "no such folder"),
    (["--output_file", "../escape.csv"], "plain file name"),
    (["--gpu_poll_ms", "0"], "--gpu_poll_ms 0"),
    (["--max_inflight", "0"], "--max_inflight 0"),
    (["--timeout_s", "0"], "must be positive"),
    (["--batch_size", "many"], "invalid int value"),
    (["--batch_size", "100000000"], "the request pool and the ring (--ring_slots 4) need"),
    (["--image_size", "1000000"], "of memory available now"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--transport", "pigeon"], "invalid choice"),
    (["--ring_slots", "0"], "--ring_slots 0"),
    # Dynamic batching.
    (["--max_batch_size", "32"], "must be more than --batch_size 32"),
    (["--max_queue_delay_ms", "5"], "applies with --max_batch_size only"),
    (["--max_batch_size", "64", "--max_queue_delay_ms", "-1"], "--max_queue_delay_ms -1: must be between 0"),
    (["--max_batch_size", "64", "--max_queue_delay_ms", "nan"], "--max_queue_delay_ms nan"),
    (["--max_batch_size", "1e9"], "invalid int value"),
    (["--batch_size", "1", "--max_batch_size", "100000"], "--max_batch_size 100000: must be at most 65536"),
    (["--batch_size", "1", "--max_batch_size", "5000"], "at most 4096 requests can be batched"),
    (["--ring_slots", "10000"], "--ring_slots 10000: must be at most 8192"),
    (["--batch_size", "1", "--max_batch_size", "16", "--ring_slots", "4"], "gathers 16 requests, each holding a slot"),
    (
        ["--batch_size", "1", "--max_batch_size", "16", "--transport", "queue", "--max_queued_requests", "8"],
        "gathers 16 requests from the queue",
    ),
    (["--wire_dtype", "int4"], "invalid choice"),
    (["--compile_mode", "max-autotune"], "applies with --compile only"),
    (["--device", "cpu", "--precision", "tf32"], "TF32 is a CUDA tensor-core format"),
    # Values that used to pass validation and then crash the run (issue 16).
    (["--timeout_s", "inf"], "--timeout_s inf: must be at most 604800"),
    (["--timeout_s", "1e20"], "--timeout_s 1e+20: must be at most 604800"),
    (["--warmup_timeout_s", "nan"], "must be positive"),
    (["--load", "poisson", "--rate", "inf"], "--rate inf: must be at most 1e+06"),
    (["--load", "poisson", "--rate", "1e308"], "--rate 1e+308: must be at most 1e+06"),
    (["--load", "poisson", "--rate", "1e6", "--duration_s", "100000"], "1e+11 requests to schedule, more than"),
    (["--load", "poisson", "--rate", "50", "--burstiness", "1e-9"], "--burstiness 1e-09: must be between"),
    (["--load", "poisson", "--rate", "50", "--burstiness", "inf"], "--burstiness inf: must be between"),
    (["--load", "poisson", "--rate", "50", "--burstiness", "nan"], "--burstiness nan: must be between"),
    (["--seed", "1180591620717411303424"], "seeds are 64-bit"),
    (["--seed", "-1"], "--seed -1: must be at least 0"),
    (["--transport", "queue", "--max_queued_requests", "1099511627776"], "the largest semaphore count"),
    (["--duration_s", "inf"], "--duration_s inf: must be at most 604800"),
    (["--duration_s", "nan"], "--duration_s nan: must not be negative (a number of seconds)"),
    (["--inject_delay_ms", "-1"], "--inject_delay_ms -1: must not be negative (a number of milliseconds)"),
    (["--design", "serial", "--planted_delay_us", "-1"], "--planted_delay_us -1.0: must be at least 0"),
    (["--design", "serial", "--planted_delay_us", "nan"], "--planted_delay_us nan: must be at least 0"),
    (
        ["--planted_delay_us", "5"],
        "--planted_delay_us applies to --design serial only (this run is --design pipelined)",
    ),
    # An image size the model cannot take: tried on the meta device before any process starts.
    (
        ["--model", "vit_b_16"],
        "--model vit_b_16 cannot take 250x250 images (Wrong image height! Expected 224 but got "
        "250!); of the sizes tried it takes 224x224",
    ),
    (["--model", "vit_b_16", "--image_size", "32"], "of the sizes tried it takes 224x224"),
    (["--model", "inception_v3", "--image_size", "32"], "it takes 75x75 or larger (of the sizes tried)"),
    # Stability windows and the ceiling (issue 14).
    (["--window_s", "2"], "--window_s applies with --stability_pct only"),
    (["--max_windows", "5"], "--max_windows applies with --stability_pct only"),
    (["--stability_pct", "0"], "--stability_pct 0: must be above 0 and at most 100"),
    (["--stability_pct", "nan"], "--stability_pct nan: must be above 0"),
    (["--stability_pct", "5", "--max_windows", "2"], "--max_windows 2: must be at least 3"),
    (["--stability_pct", "5", "--window_s", "inf"], "--window_s inf: must be at most 604800"),
    (["--stability_pct", "5", "--window_requests", "0"], "--window_requests 0: must be at least 1"),
    (["--ceiling_s", "0"], "--ceiling_s 0: must be positive and at most 600"),
    (["--intra_op_threads", "0"], "--intra_op_threads 0: must be at least 1"),
    (["--intra_op_threads", "two"], "--intra_op_threads: a whole number of threads, or auto; not 'two'"),
    (["--intra_op_threads", "100000"], "--intra_op_threads 100000: must be at most 4096"),
    # Combinations that were accepted and ignored.
    (["--burstiness", "0.5"], "--burstiness applies to --load poisson only"),
    (["--load", "closed", "--concurrency", "2", "--burstiness", "2"], "--burstiness applies to --load poisson"),
    (["--find_peak", "--slo_ms", "100", "--rate", "5"], "--find_peak searches the rate itself"),
    (["--find_peak", "--slo_ms", "100", "--load", "closed", "--concurrency", "2"], "drop --load closed"),
]
if not torch.cuda.is_available():
    BAD_INPUTS.append((["--device", "cuda"], "no CUDA GPU is available"))


@pytest.mark.parametrize("argv,expected", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], expected: str, tmp_path: Path, capsys, monkeypatch) -> None:
    started = []
    monkeypatch.setattr(server, "run_benchmark", lambda cfg: started.append(cfg))
    assert exit_code([*argv, "--results_dir", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if "server[" not in line]  # log lines are not the error
    assert len(err) == 1, err
    assert expected in err[0]
    assert err[0].startswith("server.py: error: ")
    assert started == []  # no process was started
    assert not (tmp_path / "results" / "output.csv").exists()


def _resnet18_checkpoint(path: Path) -> Path:
    import torchvision

    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    return path


def test_bad_checkpoints_are_refused_before_any_process(tmp_path: Path, capsys, monkeypatch) -> None:
    import pickle

    started = []
    monkeypatch.setattr(server, "run_benchmark", lambda cfg: started.append(cfg))
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"\x80\x04 definitely not a checkpoint")
    evil = tmp_path / "evil.pth"
    torch.save({"conv1.weight": RunsCode()}, evil, pickle_module=pickle)
    other = _resnet18_checkpoint(tmp_path / "resnet18.pth")
    empty = tmp_path / "empty.pth"
    empty.write_bytes(b"")
    text = tmp_path / "notes.pth"
    text.write_text("these are not weights\n")
    cases = [
        (corrupt, "resnet18", "cannot load checkpoint"),
        (evil, "resnet18", "cannot load checkpoint"),
        (empty, "resnet18", "is empty (0 bytes)"),
        (text, "resnet18", "is a text file"),
        (other, "resnet34", "does not fit model resnet34: "),
        (other, "resnet34", "key(s) missing (layer1.2.conv1.weight;"),
        (
            other,
            "resnet50",
            "with another shape (layer1.0.conv1.weight [64, 64, 3, 3] in the file, [64, 64, 1, 1] in the model",
        ),
    ]
    for path, model, expected in cases:
        assert exit_code(["--model", model, "--checkpoint", str(path), "--results_dir", str(tmp_path)]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "server[" not in line]
        assert len(err) == 1 and expected in err[0], err
    assert started == []


def test_bad_input_from_the_command_line_exits_2_fast(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "server.py", "--batch_size", "0", "--results_dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "server.py: error: --batch_size 0: must be at least 1"
    assert proc.stdout == ""


def test_an_empty_results_dir_is_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert exit_code(["--results_dir", ""]) == 2
    assert "--results_dir ''" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_unwritable_results_dir_is_refused(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # nobody, root included, can create a folder inside a regular file
    assert exit_code(["--results_dir", str(blocker / "results")]) == 2
    assert "--results_dir" in capsys.readouterr().err


def _config(tmp_path: Path, *argv: str):
    return make_config([*argv, "--results_dir", str(tmp_path)])


def test_defaults_resolve_like_the_reference(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "--model_dir", str(tmp_path))
    assert (cfg.num_iters, cfg.batch_size, cfg.compile, cfg.output_file) == (100, 32, False, "output.csv")
    assert (cfg.design, cfg.num_workers, cfg.model, cfg.image_size) == ("pipelined", 2, "resnet18", 250)
    assert cfg.device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert cfg.output_path == tmp_path / "output.csv"
    assert cfg.checkpoint is None


def test_serial_and_threaded_have_one_worker(tmp_path: Path) -> None:
    assert _config(tmp_path, "--design", "serial").num_workers == 1
    assert _config(tmp_path, "--design", "threaded", "--num_workers", "1").num_workers == 1


def test_model_dir_with_the_torchvision_checkpoint_file_is_found(tmp_path: Path) -> None:
    _resnet18_checkpoint(tmp_path / "resnet18-f37072fd.pth")
    assert _config(tmp_path, "--model_dir", str(tmp_path)).checkpoint == str(tmp_path / "resnet18-f37072fd.pth")


def test_the_input_dtype_table_names_torchs_own_dtypes_with_their_sizes_and_ranges() -> None:
    """DTYPES (the configuration's, without torch) is the one table: each name is torch's own, as wide and as
    floating as torch's, its range torch's; the request pool makes exactly those."""
    assert TORCH_DTYPES == {name: getattr(torch, name) for name in DTYPES}
    for name, dtype in DTYPES.items():
        torch_dtype = getattr(torch, name)
        assert (torch_dtype.itemsize, torch_dtype.is_floating_point) == (dtype.nbytes, dtype.is_float), name
        if dtype.smallest is not None and torch_dtype is not torch.bool:
            info = torch.finfo(torch_dtype) if dtype.is_float else torch.iinfo(torch_dtype)
            assert (info.min, info.max) == (dtype.smallest, dtype.largest), name


def test_config_is_frozen(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch_size = 64  # type: ignore[misc]


def test_cuda_graph_compile_modes_are_refused_across_threads(tmp_path: Path) -> None:
    """CUDA graphs captured on the compiling thread must not be replayed from serving threads."""
    from serverbench.config.flags import ConfigError
    from serverbench.launch.preflight import _check_model_options

    def args(*argv: str):
        return build_config(server.build_parser().parse_args(["--compile", *argv]))

    for mode in ("reduce-overhead", "max-autotune"):
        for design in ("threaded", "pipelined"):
            with pytest.raises(ConfigError, match="not safe across"):
                _check_model_options(args("--compile_mode", mode, "--design", design), "cuda:0")
        _check_model_options(args("--compile_mode", mode, "--design", "serial"), "cuda:0")  # one thread: allowed
        _check_model_options(args("--compile_mode", mode, "--design", "pipelined"), "cpu")  # no CUDA graphs
    _check_model_options(args("--compile_mode", "max-autotune-no-cudagraphs", "--design", "pipelined"), "cuda:0")


def test_a_planted_delay_is_refused_on_a_gpu_whose_forward_would_run_on_meanwhile() -> None:
    from serverbench.config.flags import ConfigError
    from serverbench.launch.preflight import _check_model_options

    cfg = build_config(server.build_parser().parse_args(["--planted_delay_us", "50", "--design", "serial"]))
    with pytest.raises(ConfigError, match="--planted_delay_us busy-waits the host after each forward"):
        _check_model_options(cfg, "cuda:0")
    _check_model_options(cfg, "cpu")  # the CPU's forward is the thread's own work: the wait adds to it


def test_performance_options_resolve_into_the_config(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert (cfg.transport, cfg.wire_dtype, cfg.precision, cfg.channels_last, cfg.ceiling) == (
        "shm",
        "float32",
        "default",
        False,
        True,
    )
    cfg = _config(
        tmp_path,
        "--transport",
        "queue",
        "--wire_dtype",
        "uint8",
        "--precision",
        "bf16",
        "--channels_last",
        "--no-ceiling",
        "--batch_size",
        "4",
        "--image_size",
        "10",
    )
    assert (cfg.transport, cfg.wire_dtype, cfg.precision, cfg.channels_last, cfg.ceiling) == (
        "queue",
        "uint8",
        "bf16",
        True,
        False,
    )
    assert cfg.request_bytes == 4 * 3 * 10 * 10  # one byte per pixel value on the wire
    # --intra_op_threads: auto (the default, spelled or not) is None in the config, the backend's rule decides.
    assert _config(tmp_path).intra_op_threads is None
    assert _config(tmp_path, "--intra_op_threads", "auto").intra_op_threads is None
    assert _config(tmp_path, "--intra_op_threads", "3").intra_op_threads == 3


def test_dynamic_batching_makes_room_for_two_formed_batches_in_transit(tmp_path: Path) -> None:
    plain = _config(tmp_path, "--device", "cpu")
    assert (plain.ring_slots, plain.max_queued_requests, plain.batching, plain.formed_rows) == (4, 16, False, 32)
    batched = _config(tmp_path, "--device", "cpu", "--batch_size", "3", "--max_batch_size", "32", "--image_size", "600")
    assert (batched.ring_slots, batched.max_queued_requests) == (20, 20)  # 10 whole requests per formed batch
    small = _config(tmp_path, "--device", "cpu", "--batch_size", "1", "--image_size", "16")
    assert small.ring_slots == 64  # one-image requests: room to write ahead (64 MiB would hold far more)
    assert (batched.formed_rows, batched.max_queue_delay_ms, batched.batching) == (30, 0.0, True)
    assert batched.verify_tolerance > 0 == plain.verify_tolerance  # rows of a formed batch round differently
    chosen = _config(tmp_path, "--device", "cpu", "--batch_size", "1", "--max_batch_size", "4", "--ring_slots", "5")
    assert chosen.ring_slots == 5


def test_the_decoding_is_compiled_with_the_model_unless_told_otherwise(tmp_path: Path) -> None:
    assert _config(tmp_path, "--device", "cpu").compile_decode is False
    assert _config(tmp_path, "--device", "cpu", "--compile").compile_decode is True
    alone = _config(tmp_path, "--device", "cpu", "--compile_decode")
    assert (alone.compile, alone.compile_decode) == (False, True)
    assert _config(tmp_path, "--device", "cpu", "--compile", "--no-compile_decode").compile_decode is False


@pytest.mark.parametrize("name", [".", ".."])
def test_dot_names_are_not_output_files(tmp_path: Path, capsys, name: str) -> None:
    assert exit_code(["--output_file", name, "--results_dir", str(tmp_path)]) == 2
    assert "expected a plain file name" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.lock"))


def test_a_results_csv_that_is_a_folder_is_refused_before_the_run(tmp_path: Path, capsys) -> None:
    (tmp_path / "out.csv").mkdir()
    assert exit_code(["--output_file", "out.csv", "--results_dir", str(tmp_path)]) == 2
    assert "is a folder, not a CSV file" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files: nothing to refuse")
def test_a_read_only_results_csv_is_refused_before_the_run(tmp_path: Path, capsys) -> None:
    path = tmp_path / "out.csv"
    path.write_text("a,b\n")
    path.chmod(0o444)
    assert exit_code(["--output_file", "out.csv", "--results_dir", str(tmp_path)]) == 2
    assert "is not writable" in capsys.readouterr().err


def _resources(monkeypatch, memory=64 * 2**30, shm=32 * 2**30, open_files=1024, disk=100 * 2**30) -> None:
    from serverbench.launch import preflight as config

    monkeypatch.setattr(config, "_available_memory_bytes", lambda: memory)
    monkeypatch.setattr(config, "_free_bytes", lambda folder: shm if folder == config.SHM_FOLDER else disk)
    monkeypatch.setattr(config, "_open_files_limit", lambda: open_files)


@pytest.mark.parametrize(
    "limits,argv,expected",
    [
        (
            {"memory": 2**30},
            ["--batch_size", "256"],  # 4 pool batches + 4 slots of 183.1 MiB
            "need 1.43 GiB, more than the 1.00 GiB of memory available now; lower --batch_size, --image_size, "
            "--request_pool_size or --ring_slots",
        ),
        (
            {"shm": 64 * 2**20},
            ["--batch_size", "256"],  # Docker's default /dev/shm
            "the ring (--ring_slots 4) need 0.72 GiB of shared memory, and /dev/shm has 64.0 MiB free; "
            "lower --ring_slots",
        ),
        (
            {"shm": 64 * 2**20},
            ["--batch_size", "256", "--transport", "http"],  # the door in its own process writes the ring
            "the ring (--ring_slots 4) need 0.72 GiB of shared memory, and /dev/shm has 64.0 MiB free; "
            "lower --ring_slots",
        ),
        (
            {"memory": 2**29, "shm": 64 * 2**20},
            ["--batch_size", "256", "--transport", "grpc", "--door", "inline"],  # no shared memory: no ring
            "the request pool needs 0.72 GiB, more than the 0.50 GiB of memory available now; lower --batch_size, "
            "--image_size or --request_pool_size",
        ),
        (
            {"shm": 64 * 2**20},
            ["--batch_size", "64", "--transport", "queue"],
            "requests in transit (--max_queued_requests + --max_inflight = 24) need 1.07 GiB of shared memory",
        ),
        (
            {"open_files": 256},
            ["--transport", "queue", "--max_queued_requests", "64"],
            "about 328 open files are needed and the limit is 256; lower --max_queued_requests, or raise the limit",
        ),
        (
            {"open_files": 512},
            ["--transport", "http", "--load", "closed", "--concurrency", "300"],  # a connection each, in both
            "--load closed has 300 out at once (--concurrency): about 556 open files in the frontend and in the door, "
            "over the limit of 512",
        ),
        (
            {"open_files": 512},
            ["--transport", "http", "--load", "closed", "--concurrency", "300", "--target", "http://127.0.0.1:9"],
            "--load closed has 300 out at once (--concurrency): about 556 open files",
        ),
        ({"disk": 2**19}, [], "the results need about 1.0 MiB and the disk has 0.5 MiB free"),
    ],
)
def test_a_resource_the_run_lacks_is_named_before_any_process_starts(
    tmp_path: Path, capsys, monkeypatch, limits: dict, argv: list[str], expected: str
) -> None:
    _resources(monkeypatch, **limits)
    started = []
    monkeypatch.setattr(server, "run_benchmark", lambda cfg: started.append(cfg))
    assert exit_code([*argv, "--results_dir", str(tmp_path / "results")]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "server[" not in line]
    assert len(err) == 1 and expected in err[0], err
    assert started == []


def test_enough_of_everything_passes(tmp_path: Path, monkeypatch) -> None:
    _resources(monkeypatch)
    assert _config(tmp_path, "--batch_size", "256", "--transport", "queue").batch_size == 256
    # gRPC carries every request on one connection; a burst's or an open loop's count in flight is the pace's
    for argv in (["grpc", "--load", "closed", "--concurrency", "5000"], ["http", "--num_iters", "5000"]):
        assert _config(tmp_path, "--transport", *argv).transport == argv[0]


def test_the_server_raises_its_open_files_limit_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
        assert process.raise_open_files_limit() == (hard, hard) == resource.getrlimit(resource.RLIMIT_NOFILE)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_results_dir_on_a_kernel_filesystem_is_refused_by_name(tmp_path: Path, capsys) -> None:
    if not Path("/proc/self").exists():
        pytest.skip("needs Linux's /proc")
    assert exit_code(["--device", "cpu", "--model", "identity", "--results_dir", "/proc/x"]) == 2
    assert "/proc is not on a disk" in capsys.readouterr().err  # not "0.0 MiB free"


def test_a_negative_zero_delay_is_zero(tmp_path: Path) -> None:
    from conftest import make_config

    argv = [
        "--batch_size",
        "1",
        "--max_batch_size",
        "4",
        "--max_queue_delay_ms",
        "-0.0",
        "--results_dir",
        str(tmp_path),
    ]
    cfg = make_config(argv)
    assert str(cfg.max_queue_delay_ms) == "0.0"  # the summary says "0 ms", not "-0 ms"


def test_the_environments_token_is_for_a_door_beyond_loopback_and_a_target_only(monkeypatch) -> None:
    """A token exported in the shell made every loopback door of a bench tool answer 401 to the tool's own
    readiness polls; --auth_token still applies anywhere."""
    from serverbench.launch import preflight as checks

    monkeypatch.setenv("SERVERBENCH_AUTH_TOKEN", "from.the.shell")

    def token(*argv: str) -> str | None:
        return checks._resolve_token(build_config(server.build_parser().parse_args(list(argv)))).auth_token

    assert token("--transport", "http") is None
    assert token("--transport", "http", "--auth_token", "given.here") == "given.here"
    assert token("--transport", "grpc", "--host", "0.0.0.0") == "from.the.shell"
    assert token("--target", "http://10.0.0.1:8000") == "from.the.shell"


def test_a_flag_that_means_nothing_here_is_warned_once_and_the_run_goes_on(tmp_path: Path, capsys) -> None:
    from serverbench.config.build import config_warnings

    args = server.build_parser().parse_args(["--no-ceiling", "--ceiling_s", "5"])
    assert config_warnings(args) == ["--ceiling_s 5 has no effect with --no-ceiling: no ceiling is timed"]
    assert config_warnings(server.build_parser().parse_args(["--ceiling_s", "5"])) == []
    # A door beyond loopback is said as it starts (it was said only in the summary, after a --serve_only door stopped)
    beyond = ["--transport", "http", "--host", "0.0.0.0"]
    [open_door] = config_warnings(server.build_parser().parse_args([*beyond, "--open_to_anyone"]))
    assert open_door.startswith("--host 0.0.0.0 --open_to_anyone: the door listens beyond this machine, with no auth")
    quiet_ones = (["--transport", "http"], ["--transport", "grpc", "--host", "::1"], [*beyond, "--auth_token", "t" * 8])
    for quiet in quiet_ones:
        assert config_warnings(server.build_parser().parse_args(quiet)) == [], quiet


@pytest.mark.parametrize(
    "argv,expected",
    [
        (
            ["--max_batch_size", "4", "--max_queue_delay_ms", "500", "--load", "closed", "--concurrency", "1"],
            "never fills",
        ),
        (["--max_batch_size", "4", "--ring_slots", "4"], "holds at most one formed batch of 4 requests"),
    ],
)
def test_batching_that_can_never_fill_or_overlap_is_warned_with_what_would(argv: list[str], expected: str) -> None:
    from serverbench.config.build import config_warnings

    [warning] = config_warnings(server.build_parser().parse_args(["--batch_size", "1", *argv]))
    assert expected in warning and ("--concurrency 4" in warning or "--ring_slots 8" in warning)
    fitting = ["--concurrency", "4"] if "--concurrency" in argv else ["--ring_slots", "8"]
    assert config_warnings(server.build_parser().parse_args(["--batch_size", "1", *argv, *fitting])) == []
