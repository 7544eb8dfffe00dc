"""Model building: random weights by seed, checkpoints loaded through the meta device, clear refusals."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torchvision

from serverbench.backend.models import IdentityModel, build_model, checkpoint_filenames, is_known_model
from tests.helpers import RunsCode

CPU = torch.device("cpu")


def _save_resnet18(path: Path, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    state = torchvision.models.resnet18(weights=None).state_dict()
    torch.save(state, path)
    return state


def test_checkpoint_weights_are_the_ones_served(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    state = _save_resnet18(path, seed=123)
    built = build_model("resnet18", CPU, seed=0, checkpoint=str(path))
    assert built.torch_load_time_s is not None and built.torch_load_time_s >= 0
    served = built.module.state_dict()
    assert served.keys() == state.keys()
    assert all(torch.equal(served[k], state[k]) for k in state)
    assert not any(p.is_meta for p in built.module.parameters())
    assert not built.module.training


def test_random_weights_follow_the_seed(tmp_path: Path) -> None:
    a = build_model("resnet18", CPU, seed=7, checkpoint=None).module
    b = build_model("resnet18", CPU, seed=7, checkpoint=None).module
    c = build_model("resnet18", CPU, seed=8, checkpoint=None).module
    assert torch.equal(a.conv1.weight, b.conv1.weight)
    assert not torch.equal(a.conv1.weight, c.conv1.weight)


def test_checkpoint_for_another_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    _save_resnet18(path, seed=0)
    with pytest.raises(ValueError, match="does not fit model resnet34"):
        build_model("resnet34", CPU, seed=0, checkpoint=str(path))


def test_corrupt_checkpoint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="is a text file .* not a torch.save state dict"):
        build_model("resnet18", CPU, seed=0, checkpoint=str(path))


def test_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil.pth"
    torch.save({"conv1.weight": RunsCode()}, path, pickle_module=pickle)
    with pytest.raises(ValueError, match="cannot load checkpoint"):
        build_model("resnet18", CPU, seed=0, checkpoint=str(path))


def test_identity_returns_a_small_per_sample_result() -> None:
    images = torch.randn(5, 3, 8, 8)
    out = IdentityModel()(images)
    assert out.shape == (5, 1, 1, 1) and out.dtype == torch.float32
    assert torch.allclose(out.flatten(), images.sum(dim=(1, 2, 3)), rtol=1e-5, atol=1e-4)
    # Narrower inputs (--precision bf16, a uint8 wire) are summed in float32, not in their own dtype.
    pixels = torch.full((2, 3, 8, 8), 255, dtype=torch.uint8)
    assert IdentityModel()(pixels).flatten().tolist() == [255.0 * 3 * 8 * 8] * 2
    assert IdentityModel()(images.bfloat16()).dtype == torch.float32


def test_model_names_and_checkpoint_files() -> None:
    assert is_known_model("resnet18") and is_known_model("identity") and is_known_model("vit_b_16")
    assert not is_known_model("resnet9000") and not is_known_model("fasterrcnn_resnet50_fpn")
    assert "resnet18-f37072fd.pth" in checkpoint_filenames("resnet18")
    assert checkpoint_filenames("identity") == []


def test_16_bit_float_outputs_travel_as_float32_and_float64_keeps_its_range() -> None:
    """numpy has no bfloat16, so 16-bit float leaves are widened; a float64 leaf stays float64 (narrowed, 1e300 was
    inf and 1 + 1e-12 was 1.0, and the door advertised FP32), integers and bools as they are."""
    from serverbench.backend.outputs import output_leaves

    wide = torch.tensor([[1e300, 1 + 1e-12]], dtype=torch.float64)
    (kept,) = output_leaves(wide)
    assert kept.dtype == torch.float64 and kept[0, 0].item() == 1e300 and kept[0, 1].item() == 1 + 1e-12
    mixed = {"h": torch.ones(1, 2, dtype=torch.bfloat16), "x": wide, "n": torch.ones(1, dtype=torch.int8)}
    leaves = output_leaves(mixed)
    assert [leaf.dtype for leaf in leaves] == [torch.float32, torch.float64, torch.int8]  # the dict's order
    assert output_leaves(torch.ones(1, 2, dtype=torch.float16))[0].dtype == torch.float32
