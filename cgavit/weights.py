"""Checkpoint formats (official release, timm, cgavit), safe loading, and the pretrained download.

Every loader goes through :func:`read_state_dict` (no pickle code execution unless asked for) and
:func:`convert_state_dict` (official / timm names to this package's), then :func:`load_checkpoint`
checks every key and shape against the model before copying anything into it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

MIRROR_ENV = "CGAVIT_WEIGHTS_MIRROR"
_WRAPPER_KEYS = ("model_ema", "state_dict_ema", "model", "state_dict", "module")


class CheckpointError(ValueError):
    """A file that is not a usable checkpoint for the model at hand."""


# ----------------------------------------------------------------------------------------- reading
def read_state_dict(path: str | os.PathLike, trust: bool = False, prefer_ema: bool = False) -> dict[str, torch.Tensor]:
    """Read the tensors of a checkpoint file, unwrapping ``{'model': ...}``-style dicts.

    Args:
        path: ``.safetensors`` or a ``torch.save`` file.
        trust: allow arbitrary pickled objects (runs code from the file). Only for files you trust.
        prefer_ema: take the EMA weights when the file holds both.

    Raises:
        CheckpointError: missing, truncated, unsafe or non-checkpoint file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a file")
    if _is_safetensors(path):
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {path} as safetensors (truncated or corrupt?): {err}") from None
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(path, map_location="cpu", weights_only=not trust)
    except Exception as err:
        text = str(err)
        if not trust and ("weights_only" in text or "Unsupported global" in text or "GLOBAL" in text):
            raise CheckpointError(
                f"{path} holds pickled Python objects that could run code when loaded, so it was "
                "refused. If you trust its source, opt in with load_checkpoint(..., trust=True) "
                "(command line: --trust-checkpoint)."
            ) from None
        raise CheckpointError(f"cannot read {path}: truncated or not a PyTorch checkpoint ({text.splitlines()[0]})") from None
    return unwrap_state_dict(obj, path, prefer_ema)


def _is_safetensors(path: Path) -> bool:
    if path.suffix == ".safetensors":
        return True
    with open(path, "rb") as f:
        head = f.read(9)
    # safetensors: 8-byte little-endian header length, then a JSON object
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 100_000_000


def unwrap_state_dict(obj, source="checkpoint", prefer_ema: bool = False) -> dict[str, torch.Tensor]:
    """The tensor dict inside ``obj`` (a state dict, or a dict wrapping one)."""
    if isinstance(obj, Mapping):
        order = _WRAPPER_KEYS if prefer_ema else _WRAPPER_KEYS[2:] + _WRAPPER_KEYS[:2]
        for key in order:
            if isinstance(obj.get(key), Mapping):
                return unwrap_state_dict(obj[key], source, prefer_ema)
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        if tensors and len(tensors) >= len(obj) / 2:
            return {(k[7:] if k.startswith("module.") else k): v for k, v in tensors.items()}
    raise CheckpointError(
        f"{source} holds no state dict (expected tensors, or a dict with one of {list(_WRAPPER_KEYS)}), "
        f"got {type(obj).__name__}"
    )


# -------------------------------------------------------------------------------------- key naming
_BLOCK_PARTS = {"dw0": "pre.0", "ffn0": "pre.1", "dw1": "post.0", "ffn1": "post.1"}
_DOWN_PARTS = {0: "downsample.res1", 1: "downsample.patchmerge", 2: "downsample.res2"}


def detect_format(sd: Mapping[str, torch.Tensor]) -> str:
    """``'official'``, ``'timm'`` or ``'cgavit'``, judged by the key names."""
    keys = list(sd)
    if any(k.startswith(("blocks1.", "patch_embed.0.")) for k in keys):
        return "official"
    if any(re.search(r"\.(dw0|ffn0|dw1|ffn1)\.", k) for k in keys):
        return "timm"
    return "cgavit"


def _rename_parts(key: str) -> str:
    parts = key.split(".")
    parts = [{"c": "conv", "l": "linear"}.get(p, p) if i < len(parts) - 1 else p for i, p in enumerate(parts)]
    return ".".join(_BLOCK_PARTS.get(p, p) for p in parts)


def convert_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an official or timm state dict to this package's names (own format: unchanged)."""
    fmt = detect_format(sd)
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key.endswith("attention_bias_idxs"):
            continue  # derived from the window; rebuilt by the model
        if fmt == "official":
            m = re.match(r"patch_embed\.(\d+)\.(.*)", key)
            if m:
                key = f"patch_embed.conv{int(m.group(1)) // 2 + 1}.{m.group(2)}"
            m = re.match(r"blocks(\d)\.(\d+)\.(.*)", key)
            if m:
                stage, idx, rest = int(m.group(1)) - 1, int(m.group(2)), m.group(3)
                if stage == 0:
                    key = f"stages.0.blocks.{idx}.{rest}"
                elif idx < 3:
                    key = f"stages.{stage}.{_DOWN_PARTS[idx]}.{rest}"
                else:
                    key = f"stages.{stage}.blocks.{idx - 3}.{rest}"
            key = _rename_parts(key)
        elif fmt == "timm":
            key = _rename_parts(key)
        out[key] = value
    return out


# ------------------------------------------------------------------------------------------ loading
def resize_bias_table(table: torch.Tensor, window: int) -> torch.Tensor:
    """Resize a ``(heads, w*w)`` relative-position bias table to ``(heads, window*window)`` (bicubic)."""
    heads, n = table.shape
    w = int(round(n**0.5))
    grid = table.reshape(1, heads, w, w).float()
    out = F.interpolate(grid, size=(window, window), mode="bicubic", align_corners=False)
    return out.reshape(heads, window * window).to(table.dtype)


def load_checkpoint(
    model: nn.Module,
    path: str | os.PathLike | Mapping[str, torch.Tensor],
    trust: bool = False,
    prefer_ema: bool = False,
) -> dict[str, list[str]]:
    """Load official, timm or cgavit weights into ``model`` after checking every key and shape.

    A classifier with another number of classes is left as initialised (logged), as fine-tuning
    needs; a distillation head absent on one side is skipped (logged); attention-bias tables for
    another window size are resized bicubically. Any other difference raises before anything is
    copied.

    Returns:
        ``{"skipped": [...], "resized": [...], "missing": [...]}`` key lists.

    Raises:
        CheckpointError: unreadable file, or a mismatch naming the first key and both shapes.
    """
    source = str(path) if not isinstance(path, Mapping) else "state dict"
    raw = dict(path) if isinstance(path, Mapping) else read_state_dict(path, trust=trust, prefer_ema=prefer_ema)
    sd = convert_state_dict(raw)
    target = model.state_dict()
    report: dict[str, list[str]] = {"skipped": [], "resized": [], "missing": []}
    for key in [k for k in sd if k.startswith("head_dist.") and k not in target]:
        report["skipped"].append(key)
        del sd[key]
    head_w = sd.get("head.linear.weight")
    want_w = target.get("head.linear.weight")
    if head_w is not None and (want_w is None or head_w.shape != want_w.shape):
        got = head_w.shape[0]
        for key in [k for k in sd if re.match(r"head(_dist)?\.linear\.", k)]:
            report["skipped"].append(key)
            del sd[key]
        log.info(
            "checkpoint classifier has %d classes, the model %s: classifier left as initialised",
            got, getattr(model, "num_classes", "?"),
        )
    for key, value in list(sd.items()):
        if key not in target:
            raise CheckpointError(
                f"{source}: key {key!r} (shape {tuple(value.shape)}) does not exist in the model; "
                "is it a checkpoint of another architecture?"
            )
        want = target[key].shape
        if value.shape == want:
            continue
        if value.numel() == target[key].numel() and tuple(value.shape) + (1,) * (len(want) - value.ndim) == tuple(want):
            sd[key] = value.reshape(want)  # official files keep some 1x1 conv weights 2-D
        elif key.endswith("attention_biases") and value.ndim == 2 and value.shape[0] == want[0]:
            side = int(round(want[1] ** 0.5))
            sd[key] = resize_bias_table(value, side)
            report["resized"].append(key)
        else:
            raise CheckpointError(
                f"{source}: shape mismatch at {key!r}: checkpoint {tuple(value.shape)}, model {tuple(want)}; "
                "the file is probably for another variant or other dial settings"
            )
    for key in target:
        if key in sd:
            continue
        if key.startswith("head_dist.") or (key.startswith("head.linear.") and "head.linear.weight" in report["skipped"]):
            report["missing"].append(key)
            continue
        raise CheckpointError(
            f"{source}: the model's {key!r} (shape {tuple(target[key].shape)}) is not in the checkpoint; "
            "it is incomplete or for another variant"
        )
    model.load_state_dict(sd, strict=False)
    if report["resized"]:
        log.info("resized %d attention-bias tables to the model's windows", len(report["resized"]))
    if report["missing"]:
        log.info("left as initialised: %s", ", ".join(report["missing"]))
    return report


# ------------------------------------------------------------------------------------------- saving
def atomic_write(path: str | os.PathLike, write) -> Path:
    """Call ``write(tmp_path)`` then rename onto ``path``: a crash never leaves a partial file there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file open()'s usual mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def save_weights(model: nn.Module, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> Path:
    """Save ``model``'s tensors in this package's format (safetensors), atomically.

    The model's config and class count go into the metadata, so :func:`read_metadata` can rebuild it.
    """
    from dataclasses import asdict

    from safetensors.torch import save_file

    meta = {"format": "cgavit"}
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        meta["config"] = json.dumps(asdict(cfg))
        meta["num_classes"] = str(getattr(model, "num_classes", ""))
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """Metadata of a cgavit safetensors file ({} for other files)."""
    path = Path(path)
    if not path.is_file() or not _is_safetensors(path):
        return {}
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


# ----------------------------------------------------------------------------------------- download
def release_url(url: str) -> str:
    """``url``, with its directory replaced by ``$CGAVIT_WEIGHTS_MIRROR`` when that is set."""
    mirror = os.environ.get(MIRROR_ENV)
    return f"{mirror.rstrip('/')}/{url.rsplit('/', 1)[-1]}" if mirror else url


def download_release(url: str, progress: bool = True) -> Path:
    """Fetch a release file into ``<torch hub dir>/checkpoints`` (once) and return its path."""
    url = release_url(url)
    dst = Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]
    if dst.is_file() and dst.stat().st_size > 0:
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s to %s", url, dst)
    try:
        torch.hub.download_url_to_file(url, str(dst), progress=progress)  # writes a temp file, then renames
    except Exception as err:
        raise CheckpointError(
            f"could not download {url} ({err}). Download it by hand and pass checkpoint_path=, or set "
            f"{MIRROR_ENV} to a folder URL that serves it"
        ) from None
    return dst
