"""Untrusted metadata is validated against a schema with bounds before anything is allocated."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import cgavit
from cgavit.io import CheckpointError
from cgavit.schema import WeightsMeta
from cgavit.variants import CONFIG_LIMITS
from cgavit.weights import read_weights_meta, save_weights

SMALL = dict(embed_dim=(16, 32, 48), depth=(1, 1, 1), num_heads=(2, 2, 2), kernels=(3, 3))


@pytest.fixture(scope="module")
def tensors():
    model = cgavit.create_model("m0", num_classes=3, **SMALL)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def _write(tmp_path, tensors, meta: dict):
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={k: str(v) for k, v in meta.items()})
    return path


def test_a_valid_record_round_trips(tmp_path):
    model = cgavit.create_model("m0", num_classes=3, **SMALL)
    meta = WeightsMeta("efficientvit_m0", model.cfg, 3, img_size=96, crop_pct=0.9, class_names=("a", "b", "c"),
                       extra={"epoch": "4"})
    got = read_weights_meta(save_weights(model, tmp_path / "w.safetensors", meta))
    assert got.config == model.cfg and got.class_names == ("a", "b", "c") and got.img_size == 96
    assert got.extra == {"epoch": "4"} and cgavit.create_model("m0", num_classes=3, **got.dials()).cfg == model.cfg


@pytest.mark.parametrize(
    "change, words",
    [
        ({"num_classes": "2000000"}, "num_classes"),
        ({"num_classes": "3", "class_names": json.dumps(["a", "b"])}, "class names"),
        ({"img_size": "100000"}, "img_size"),
        ({"img_size": "-5"}, "img_size"),
        ({"crop_pct": "0.001"}, "crop_pct"),
        ({"crop_pct": "nan"}, "crop_pct"),
        ({"interpolation": "lanczos9"}, "interpolation"),
        ({"global_pool": "max"}, "global_pool must be 'avg'"),
        ({"global_pool": ""}, "global_pool must be 'avg', or '' for a network without a classifier"),  # 3 classes
        ({"mean": json.dumps([0.5, 0.5])}, "mean"),
        ({"std": json.dumps([0, 1, 1])}, "std"),
        ({"config": json.dumps({"embed_dim": [4096, 4096, 4096], "depth": [1, 1, 1], "num_heads": [2, 2, 2]})}, "embed_dim"),
        ({"config": json.dumps({"checkpoint_path": "/etc/passwd"})}, "unknown keys"),
        ({"config": "{not json"}, "not valid JSON"),
        ({"config": json.dumps({"embed_dim": [24, 32, 48], "depth": [1, 1, 1], "num_heads": [2, 2, 2],
                                "kernels": [3, 3]})}, "disagrees"),
    ],
)
def test_hostile_metadata_is_refused_before_building(tmp_path, tensors, change, words):
    model = cgavit.create_model("m0", num_classes=3, **SMALL)
    good = save_weights(model, tmp_path / "good.safetensors")
    meta = dict(read_weights_meta(good).to_strings(), **change)
    path = _write(tmp_path, tensors, meta)
    with pytest.raises(CheckpointError, match=words):
        read_weights_meta(path)


def test_dials_of_the_older_layout_cannot_name_other_arguments(tmp_path, tensors):
    for dials in ({"pretrained": True}, {"checkpoint_path": "x.pt"}, {"embed_dim": [4096, 4096, 4096]}):
        path = _write(tmp_path, tensors, {"format": "cgavit", "model": "efficientvit_m0", "dials": json.dumps(dials)})
        with pytest.raises(CheckpointError):
            read_weights_meta(path)


def test_config_limits_hold_in_create_model():
    for name, (lo, hi) in CONFIG_LIMITS.items():
        value = hi + 1 if name not in ("kernels",) else (hi + 2, hi + 2)
        with pytest.raises(ValueError, match=name):
            cgavit.create_model("m0", **{name: value})


_text = st.one_of(st.text(max_size=12), st.integers(-10**12, 10**12).map(str), st.floats(allow_nan=True).map(str),
                  st.lists(st.floats(-10, 10), max_size=4).map(json.dumps), st.just("True"), st.just("[]"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["num_classes", "img_size", "crop_pct", "interpolation", "mean", "std",
                                        "class_names", "distillation", "config", "dials", "model", "epoch"]),
                       _text, max_size=6))
def test_any_metadata_gives_a_record_or_a_checkpoint_error(tmp_path, tensors, fields):
    meta = {"format": "cgavit", "model": "efficientvit_m0", **fields}
    path = _write(tmp_path, tensors, meta)
    try:
        got = read_weights_meta(path)
    except CheckpointError:
        return
    assert got is None or (1 <= got.num_classes <= 100_000 and 32 <= got.img_size <= 4096)
