"""Exports the tiny encoder (examples/tiny_encoder.py) the two ways PyTorch deploys a model, for server.py to serve:

    python -m examples.export_tiny_encoder --out examples/build
      examples/build/tiny_encoder.pt2        torch.export program (torch.export.save), dynamic batch dimension
      examples/build/tiny_encoder_aoti.pt2   the same program compiled by AOTInductor (aoti_compile_and_package)

Both keep every dimension but the batch static (the server generates inputs of one shape per input) and let the
batch take 1 to --max_batch rows, so dynamic batching (--max_batch_size) can serve them. AOTInductor compiles C++:
it needs a C++ compiler, and takes tens of seconds on a CPU.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from examples.tiny_encoder import make_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="examples/build", help="folder of the two .pt2 files (default examples/build)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--depth", type=int, default=2, help="encoder layers (default 2)")
    parser.add_argument("--max_batch", type=int, default=256, help="largest batch the programs take (default 256)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where the AOTInductor package runs")
    parser.add_argument("--no-aoti", dest="aoti", action="store_false", help="export the program only")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.depth < 1 or args.max_batch < 2:
        parser.error("--tokens and --depth must be at least 1, --max_batch at least 2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    model = make_model(depth=args.depth).eval().to(device)
    ids = torch.randint(0, 1000, (2, args.tokens), device=device)
    mask = torch.ones(2, args.tokens, dtype=torch.int64, device=device)
    batch = torch.export.Dim("batch", min=1, max=args.max_batch)
    with torch.no_grad():
        program = torch.export.export(model, (ids, mask), dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(program, out / "tiny_encoder.pt2")
    print(f"wrote {out / 'tiny_encoder.pt2'} (inputs ids and mask, int64 [batch, {args.tokens}])")
    if args.aoti:
        start_s = time.perf_counter()
        torch._inductor.aoti_compile_and_package(program, package_path=str(out / "tiny_encoder_aoti.pt2"))
        print(f"wrote {out / 'tiny_encoder_aoti.pt2'} (AOTInductor, {time.perf_counter() - start_s:.0f} s to compile)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
