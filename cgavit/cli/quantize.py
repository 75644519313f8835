"""``cgavit quantize``: the fastest int8 file that keeps a trained checkpoint's decisions, with a report.

Calibrates on DIR/train, judges on DIR/val (never the same images), searches the layers to keep in
float (:func:`cgavit.deploy.quantize.quantize`), writes the int8 file only when it meets the target,
and beside it ``NAME.quantize.json``, ``NAME.quantize.md`` and (with matplotlib) ``NAME.quantize.png``.
With ``--qat`` the model is also fine-tuned with fake quantisation (:mod:`cgavit.deploy.qat`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..analysis.plots import matplotlib_api
from ..bounds import check_threads
from ..bench.precision import CALIBRATION_IMAGES, LabelledImages, calibration_and_evaluation, load_labelled
from ..train.data import list_split
from ..deploy import Int8Options, QatConfig, QuantizeResult, QuantizeTarget, open_exported, quantize, quantize_aware
from ..deploy.formats import FORMATS, QUANT_RUNTIMES, SUFFIX_FORMATS, runtime_format
from ..deploy.fusion import WRITTEN_SUFFIXES, file_name
from ..deploy.cpu import cpu_features
from ..deploy.int8 import BIAS_CORRECTIONS, CALIBRATION_METHODS, FLOAT_PARTS, WEIGHT_TYPES, float_parts_for_cpu
from ..deploy.qat import require_qat
from ..deploy.quantize import HOLDOUT, SharedImagesError, float_reasons, openvino_int8_problem, quant_runtimes
from ..deploy.metadata import export_info
from ..factory import ModelInfo, load_model
from ..io import (StopNote, atomic_write, check_names_fit, clear_interrupted, moved, replace_together, staging,
                  write_error, write_json, write_text)
from ..lock import FileLock
from .common import add_dial_args, dials_from_args, image_size

log = logging.getLogger(__name__)

#: Below this speed-up over fp32 ONNX Runtime the command says that int8 gains nothing here.
NO_GAIN = 1.1

#: The options read by ``--qat`` alone, and their defaults (given without ``--qat``, even at these values, they are
#: refused: the parser's default is None).
QAT_DEFAULTS = dict(epochs=2, qat_images=0, qat_lr=1e-5, qat_batch=64, qat_float_layers=1)

#: The runtime each output suffix implies.
SUFFIX_RUNTIMES = {FORMATS[name].suffix: FORMATS[name].backend for name in SUFFIX_FORMATS.values()}


def checked_target(args: argparse.Namespace) -> QuantizeTarget:
    """The target from ``--agreement`` (percent) and ``--accuracy-tolerance`` (points).

    Raises:
        ValueError: a value out of range (one line, what to give).
    """
    if not 0 < args.agreement <= 100:
        raise ValueError(f"--agreement is a percentage in (0, 100], e.g. 99.5; got {args.agreement:g}")
    if args.agreement <= 1:  # a fraction typed for a percentage: a target that anything meets
        log.warning("--agreement is a percentage: %g keeps %g %% of fp32's decisions; for 99.5 %% give 99.5",
                    args.agreement, args.agreement)
    if not 0 <= args.accuracy_tolerance <= 100:
        raise ValueError(f"--accuracy-tolerance is in points, in [0, 100], e.g. 0.3; got {args.accuracy_tolerance:g}")
    return QuantizeTarget(args.agreement / 100.0, args.accuracy_tolerance)


@dataclass(frozen=True)
class Outputs:
    """The files a run may write, named from ``--output``: the int8 file of each runtime (``NAME.onnx``;
    ``NAME.xml`` + ``NAME.bin``) and the report (``NAME.quantize.json``, ``.md``, ``.png``), or, where a run that
    met no target would otherwise replace the report of an earlier run's answer, ``NAME.quantize-missed.*``."""

    stem: Path

    @staticmethod
    def named(output: str | os.PathLike) -> "Outputs":
        """The files of ``--output``: ``NAME``, or ``NAME.onnx``/``NAME.xml`` (whose suffix names the runtime)."""
        path = Path(output)
        return Outputs(path.with_suffix("") if path.suffix.lower() in SUFFIX_RUNTIMES else path)

    def names(self) -> list[Path]:
        """Every file a run may make under the name: :meth:`all`, and the lock."""
        return [*self.all(), self.lock()]

    def artifact(self, runtime: str) -> list[Path]:
        suffixes = (".xml", ".bin") if runtime == "openvino" else (".onnx",)
        return [self.stem.with_name(self.stem.name + s) for s in suffixes]

    def report(self, suffix: str, missed: bool = False) -> Path:
        return self.stem.with_name(f"{self.stem.name}.quantize{'-missed' if missed else ''}{suffix}")

    def lock(self) -> Path:
        """``NAME.quantize.lock``, held for the whole run (:class:`~cgavit.lock.FileLock`): two runs on one NAME would
        leave one run's int8 file beside the other's report."""
        return self.stem.with_name(f"{self.stem.name}.quantize.lock")

    def all(self) -> list[Path]:
        return [*(p for rt in QUANT_RUNTIMES for p in self.artifact(rt)),
                *(self.report(s, missed) for s in REPORT_SUFFIXES for missed in (False, True))]

    def earlier_answer(self) -> str | None:
        """The runtime of this name's answer from an earlier run, when both say so: the report ``NAME.quantize.json``
        records an answer in that runtime, and that runtime's file here carries cgavit's int8 metadata with
        ``cgavit quantize``'s verdict for it. None otherwise (no answer, or a file of something else under the name:
        ``cgavit export``'s, or the user's)."""
        runtime = self.recorded_answer()
        if runtime is None:
            return None
        try:
            with warnings.catch_warnings():  # a file for another CPU is still this name's answer
                warnings.simplefilter("ignore")
                _, info = open_exported(self.artifact(runtime)[0], threads=1)
        except ValueError:  # missing, unreadable, its runtime not installed, no cgavit metadata
            return None
        return runtime if info.precision == "int8" and info.int8.get("runtime") == runtime else None

    def recorded_answer(self) -> str | None:
        """The runtime whose file the report ``NAME.quantize.json`` records as this name's answer; None without such a
        report (none, unreadable, or a run that met no target). What the file itself says is
        :meth:`earlier_answer`'s to check."""
        try:
            record = json.loads(self.report(".json").read_text())
            runtime = record["runtime"] if record["meets_target"] is True else None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return runtime if isinstance(runtime, str) and runtime in QUANT_RUNTIMES else None

    def replaced(self, runtime: str, earlier: str | None) -> tuple[list[Path], list[Path]]:
        """What an answer in ``runtime`` removes besides the files it writes: the earlier answer of another runtime
        (``earlier``; an ``.xml`` with its ``.bin``), and the report of a run that met no target since."""
        answer = self.artifact(earlier) if earlier not in (None, runtime) else []
        missed = [self.report(s, missed=True) for s in REPORT_SUFFIXES]
        return [p for p in answer if taken(p)], [p for p in missed if taken(p)]

    def others(self, runtime: str) -> list[Path]:
        """The other runtimes' file names under this name that are taken."""
        return [p for rt in QUANT_RUNTIMES if rt != runtime for p in self.artifact(rt) if taken(p)]


def taken(path: Path) -> bool:
    """Whether something (a file, or a link even to nothing) is at ``path``."""
    return path.exists() or path.is_symlink()


#: The report's files, beside the int8 file.
REPORT_SUFFIXES = (".json", ".md", ".png")


def checked_outputs(args: argparse.Namespace) -> tuple[Outputs, str | None]:
    """The files ``--output`` names, checked before any work, and the runtime: ``--runtime``, or the one the
    suffix names.

    Raises:
        ValueError: not a file name (empty, ``.``, ``..``, a trailing ``/``, an existing folder), a missing or
            unwritable folder, a suffix of another kind of file or one that contradicts ``--runtime``, a name too long
            for the names the run writes, or one of the files to write is a folder, pipe, socket or device.
    """
    if Path(args.output).name not in ("", ".", ".."):  # file_name's first look at a name too long is a traceback,
        check_names_fit(Outputs.named(args.output).names(), "--output")  # and NAME.quantize-missed.json the longest
    out = file_name(args.output, "q/digits_int8 (.onnx or .xml is added)")
    implied = SUFFIX_RUNTIMES.get(out.suffix.lower())
    if implied and args.runtime and implied != args.runtime:
        raise ValueError(f"--output {out.name} names an {implied} file but --runtime is {args.runtime}; "
                         "give a matching suffix, or NAME alone")
    if not implied and out.suffix.lower() in WRITTEN_SUFFIXES:
        raise ValueError(f"--output {out.name} names another kind of file; give NAME, NAME.onnx or NAME.xml")
    runtime = args.runtime or implied
    outputs = Outputs.named(out)
    folders = [p for p in outputs.all() if p.is_dir()]
    if folders:
        raise ValueError(f"{folders[0]} is a folder, and this run may write a file there; give another --output")
    odd = [p for p in outputs.all() if p.exists() and not p.is_file()]  # reading NAME.quantize.json as a pipe hung
    if odd:
        raise ValueError(f"{odd[0]} is not a regular file (a pipe, socket or device), and this run may read and "
                         "replace a file there; remove it, or give another --output")
    try:
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as err:
        raise ValueError(f"cannot write into {out.parent} ({err.strerror or err}); give an --output in a folder you "
                         "can write") from None
    return outputs, runtime


def checked_numbers(args: argparse.Namespace) -> None:
    """Every numeric option in range, before any work, each message naming its flag.

    Raises:
        ValueError: a value out of range.
    """
    check_threads(args.threads)
    for flag, value, least in (("--calibration-images", args.calibration_images, 1), ("--repeats", args.repeats, 1),
                               ("--eval-images", args.eval_images, 0), ("--warmup", args.warmup, 0),
                               ("--qat-float-layers", args.qat_float_layers, 0), ("--img-size", args.img_size, 32),
                               ("--max-float-layers", args.max_float_layers, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    if args.img_size is not None:
        image_size(args.img_size)
    if not 0 <= args.holdout < 1:
        raise ValueError(f"--holdout is the share of the evaluation images held out of the search, in [0, 1), e.g. "
                         f"0.5 (0: none); got {args.holdout:g}")
    if args.qat and (min(args.epochs, args.qat_batch) < 1 or args.qat_images < 0
                     or not (math.isfinite(args.qat_lr) and args.qat_lr > 0)):
        raise ValueError(f"--qat needs --epochs and --qat-batch of at least 1, --qat-images of at least 0 and a finite "
                         f"--qat-lr above 0; got {args.epochs}, {args.qat_batch}, {args.qat_images} and {args.qat_lr:g}")


def check_runtime_options(args: argparse.Namespace, runtime: str | None) -> None:
    """Refuse a runtime's own option when this run searches no build of that runtime: ``runtime`` (``--runtime``, or
    the one the suffix names) is the other one, or none is named and OpenVINO is not installed or fails to import
    (:func:`~cgavit.deploy.quantize.openvino_int8_problem`), so that the search is ONNX Runtime's alone, where
    ``--float-part`` and ``--bias-correction`` were accepted and did nothing. Checked before
    :func:`~cgavit.deploy.quantize.quant_runtimes` warns of a broken OpenVINO: the refusal is the one line, with
    the reason.

    Raises:
        ValueError: the option, and what to do.
    """
    for flag, its, given, what in (("--float-part", "openvino", args.float_part != "auto",
                                    "is how OpenVINO runs what int8 leaves float"),
                                   ("--weights", "onnxruntime", args.weights != "int8", "is ONNX Runtime's weight type"),
                                   ("--bias-correction", "openvino", args.bias_correction != "full",
                                    "is OpenVINO's (NNCF's)")):
        if not given or its == runtime:
            continue
        if runtime:
            raise ValueError(f"{flag} {what}; drop it, or use --runtime {its}")
        problem = openvino_int8_problem() if its == "openvino" else None  # ONNX Runtime is always searched
        if problem:
            raise ValueError(f"{flag} {what}, and OpenVINO cannot be used here ({problem}), so this run searches ONNX "
                             f"Runtime alone; drop {flag}, or install it ({FORMATS['openvino'].install()})")


def run(args: argparse.Namespace) -> int:
    qat_only = [f"--{key.replace('_', '-')}" for key in QAT_DEFAULTS if getattr(args, key) is not None]
    if qat_only and not args.qat:
        raise ValueError(f"{', '.join(qat_only)} {'is' if len(qat_only) == 1 else 'are'} read by --qat alone; add it, "
                         "or leave them out")
    capped = None not in (args.qat_float_layers, args.max_float_layers)  # both given: they may contradict
    for key, default in QAT_DEFAULTS.items():
        setattr(args, key, default if getattr(args, key) is None else getattr(args, key))
    target = checked_target(args)
    checked_numbers(args)
    if capped and args.qat_float_layers > args.max_float_layers:
        raise ValueError(f"--qat-float-layers {args.qat_float_layers} keeps more layers in float than --max-float-layers "
                         f"{args.max_float_layers} allows; give at most {args.max_float_layers}, or leave it out")
    if args.qat:  # torchao missing: said before the post-training search, not after it
        require_qat()
    outputs, runtime = checked_outputs(args)
    float_parts_for_cpu(cpu_features(), args.float_part)  # a bf16 float part without native bf16: refused now
    check_runtime_options(args, runtime)
    searched = quant_runtimes(runtime)  # a runtime missing or broken: said before any image is read, and once:
    runtime = searched[0] if len(searched) == 1 else None  # the search is given the one it can search
    with StopNote() as finished, FileLock(outputs.lock(), f"is writing {outputs.stem}.* (cgavit quantize)"):
        cleared(outputs)  # a second run on NAME stops at the lock, so what is left under it is of runs that are gone
        model, info = load_model(args.checkpoint, args.model, dials_from_args(args) or None, img_size=args.img_size,
                                 trust=args.trust_checkpoint)
        calib, evaluated = calibration_and_evaluation(args.data, args.train_split, args.val_split, info,
                                                      model.num_classes, args.calibration_images, args.eval_images,
                                                      all_calibration_images=True, channels=model.in_chans)
        if args.qat:
            check_qat_count(args)
        size = (info.img_size, info.img_size)
        print(f"calibrating on {len(calib.images)} images of {calib.source}, judging on {len(evaluated.images)} "
              f"images of {evaluated.source} ({args.holdout:g} of them held out of the search); "
              f"target: {target.describe()}")
        options = Int8Options(calibration=args.calibration, weights=args.weights, bias_correction=args.bias_correction)
        with files_named(evaluated, calibration=calib):  # the images' check is the library's first step
            result = quantize(model, calib.images, evaluated.images, target, runtime, labels=evaluated.labels,
                              options=options, sensitivity=not args.skip_sensitivity,
                              max_float_layers=args.max_float_layers, profile_layers=not args.no_layer_profile,
                              prune=not args.no_prune, float_part=args.float_part,
                              holdout=args.holdout, info=export_info(info, size, getattr(model, "in_chans", 3)),
                              threads=args.threads, warmup=args.warmup, repeats=args.repeats)
        if args.qat and not (result.meets_target and set(result.float_layers) <= _no_faster(result)):
            result = qat_result(args, model, info, (calib, evaluated), target, runtime, result, options)
        elif args.qat:
            print("--qat: post-training int8 already meets the target with every layer int8 that int8 makes faster; "
                  "no fine-tuning needed")
        return write_outputs(result, outputs, finished)


def cleared(outputs: Outputs) -> None:
    """Put right what a run killed while writing under this name left (:func:`~cgavit.io.clear_interrupted`), and say
    what: an earlier file it had moved aside goes back in place, its temporary files go.

    Raises:
        WriteError: they could not be moved or removed (the folder's permissions, a read-only disk).
    """
    try:
        restored, removed = clear_interrupted(outputs.all(), outputs.stem)
    except OSError as err:
        raise write_error(outputs.stem, err) from None
    for dest in restored:
        log.warning("restored %s: a run killed while replacing it had moved it aside", dest)
    if removed:
        log.info("removed what a run killed while writing %s.* left: %s", outputs.stem, ", ".join(map(str, removed)))


def _no_faster(result: QuantizeResult) -> set[str]:
    """The layers the answer's runtime runs no faster in int8 (kept float for speed, not for its decisions)."""
    return {s.layer for s in result.no_faster.get(result.runtime, [])}


@contextmanager
def files_named(evaluated: LabelledImages, **parts: LabelledImages) -> Iterator[None]:
    """The library's refusal of evaluation images that are, bit for bit, calibration or training images too (a copy
    under another name), with a pair of their files named: the library knows the images, not the files. ``parts``: the
    images given to the library under each role (``calibration=``, ``training=``)."""
    try:
        yield
    except SharedImagesError as err:
        if err.role not in parts:
            raise
        i, j = err.pairs[0]
        raise ValueError(err.describe(f", e.g. {evaluated.files[j]} is {parts[err.role].files[i]}")) from None


def check_qat_count(args: argparse.Namespace) -> None:
    """Refuse, before the post-training search, a ``--qat-images`` larger than the training split holds (counted from
    the folder listing: the images are decoded only when fine-tuning runs, so that they do not take memory for the
    whole search when it turns out not to be needed).

    Raises:
        ValueError: fewer images than asked.
    """
    _, samples = list_split(args.data, args.train_split)
    if args.qat_images > len(samples):
        raise ValueError(f"{Path(args.data) / args.train_split} holds {len(samples)} images, fewer than --qat-images "
                         f"{args.qat_images}; give at most that many, or 0 for all")


def qat_result(args: argparse.Namespace, model, info: ModelInfo, images: tuple[LabelledImages, LabelledImages],
               target: QuantizeTarget, runtime: str | None, ptq: QuantizeResult, options: Int8Options) -> QuantizeResult:
    """Fine-tune with fake quantisation on DIR/train (in float: the layers ONNX Runtime's int8 did not make
    faster, and the ``--qat-float-layers`` most sensitive others of the post-training search), write the
    int8 file with the learnt ranges and judge it like the post-training builds; the faster result that
    meets the target (else the one that keeps more decisions). ``images``: calibration and evaluation; the training
    images are loaded here, none of them an evaluation image."""
    calib, evaluated = images
    train = load_labelled(args.data, args.train_split, info, args.qat_images, seed=2, channels=model.in_chans)
    cfg = QatConfig(epochs=args.epochs, lr=args.qat_lr, batch_size=args.qat_batch)
    slow = ptq.no_faster.get("onnxruntime", [])
    free = [s.layer for s in slow]
    ranked = ptq.sensitivity.get("onnxruntime") or next(iter(ptq.sensitivity.values()), [])  # the file is ONNX
    sensitive = [s.layer for s in ranked if s.layer not in free][:qat_sensitive_count(args, len(free))]
    if args.qat_float_layers and not ranked:
        print("--qat: the post-training search measured no per-layer sensitivity (--skip-sensitivity, and its start met "
              "the target), so --qat-float-layers keeps no sensitive layer in float")
    keep = free + sensitive
    kinds = [f"{', '.join(names)} ({why})" for names, why in ((free, "no faster in int8"),
                                                                 (sensitive, "the most sensitive")) if names]
    print(f"--qat: fine-tuning {args.epochs} epoch(s) on {len(train.images)} images of {train.source}, "
          "fake-quantised (torch PT2E QAT), distilled from the fp32 model; "
          + (f"float: {'; '.join(kinds)}" if kinds else "every layer int8"))
    with files_named(evaluated, calibration=calib, training=train):
        qat = quantize_aware(model, calib.images, train.images, evaluated.images, target, runtime,
                             labels=evaluated.labels, config=cfg, options=options, float_layers=keep,
                             info=export_info(info, (info.img_size, info.img_size), getattr(model, "in_chans", 3)),
                             holdout=args.holdout, threads=args.threads, warmup=args.warmup, repeats=args.repeats)
    qat.sensitivity, qat.reasons = ptq.sensitivity, float_reasons(ranked, keep, slow)  # why they stayed float
    qat.no_faster = {"onnxruntime": slow}
    print(f"post-training: {ptq.describe_point()}\nquantization-aware: {qat.describe_point()}")
    if qat.meets_target and (not ptq.meets_target or qat.point.speedup > ptq.point.speedup):
        return qat
    if not ptq.meets_target and qat.agreement.top1_agreement > ptq.agreement.top1_agreement:
        return qat
    return ptq


def qat_sensitive_count(args: argparse.Namespace, free: int) -> int:
    """How many of the most sensitive layers ``--qat`` keeps in float besides the ``free`` ones int8 makes no faster:
    ``--qat-float-layers``, within ``--max-float-layers``, which caps every build's float layers (the fine-tuned
    one's too)."""
    if args.max_float_layers is None:
        return args.qat_float_layers
    return max(0, min(args.qat_float_layers, args.max_float_layers - free))


def write_outputs(result: QuantizeResult, outputs: Outputs, finished: StopNote | None = None) -> int:
    """The int8 file only when it meets the target, with its report (json, md, png), moved into place together
    (:func:`written_together`). An answer replaces this name's earlier answer in another runtime
    (:meth:`Outputs.earlier_answer`) and a report of a run that missed since; other files under the name stay. A run
    that meets no target leaves an earlier answer and its report as they were (its own report is then
    ``NAME.quantize-missed.*``). ``finished``: the note a Ctrl-C from then on carries, set once the files are in place
    (the run's, held until it ends). Exit status 0 or 1."""
    finished = finished or StopNote()
    earlier, recorded = outputs.earlier_answer(), outputs.recorded_answer()  # read before the report is replaced
    replaced, stale = outputs.replaced(result.runtime, earlier) if result.meets_target else ([], [])
    with finished:  # once the files are in place, a Ctrl-C says so
        out, written = written_together(result, outputs, earlier is not None, replaced + stale, finished)
        for layer, why in result.reasons.items():
            print(f"kept in float: {layer}: {why}")
        if result.noise_floor is not None:
            print(f"for scale: {result.noise_floor.describe()} (the rounding an 8-bit image already carries)")
        if out is None:
            print(f"nothing int8 met the target ({result.target.describe()}); the best found: "
                  f"{result.describe_point()}. No int8 file written. Report: {', '.join(str(p) for p in written)}")
            if earlier is not None:
                print(f"note: {outputs.artifact(earlier)[0]} from an earlier run is left as it was, with its report "
                      f"{outputs.report('.md')}")
            return 1
        print(f"wrote {out}: {result.describe_point()}\n{result.uncertainty()}."
              f"\nfp32 ONNX Runtime {result.fp32_img_s:.0f} img/s here "
              f"({result.cpu}). Report: {', '.join(str(p) for p in written)}")
        if replaced:
            print(f"note: removed {', '.join(map(str, replaced))}: this name's answer of an earlier run, in another "
                  f"runtime (its report said so); {out} is this name's answer now")
        if stale:
            print(f"note: removed {', '.join(map(str, stale))}: the report of an earlier run that met no target")
        left = outputs.others(result.runtime)
        if left:
            print(left_note(left, recorded if earlier is None else None))
        if result.runoff_disturbed:
            print(f"note: other work ran while the runtimes' answers were timed side by side (about "
                  f"{result.runoff_load:.1f} cores of it): the runtime chosen may not be the faster here; run cgavit "
                  "quantize with nothing else running")
        if result.point.speedup < NO_GAIN:
            print(f"note: it keeps the decisions but runs at {result.point.speedup:.2f}x fp32 ONNX Runtime here "
                  f"({len(result.float_layers)} layers had to stay in float): on this CPU the fp32 file "
                  "(cgavit export) is as fast; timings at this model size are noisy, check with cgavit bench")
        return 0


def left_note(left: list[Path], recorded: str | None) -> str:
    """The note on another runtime's files under the name that an answer leaves (:meth:`Outputs.others`).
    ``recorded``: the runtime the replaced report named as this name's answer where the file itself could not confirm
    it (:meth:`Outputs.earlier_answer` said None): when that runtime cannot be used here, the note says so rather than
    calling its file no answer."""
    files, verb = ", ".join(map(str, left)), "it is" if len(left) == 1 else "they are"
    unread = recorded is not None and any(SUFFIX_RUNTIMES.get(p.suffix) == recorded for p in left)
    problem = runtime_format(recorded).problem("int8") if unread else None
    if problem:
        return (f"note: {files} left as {verb}: the earlier report named {'it' if len(left) == 1 else 'them'} this "
                f"name's answer in {recorded}, which cannot be checked here ({problem}); remove "
                f"{'it' if len(left) == 1 else 'them'} if this run's file is to be the only answer")
    return f"note: {files} (not an answer of cgavit quantize under this name) left as {verb}"


def written_together(result: QuantizeResult, outputs: Outputs, earlier: bool, removed: list[Path],
                     finished: StopNote) -> tuple[Path | None, list[Path]]:
    """Write the int8 file (when it meets the target) and the report beside the destination as temporaries, then
    move them into place together (:func:`~cgavit.io.replace_together`), so that an interrupted or failed run never
    leaves the file beside another run's report. An answer's ``removed`` files (:meth:`Outputs.replaced`), and a plot
    this run could not draw, are removed in the same step. ``earlier``: an earlier answer is there (a run that misses
    its target then writes ``NAME.quantize-missed.*``). ``finished`` gets its note once they are in place. Returns
    the int8 file (None) and the report's files."""
    out = None
    missed = not result.meets_target and earlier
    with staging(outputs.stem) as tmp:
        temporary = Outputs(tmp / outputs.stem.name)
        moves: list[tuple[Path | None, Path]] = []
        if result.meets_target:
            with StopNote(""):  # OpenVINO's pair is moved together too, into the temporary folder: no news of that
                made = result.save(temporary.stem)
            out = outputs.stem.parent / made.name
            mine = temporary.artifact(result.runtime)
            moves += [(p, outputs.stem.parent / p.name) for p in mine] + [(None, p) for p in removed]
        report = [write_json(temporary.report(".json", missed), result.record()),
                  write_text(temporary.report(".md", missed), result.markdown()),
                  plot_curves(result, temporary.report(".png", missed))]
        moves += [(p, outputs.report(suffix, missed)) for p, suffix in zip(report, REPORT_SUFFIXES)
                  if p is not None or outputs.report(suffix, missed).exists()]
        replace_together(moves)
        finished.note = f"its files were all in place first: {moved(moves)}"
    return out, [outputs.report(suffix, missed) for p, suffix in zip(report, REPORT_SUFFIXES) if p is not None]


def plot_curves(result: QuantizeResult, path: Path) -> Path | None:
    """Agreement against speed-up over fp32 ONNX Runtime on the images the search judged on, one line per path (runtime
    and float part: the search) and crosses for the pruning's builds, each point labelled with its number of float
    layers, and a star at the answer (or the best found), its held-out figure in the legend; None (and a note) without
    matplotlib."""
    try:
        mpl = matplotlib_api()
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    plt = mpl.pyplot
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, points in result.curves.items():
        search = sorted((p for p in points if p.step == "search"), key=lambda p: len(p.float_layers))  # built out of order
        pruned = [p for p in points if p.step == "prune"]
        line, = ax.plot([p.speedup for p in search], [100 * p.agreement.top1_agreement for p in search], "o-",
                        label=f"{key}: float layers added, most sensitive first")
        if pruned:
            ax.plot([p.speedup for p in pruned], [100 * p.agreement.top1_agreement for p in pruned], "x",
                    color=line.get_color(), label=f"{key}: one returned to int8")
        for p in search + pruned:
            ax.annotate(str(len(p.float_layers)), (p.speedup, 100 * p.agreement.top1_agreement),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
    chosen = next((p for p in result.curves.get(result.point.path, []) if p.float_layers == result.float_layers),
                  result.point)  # where the curve shows it
    held = f", {result.agreement.shown()}% on the {result.held_out_images} held out" if result.held_out_images else ""
    ax.plot([chosen.speedup], [100 * chosen.agreement.top1_agreement], "*", ms=14, color="black", zorder=3, clip_on=False,
            label=f"{'answer' if result.meets_target else 'best found (misses)'}: {len(chosen.float_layers)} float "
                  f"layers{held}")
    ax.axhline(100 * result.target.agreement, color="grey", ls="--", lw=1,
               label=f"target: {100 * result.target.agreement:g} % agreement")
    ax.set_ylim(top=min(ax.get_ylim()[1], 100.5))  # no agreement above 100 %: the axis stops there
    ax.set_xlabel("speed-up over fp32 ONNX Runtime (same run)")
    searched = result.evaluation_images - result.held_out_images
    ax.set_ylabel(f"top-1 agreement with fp32 (%)\non the {searched} images the search judged on", fontsize=9)
    ax.set_title(f"int8 builds, labelled by layers kept in float\n{result.cpu}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    finally:
        plt.close(fig)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize",
        help="the fastest int8 file (ONNX Runtime or OpenVINO) that keeps a trained model's decisions",
        description="Calibrate int8 on DIR/train, judge it on DIR/val against fp32 (top-1 agreement and accuracy "
        "change), keep the most sensitive layers in float until the target is met, time every build beside fp32 "
        "ONNX Runtime here, and write the fastest that meets the target (NAME.onnx or NAME.xml + NAME.bin) with a "
        "report (NAME.quantize.json, .md, .png). When nothing meets the target no int8 file is written and the "
        "exit status is 1.",
    )
    p.add_argument("--checkpoint", required=True, help="trained weights: written by cgavit train (best.pt, "
                   ".safetensors; they record the network), or an official or timm file with --model")
    p.add_argument("--model", help="variant name, e.g. efficientvit_m0, for a file that does not record its network "
                   "(with the dials below if it was trained with changed ones); a check for one that does")
    p.add_argument("--data", required=True, help="image folder: calibration on DIR/train, judged on DIR/val")
    p.add_argument("--img-size", type=int, metavar="N", help="input size N, which the network is built for and the images "
                   "are resized to (default: the checkpoint's, else 224: give it for a file that records none, trained "
                   "at another size)")
    p.add_argument("--output", required=True, help="NAME (the runtime picks .onnx or .xml), NAME.onnx or NAME.xml (in "
                   "any case, written .onnx or .xml, as cgavit export does), in a folder that exists; a run replaces the NAME.* files it writes, and its answer also the other "
                   "runtime's answer of an earlier run under NAME (NAME.quantize.json says so), never another file; "
                   "a run that meets no target leaves an earlier answer and its report alone")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="allow pickled objects in the checkpoint (runs code from it: only for files you trust)")
    p.add_argument("--agreement", type=float, default=99.5, help="least top-1 agreement with fp32, %% (default 99.5)")
    p.add_argument("--accuracy-tolerance", type=float, default=0.3,
                   help="largest accuracy change against fp32, points (default 0.3)")
    p.add_argument("--runtime", choices=list(QUANT_RUNTIMES), help="only this runtime (default: every one installed)")
    p.add_argument("--calibration-images", type=int, default=CALIBRATION_IMAGES,
                   help=f"training images to calibrate on (default {CALIBRATION_IMAGES})")
    p.add_argument("--eval-images", type=int, default=0, help="evaluation images (default 0: the whole split)")
    p.add_argument("--train-split", default="train", help="calibration split folder name (default train)")
    p.add_argument("--val-split", default="val", help="evaluation split folder name (default val)")
    p.add_argument("--calibration", choices=CALIBRATION_METHODS, default="percentile",
                   help="how activation ranges are calibrated (default percentile: BENCHMARKS.md, int8 on AVX2)")
    p.add_argument("--weights", choices=WEIGHT_TYPES, default="int8",
                   help="ONNX Runtime weight type: int8 (7-bit on x86 without VNNI, where 8-bit saturates) or uint8 "
                        "(U8U8 kernels: 8-bit that does not saturate, slower); default int8")
    p.add_argument("--bias-correction", choices=BIAS_CORRECTIONS, default="full",
                   help="OpenVINO (NNCF) bias correction (default full)")
    p.add_argument("--float-part", choices=["auto", *FLOAT_PARTS], default="auto",
                   help="precision OpenVINO runs what int8 leaves in float (kept-float layers, attention core, residual "
                        "adds): fp32; bf16 or bf16-layers (the float layers bf16, the rest fp32), for CPUs with native "
                        "bf16 (AMX, avx512_bf16); or auto (default): fp32, and both bf16 ones as more searches where the "
                        "CPU has it; the file records it and cgavit compiles it so")
    p.add_argument("--holdout", type=float, default=HOLDOUT, metavar="SHARE",
                   help=f"share of the evaluation images no search step judges on: the answer must meet the target on "
                        f"them too, and its figure there is the one reported (default {HOLDOUT:g}; 0: judge on the images "
                        "searched on, which is optimistic: pruning stops at the target's edge there)")
    p.add_argument("--max-float-layers", type=int, help="keep at most N layers in float (default: no cap; 0: all int8)")
    p.add_argument("--no-layer-profile", action="store_true",
                   help="do not keep in float the layers int8 makes no faster here (found by timing each convolution "
                        "in fp32 and int8 in the runtime's profiler; default: they stay float in every build)")
    p.add_argument("--no-prune", action="store_true",
                   help="keep the search's float layers as found (default: each goes back to int8 where the target "
                        "holds without it, those int8 speeds up most first; one build per float layer)")
    p.add_argument("--skip-sensitivity", action="store_true",
                   help="measure the per-layer sensitivity only when layers must be kept in float (faster)")
    p.add_argument("--qat", action="store_true", help="also fine-tune with fake quantisation (torch PT2E QAT, needs cgavit[qat]), distilled from fp32")
    p.add_argument("--epochs", type=int, help="--qat: epochs of fine-tuning (default 2)")
    p.add_argument("--qat-images", type=int, help="--qat: training images (default 0: all of DIR/train; more than it "
                   "holds is refused)")
    p.add_argument("--qat-lr", type=float, help="--qat: learning rate (default 1e-5)")
    p.add_argument("--qat-batch", type=int, help="--qat: batch size (default 64)")
    p.add_argument("--qat-float-layers", type=int, metavar="K",
                   help="--qat: keep the K most sensitive layers of the post-training search in float (default 1; "
                        "0: every layer int8; at most --max-float-layers with them); the layers int8 makes no faster "
                        "stay float as well")
    p.add_argument("--threads", type=int, default=1, help="threads of the timing (default 1, the paper's protocol)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per build (default 3)")
    p.add_argument("--repeats", type=int, default=10, help="timed rounds per build (default 10)")
    add_dial_args(p)
    p.set_defaults(func=run)
