"""Commands generated from config dataclasses (cgavit/cli/options.py): flags, types, help and defaults come
from the fields; every generated command's help is its field's text; a group whose extra is missing is
still listed and says what to install."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import MISSING, dataclass, field, fields

import pytest

from cgavit.analysis.ablation import AblationConfig
from cgavit.analysis.reports import AnalysisConfig
from cgavit.cli import build_parser
from cgavit.cli.ablate import MEASURE_FIELDS, STUDY_FIELDS, ablation_config
from cgavit.cli.analyze import ANALYSIS_FIELDS, analysis_config
from cgavit.cli.options import add_options, option_values
from cgavit.fields import option


@dataclass
class Toy:
    name: str = option(help="a required name")
    size: int = option(224, "image size in pixels")
    ratio: float | None = option(None, "a ratio (default: worked out)")
    widths: tuple[int, ...] | None = option(None, "widths per stage", sep=",")
    pair: tuple[float, float] = option((0.5, 1.0), "a range", metavar=("MIN", "MAX"))
    seeds: tuple[int, ...] = option((0,), "seeds")
    steps: tuple[int, ...] = option((8, 11), "steps", nargs="*", metavar="STEP")
    mode: str = option("a", "a mode", choices=("a", "b"))
    label: str = option("5%", "a label")
    strict: bool = option(False, "a switch")
    ema: bool = option(True, "on or off")
    bar: bool | None = option(None, "on, off or unset")
    frozen: bool = option(True, "unfreeze", flags=("--train-it",), action="store_false")
    workers: int = option(4, "worker processes", flags=("--workers", "-j"))
    files: tuple[str, ...] = option((), "files", flags=("files",), nargs="*")
    extra: dict = field(default_factory=dict, metadata={"help": "settings"})


def _toy(suppress: bool = False) -> tuple[argparse.ArgumentParser, tuple[str, ...]]:
    p = argparse.ArgumentParser(prog="toy", exit_on_error=False)
    return p, add_options(p, Toy, exclude=("extra",), suppress=suppress)


def test_options_follow_the_fields():
    p, names = _toy()
    assert names == tuple(f.name for f in fields(Toy))[:-1]
    assert Toy(**option_values(p.parse_args(["--name", "x"]), names)) == Toy(name="x")  # the defaults are the dataclass's
    argv = ["--name", "x", "--size", "32", "--ratio", "0.5", "--widths", "16,32", "--pair", "0.1", "0.9", "--seeds", "1",
            "2", "--steps", "--mode", "b", "--strict", "--no-ema", "--bar", "--train-it", "-j", "2", "f1", "f2"]
    assert option_values(p.parse_args(argv), names) == dict(
        name="x", size=32, ratio=0.5, widths=(16, 32), pair=[0.1, 0.9], seeds=[1, 2], steps=[], mode="b", label="5%",
        strict=True, ema=False, bar=True, frozen=False, workers=2, files=["f1", "f2"],
    )
    for bad in ([], ["--name", "x", "--mode", "c"], ["--name", "x", "--size", "big"], ["--name", "x", "--widths", "1,a"]):
        with pytest.raises((argparse.ArgumentError, SystemExit)):
            p.parse_args(bad)


def test_help_is_the_field_text_then_the_dataclass_default():
    p, _ = _toy()
    helps = {a.dest: a.help for a in p._actions}
    assert helps["name"] == "a required name"  # required: no default to show
    assert helps["size"] == "image size in pixels (default: 224)"
    assert helps["ratio"] == "a ratio (default: worked out)"  # None: the text says it
    assert helps["widths"] == "widths per stage"
    assert helps["pair"] == "a range (default: 0.5 1.0)" and helps["steps"] == "steps (default: 8 11)"
    assert helps["seeds"] == "seeds (default: 0)" and helps["mode"] == "a mode (default: a)"
    assert helps["ema"] == "on or off (default: on)" and helps["bar"] == "on, off or unset"
    assert helps["strict"] == "a switch" and helps["frozen"] == "unfreeze" and helps["files"] == "files"
    text = p.format_help()  # argparse formats help with %: a default holding one must not break it
    assert "(default: 5%)" in text and "-j WORKERS" in text and "--ema, --no-ema" in text and "[files ...]" in text


def test_suppressed_defaults_leave_out_what_was_not_typed():
    p, names = _toy(suppress=True)
    assert option_values(p.parse_args(["--name", "x", "-j", "0"]), names) == {"name": "x", "workers": 0}
    assert {a.dest: a.help for a in p._actions}["size"] == "image size in pixels (default: 224)"  # still shown


def test_fields_without_a_spelling_are_refused():
    with pytest.raises(TypeError, match="no command-line spelling"):
        add_options(argparse.ArgumentParser(), Toy, ("extra",))  # a dict field: the command spells it by hand

    @dataclass
    class Bare:
        n: int = 3

    with pytest.raises(TypeError, match="no help text"):
        add_options(argparse.ArgumentParser(), Bare)
    with pytest.raises(TypeError, match="needs help text"):
        option(1, "text", flag="--n")  # a misspelt key
    with pytest.raises(TypeError, match="needs help text"):
        option(1)


# ---------------------------------------------------------------------------- the generated commands
def _subparser(*names: str) -> argparse.ArgumentParser:
    p = build_parser()
    for name in names:
        p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return p


def _shown(default, sep: str) -> str:
    if default is MISSING or default is None or default in ("", ()):
        return ""
    if isinstance(default, bool):
        return f" (default: {'on' if default else 'off'})"
    return f" (default: {sep.join(map(str, default)) if isinstance(default, tuple) else default})"


def _check_helps(parser: argparse.ArgumentParser, config: type, names) -> None:
    """Each field's option shows the field's help, then the dataclass default (switches: none)."""
    actions = {a.dest: a for a in parser._actions}
    for f in fields(config):
        if f.name not in names:
            continue
        action = actions[f.name]
        default = f.default if f.default_factory is MISSING else f.default_factory()
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        shown = "" if switch else _shown(default, f.metadata.get("sep", " "))
        assert action.help == f.metadata["help"] + shown, f.name


def test_ablate_and_analyze_are_generated_from_their_configs():
    p = _subparser("ablate")
    _check_helps(p, AblationConfig, STUDY_FIELDS + MEASURE_FIELDS)
    required = ["--data", "d", "--output", "o", "--epochs", "1"]
    assert ablation_config(build_parser().parse_args(["ablate", *required])) == AblationConfig(data="d", output="o", epochs=1)
    cfg = ablation_config(build_parser().parse_args(["ablate", *required, "--embed-dim", "16,24,32", "--seeds", "0", "1"]))
    assert cfg.embed_dim == (16, 24, 32) and cfg.seeds == (0, 1)
    for sub in ("heads", "taylor"):
        _check_helps(_subparser("analyze", sub), AnalysisConfig, ANALYSIS_FIELDS)
        assert analysis_config(build_parser().parse_args(["analyze", sub, "--output", "o"])) == AnalysisConfig(output="o")
    cfg = analysis_config(build_parser().parse_args(["analyze", "heads", "a.png", "b.png", "--output", "o", "--cascade", "off"]))
    assert cfg == AnalysisConfig(output="o", images=("a.png", "b.png"), dials={"cascade": False})


def test_detect_train_is_generated_from_its_config():
    pytest.importorskip("torchvision")
    from cgavit.cli.detect import TRAIN_FIELDS, train_config
    from cgavit.detection import DetectionTrainConfig

    p = _subparser("detect", "train")
    _check_helps(p, DetectionTrainConfig, TRAIN_FIELDS)
    assert set(TRAIN_FIELDS) == {f.name for f in fields(DetectionTrainConfig)} - {"dials", "model_kwargs"}
    assert set(TRAIN_FIELDS) <= {a.dest for a in p._actions}  # each has its flag
    args = ["detect", "train", "--train-json", "a.json", "--train-images", "imgs"]
    assert train_config(build_parser().parse_args(args)) == DetectionTrainConfig(train_json="a.json", train_images="imgs")
    cfg = train_config(build_parser().parse_args([*args, "--train-bn", "--lr-steps", "3", "--model-arg", "a=1"]))
    assert (cfg.freeze_bn, cfg.lr_steps, cfg.model_kwargs) == (False, (3,), {"a": 1})
    _check_helps(_subparser("detect", "eval"), DetectionTrainConfig, ("device", "batch_size", "workers", "strict"))


# ---------------------------------------------------------------------------- a missing optional extra
_RUN_WITHOUT = """
import contextlib, io, json, sys
sys.modules[sys.argv[1]] = None  # as if not installed
from cgavit.cli import main
out = {}
for argv in json.loads(sys.argv[2]):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
    out[" ".join(argv)] = [code, stdout.getvalue(), stderr.getvalue()]
print(json.dumps(out))
"""


def _cli_without(module: str, *commands: list[str]) -> subprocess.CompletedProcess:
    """``cgavit`` run with each argv of ``commands`` in a fresh interpreter in which ``module`` cannot
    be imported; stdout is ``{argv: [exit code, stdout, stderr]}`` as JSON."""
    argv = [sys.executable, "-c", _RUN_WITHOUT, module, json.dumps(commands)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def test_a_group_whose_extra_is_missing_is_listed_and_says_what_to_install():
    res = _cli_without("timm", ["--help"], ["detect"], ["train"], ["info", "--model", "m0"], ["train", "--help"],
                       ["export", "--model", "m0", "--output", "m0"], ["detect", "train", "--debug"])
    assert res.returncode == 0, res.stderr
    runs = json.loads(res.stdout)
    for argv in ("train --help", "export --model m0 --output m0", "detect train --debug"):  # were "unrecognized arguments"
        code, _, err = runs[argv]
        assert code == 2 and "install it with pip install 'cgavit[" in err and "unrecognized" not in err, err
    code, text, _ = runs["--help"]
    assert code == 0
    for name in ("train", "ablate", "detect", "bench", "export", "info", "roofline"):
        assert f"\n    {name} " in text, name
    assert "(needs pip install 'cgavit[detect]')" in text
    code, _, err = runs["detect"]
    assert code == 2 and "needs timm" in err and "pip install 'cgavit[detect]'" in err
    code, _, err = runs["train"]
    assert code == 2 and "pip install 'cgavit[train]'" in err
    assert runs["info --model m0"][0] == 0  # the core's commands still run
    res = _cli_without("cgavit.cli.detect", ["info"])  # our own module broken: a bug, shown as one
    assert res.returncode == 1 and "Traceback" in res.stderr and "cgavit.cli.detect" in res.stderr


_INTERRUPTED_IMPORT = """
import importlib.abc, sys


class CtrlC(importlib.abc.MetaPathFinder):  # Ctrl-C pressed while a command's libraries load
    def find_spec(self, name, path=None, target=None):
        if name == "cgavit.cli.train":
            raise KeyboardInterrupt
        return None


sys.meta_path.insert(0, CtrlC())
from cgavit.cli import main
sys.exit(main(["info", "--model", "m0"]))
"""


def test_ctrl_c_while_the_commands_load_is_one_line_and_exit_130():
    res = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT], capture_output=True, text=True, timeout=300)
    assert res.returncode == 130 and res.stderr.strip() == "cgavit: interrupted", (res.returncode, res.stderr[-2000:])


def test_every_command_that_reads_a_checkpoint_offers_the_trust_opt_in():
    """A pickled checkpoint is refused with a message naming ``--trust-checkpoint``: every command that reads one
    (a ``--checkpoint`` or ``--pretrained-backbone`` option) must offer it, but for ``detect eval/predict``, which
    read only what ``cgavit detect train`` wrote (never pickled objects) and say so."""
    from cgavit.cli import _all_subparsers

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    readers = [p for p in _all_subparsers(sub)
               if {"--checkpoint", "--pretrained-backbone"} & set(p._option_string_actions)]
    assert {p.prog.split()[-1] for p in readers} >= {"eval", "predict", "export", "quantize", "bench", "heads", "explore"}
    own_files_only = {"cgavit detect eval", "cgavit detect predict"}
    missing = [p.prog for p in readers if "--trust-checkpoint" not in p._option_string_actions and p.prog not in own_files_only]
    assert not missing, missing


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_ends_on_sigterm_without_the_commands_handler():
    """Libraries fork helpers (OpenVINO's telemetry) that inherit the command's SIGTERM handler: such a child ends as
    it would have without it, killed by the signal, instead of unwinding a Terminated of its own (a traceback)."""
    import signal
    import time
    from functools import partial

    from cgavit.cli import _raise_terminated

    before = signal.signal(signal.SIGTERM, partial(_raise_terminated, os.getpid()))
    try:
        pid = os.fork()
        if pid == 0:
            try:
                time.sleep(30)
            finally:  # an exception here must not carry on as a second test run
                os._exit(0)
        time.sleep(0.2)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


@pytest.mark.parametrize("argv, flag", [
    (["quantize", "--checkpoint", "a", "--data", "b", "--output", "c", "--agreement=--"], "--agreement"),
    (["roofline", "--batch=--"], "--batch"),
    (["analyze", "heads", "--output", "o", "--img-size=--"], "--img-size"),
])
def test_an_option_given_double_dash_as_its_value_is_one_line(argv, flag, capsys):
    """``--agreement=--`` reached the command as ``[]`` (argparse calls no ``type`` for it): a TypeError traceback."""
    from cgavit.cli import main

    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"cgavit {argv[0]}: error: argument {flag}: expected one argument, got '--'"


@pytest.mark.parametrize("flag, value", [("--embed-dim", "64;128;192"), ("--attn-ratio", "half")])
def test_a_dial_that_is_no_list_of_numbers_says_how_to_write_one(flag, value, capsys):
    """A dial's bad value was "invalid _ints value" (the name of cgavit's own parsing function)."""
    from cgavit.cli import main

    with pytest.raises(SystemExit) as stop:  # argparse's own exit, as for any option it refuses
        main(["export", "--model", "efficientvit_m0", flag, value, "--output", "never"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after argparse's usage lines
    assert err.startswith(f"cgavit export: error: argument {flag}: expected one value or ") and "separated by commas" in err
    assert "_ints" not in err and "_floats" not in err, err


def test_group_split_off_without_cascade_off_names_the_flags(tmp_path, capsys):
    """--group-split off alone was refused with the model's 'set cascade=False too', a keyword no command takes."""
    from cgavit.cli import main

    out = tmp_path / "m.onnx"
    assert main(["export", "--model", "efficientvit_m0", "--group-split", "off", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--group-split off (standard multi-head attention) needs --cascade off too" in err and "=False" not in err
    assert not out.exists()


def test_an_option_that_takes_a_list_may_be_given_none(capsys):
    """``info --model`` with no names (every variant) shares its name with the one-value --model of other commands."""
    from cgavit.cli import main

    assert main(["info", "--model"]) == 0 and "efficientvit_m5" in capsys.readouterr().out


@pytest.mark.parametrize("command", [
    ["demo"], ["bench"], ["roofline"], ["quantize", "--checkpoint", "x.pt", "--data", "d", "--output", "q"],
    ["ablate", "--data", "d", "--output", "o", "--epochs", "1"],
])
def test_every_threads_option_has_the_same_bounds(command, tmp_path, capsys, monkeypatch):
    """--threads 100000 asked ablate for memory it had not (a MemoryError traceback); the commands bounded it at
    256, 1024 or not at all."""
    from cgavit.cli import main

    monkeypatch.chdir(tmp_path)
    for threads in ("0", "100000"):
        assert main([*command, "--threads", threads]) == 2
        err = capsys.readouterr().err
        assert "--threads must" in err and "1..1024" in err, err
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize("argv, command, said", [
    (["info", "--modle", "efficientvit_m0"], "info", "unrecognized arguments: --modle efficientvit_m0; did you mean --model?"),
    (["train", "--img_size", "64"], "train", "unrecognized arguments: --img_size 64; did you mean --img-size?"),
    (["trian"], "", "invalid choice: 'trian'; did you mean 'train'?"),
    (["eval", "--data", "d", "--interpolation", "bicubc"], "eval", "invalid choice: 'bicubc'; did you mean 'bicubic'?"),
])
def test_a_mistyped_option_or_choice_names_the_closest_and_its_command(argv, command, said, capsys):
    """``cgavit info --modle m0`` printed the top-level usage and 'cgavit: error: unrecognized arguments', naming
    neither the command nor the option meant; a mistyped command or choice listed the choices but named none."""
    from cgavit.cli import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    prog = f"cgavit {command}".strip()
    assert err.startswith(f"usage: {prog} "), err
    assert err.strip().splitlines()[-1].startswith(f"{prog}: error: ") and said in err, err


def test_a_mistyped_train_option_in_train_args_names_the_closest():
    from cgavit.cli.ablate import train_args

    with pytest.raises(ValueError, match="--img_size 5; did you mean --img-size"):
        train_args("--epochs 3 --img_size 5")
