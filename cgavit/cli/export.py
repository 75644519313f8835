"""``cgavit export``: a model to ONNX (batch dynamic), checked with ONNX Runtime against PyTorch."""

from __future__ import annotations

import argparse

import torch

from ..deploy import OnnxModule, export_onnx, fuse
from ..factory import create_model
from ..testing import rel_err
from .common import add_dial_args, dials_from_args, image_size

#: Largest relative error of ONNX Runtime's logits against PyTorch's that the check calls ok.
EXPORT_TOLERANCE = 1e-4


def run(args: argparse.Namespace) -> int:
    size = image_size(args.img_size)
    if args.format != "onnx":
        raise ValueError(f"only --format onnx is supported, got {args.format}")
    model = create_model(args.model, checkpoint_path=args.checkpoint, img_size=size, **dials_from_args(args))
    if args.dynamic_size:
        raise ValueError(
            "--dynamic-size is not supported: the window attention pads and partitions each stage "
            "differently for different image sizes, so one ONNX graph cannot serve them all; export "
            "once per size with --img-size H W"
        )
    out = export_onnx(model, args.output, size)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB), batch dynamic, size {size[0]}x{size[1]} fixed")
    ort_model = OnnxModule(out)
    fused = fuse(model)
    for batch in (1, 16):
        x = torch.randn(batch, 3, *size)
        with torch.no_grad():
            err = rel_err(ort_model(x), fused(x))
        verdict = "ok" if err <= EXPORT_TOLERANCE else "TOO LARGE"
        print(f"ONNX Runtime vs PyTorch, batch {batch}: relative error {err:.1e} {verdict}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a model to ONNX (batch dynamic) and check ONNX Runtime against PyTorch",
        description="Fuse BatchNorm, export to ONNX with a dynamic batch dimension, then run ONNX Runtime "
        "at batch 1 and 16 and print its relative error against PyTorch (must be <= 1e-4).",
    )
    p.add_argument("--model", required=True, help="variant name, e.g. efficientvit_m0")
    p.add_argument("--checkpoint", help="weights file (official, timm or cgavit format); default random weights")
    p.add_argument("--format", default="onnx", choices=["onnx"], help="export format (default onnx)")
    p.add_argument("--output", required=True, help="output file, e.g. m0.onnx (written atomically)")
    p.add_argument("--img-size", type=int, nargs="+", default=[224], metavar="N", help="input size N or H W (default 224)")
    p.add_argument("--dynamic-size", action="store_true", help="not supported (explains why): export once per size")
    add_dial_args(p)
    p.set_defaults(func=run)
