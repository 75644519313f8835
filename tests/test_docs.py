"""The documentation runs: every example in README.md and docs/*.md, and every link in them.

**What runs.** Every fenced ```python and ```bash block of a page, as written, top to bottom, in one
scratch folder per page (a reader follows a page in order: a later block may use what an earlier one
wrote). Before the first block the folder holds what the pages' examples name (:func:`workspace`): the
digits model and its data where a page says ``runs/demo``, a small image folder ``imagenet/`` (a page
says ``/data/imagenet`` and a directive points it there), two photos ``cat.png`` and ``scan.tif``, and
the release files ``efficientvit_m*.pth`` a page names (random weights, timm key names). Python blocks
run in this process, one namespace per page. Bash blocks run in bash (``-euo pipefail``: every command
must succeed) with ``cgavit`` and ``torchrun`` on the PATH (the installed command line of this
checkout). ``pretrained=True``, ``--pretrained-backbone imagenet`` and every other release download go
to a local HTTP server on 127.0.0.1 through ``CGAVIT_WEIGHTS_MIRROR``, into a scratch torch hub cache.
Other fenced blocks must say what they are (``text``, ``json``, ...): an unlabelled block fails.

**Directives.** An HTML comment just above a block, which a reader sees in the source and GitHub does
not render, says how the test runs it small. A page-wide one (``doctest-page``) applies to every block::

    <!-- doctest: replace "--epochs 300" "--epochs 1" ; append "cgavit train" "--img-size 32" -->

- ``replace OLD NEW``: replace text. A block's own ``OLD`` must occur in it, a page-wide one somewhere
  in the page's blocks, so that a directive cannot outlive its example;
- ``append PATTERN ARGS``: add ARGS at the end of every command (a line with its ``\\`` continuations)
  that contains PATTERN, before a trailing comment;
- ``env NAME=VALUE ...``: environment variables for the block;
- ``serve``: each command of the block is a server: it is started, the URL it prints is asked for
  ``/api/model``, and it is stopped with Ctrl-C (SIGINT), which must end it with status 0.

``{repo}`` in a directive is the repository root.

**Stated output is checked.** In a Python block a ``print(...)`` line's trailing comment is what it
prints (``...`` matches anything): ``print(shapes)  # [(1, 128, 21, 32), ...]``. The README's variant
table is checked against the models.

**Links and names.** Every relative link and image in README.md, BENCHMARKS.md and docs/*.md must name
a file of the repository, and every ``#anchor`` a heading of that page (GitHub's slugs). Every
```cgavit.name``` written in backticks must exist (importable, or an attribute of what is), every path
that docs/ARCHITECTURE.md names in backticks must exist, and the README lists every command.

**Speed.** A ``cgavit`` process spends 5-8 s importing on this machine, so the pages keep their
commands few and small; sizes shrink only through the visible directives.
"""

from __future__ import annotations

import functools
import http.server
import importlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import tokenize
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import cgavit
from cgavit.cli import build_parser
from cgavit.model import to_timm_state_dict

REPO = Path(__file__).resolve().parents[1]
DOC_PAGES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))
LINKED_PAGES = ["README.md", "BENCHMARKS.md", *DOC_PAGES]

#: Pages whose blocks are not run, with the reason. Their links are still checked.
RECORD_PAGES = {
    "docs/benchmarks-log.md": "a dated record of past measurements: each command is the one a figure came from "
                              "(minutes to an hour each), kept beside its figure",
}
RUN_PAGES = ["README.md", *(p for p in DOC_PAGES if p not in RECORD_PAGES)]
RUN_LANGS = {"python", "bash"}
SHOWN_LANGS = {"text", "json", "console", "markdown"}  # output or file contents, shown and not run

#: Blocks that are not run, by (page, first line of the block): the reason.
NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", "pip install .                    # the model core: torch alone"):
        "installs the package; the test runs in the environment it was installed into",
    ("README.md", "make demo   # creates .venv, trains a CGA model on scikit-learn's bundled digits, evaluates it, reports"):
        "make test runs this test suite (it would run itself), and both build a .venv with pip; the demo's "
        "command `cgavit demo` is the engine tested by tests/test_train.py",
    ("docs/training.md", "make demo            # or: cgavit demo [--output runs/demo] [--epochs 15]"):
        "builds a .venv with pip (see the README's block); the test provides runs/demo with the digits model",
}

BLOCK_TIMEOUT = 300  # seconds for one block
RELEASE_FILE = re.compile(r"\befficientvit_m[0-5]\.pth\b")

pytestmark = pytest.mark.timeout(900)


# ------------------------------------------------------------------------------------ markdown
@dataclass
class Directives:
    """What a page's or a block's ``doctest`` comment says (see the module docstring)."""

    replace: list[tuple[str, str]] = field(default_factory=list)
    append: list[tuple[str, str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    serve: bool = False


@dataclass
class Block:
    """One fenced block of a page: its language, text, first line (1-based, the fence) and directives."""

    page: str
    line: int
    lang: str
    code: str
    directives: Directives

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.strip().splitlines()[0] if self.code.strip() else ""


FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)")
DIRECTIVE = re.compile(r"^\s*<!--\s*doctest(-page)?:(.*?)-->\s*$")


def parse_directives(text: str, where: str) -> Directives:
    """``replace "a" "b" ; env X=1 ; serve`` as :class:`Directives`; an unknown form fails the test."""
    d = Directives()
    for command in text.split(" ; "):
        words = [w.replace("{repo}", str(REPO)) for w in shlex.split(command)]
        if not words:
            continue
        verb, args = words[0], words[1:]
        if verb in ("replace", "append") and len(args) == 2:
            getattr(d, verb).append((args[0], args[1]))
        elif verb == "env" and args and all("=" in a for a in args):
            d.env.update(a.split("=", 1) for a in args)
        elif verb == "serve" and not args:
            d.serve = True
        else:
            pytest.fail(f"{where}: cannot read the doctest directive {command.strip()!r} (test_docs.py: the forms)")
    return d


def parse_page(page: str) -> tuple[list[Block], Directives]:
    """The fenced blocks of ``page`` with their own directives, and the page-wide directives."""
    lines = (REPO / page).read_text().splitlines()
    blocks, page_wide = [], Directives()
    i = 0
    while i < len(lines):
        m = DIRECTIVE.match(lines[i])
        if m and m.group(1):
            wide = parse_directives(m.group(2), f"{page}:{i + 1}")
            page_wide = Directives(page_wide.replace + wide.replace, page_wide.append + wide.append,
                                   {**page_wide.env, **wide.env}, page_wide.serve or wide.serve)
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        marker, lang, start = fence.group(1), fence.group(2).lower(), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(marker)
                    and not lines[j].strip().strip(marker[0])), None)
        assert end is not None, f"{page}:{i + 1}: a code block is never closed"
        above = lines[start - 1] if start else ""
        own = DIRECTIVE.match(above)
        directives = parse_directives(own.group(2), f"{page}:{start}") if own and not own.group(1) else Directives()
        blocks.append(Block(page, start + 1, lang, "\n".join(lines[start + 1:end]) + "\n", directives))
        i = end + 1
    return blocks, page_wide


def outside_code(text: str, inline: bool = True) -> str:
    """``text`` with its fenced blocks and (unless ``inline`` is false) its inline code blanked out."""
    out, marker = [], None
    for line in text.splitlines():
        fence = FENCE.match(line)
        if marker is None and fence:
            marker = fence.group(1)
            out.append("")
        elif marker is not None:
            if line.strip().startswith(marker) and not line.strip().strip(marker[0]):
                marker = None
            out.append("")
        else:
            out.append(re.sub(r"`[^`]*`", "``", line) if inline else line)
    return "\n".join(out)


# ------------------------------------------------------------------------------------ directives
def logical_lines(code: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the shell commands in ``code``: lines joined over ``\\``."""
    spans, start, pos = [], 0, 0
    for line in code.splitlines(keepends=True):
        pos += len(line)
        if not line.rstrip("\n").endswith("\\"):
            spans.append((start, pos))
            start = pos
    return spans


def comment_start(line: str) -> int:
    """Where an unquoted shell ``#`` comment starts in ``line`` (len(line) if none)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return i
    return len(line)


def apply_directives(code: str, d: Directives, where: str, strict: bool = True) -> str:
    """``code`` as the test runs it; ``strict``: every replace and append must find its text."""
    for old, new in d.replace:
        assert old in code or not strict, f"{where}: the directive replaces {old!r}, which the block does not hold"
        code = code.replace(old, new)
    for pattern, args in d.append:
        spans = [s for s in logical_lines(code) if pattern in code[s[0]:s[1]]]
        assert spans or not strict, f"{where}: the directive appends to {pattern!r}, which no command holds"
        for start, end in reversed(spans):
            line = code[start:end].rstrip("\n")
            last = line.rfind("\n") + 1  # a comment can only be on the last physical line
            cut = last + comment_start(line[last:])
            tail = f"  {line[cut:]}" if cut < len(line) else ""
            code = code[:start] + line[:cut].rstrip() + f" {args}" + tail + code[start + len(line):]
    return code


def unused_page_directives(blocks: list[Block], d: Directives) -> list[str]:
    """The page-wide replace/append texts that no run block holds (a directive outliving its examples)."""
    texts = [b.code for b in blocks if b.lang in RUN_LANGS]
    return [old for old, _ in d.replace + d.append if not any(old in t for t in texts)]


# ------------------------------------------------------------------------------------ python
def check_print(expected: str, where: str, *args, **kwargs) -> None:
    """``print(*args)``, failing unless it prints ``expected`` (``...`` matches anything)."""
    buf = io.StringIO()
    print(*args, **kwargs, file=buf)
    got = buf.getvalue().strip()
    sys.stdout.write(buf.getvalue())
    pattern = ".*?".join(re.escape(part) for part in expected.strip().split("..."))
    assert re.fullmatch(pattern, got, re.S), f"{where}: printed {got!r}, the page says {expected.strip()!r}"


def with_print_checks(code: str, page: str, first_line: int) -> str:
    """``code`` with each ``print(...)  # output`` line turned into a :func:`check_print` call."""
    lines = code.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type != tokenize.COMMENT:
            continue
        i, col, text = tok.start[0] - 1, tok.start[1], tok.string[1:].strip()
        m = re.fullmatch(r"(\s*)print\((.*)\)", lines[i][:col].rstrip())
        if m and text:
            lines[i] = f"{m.group(1)}__check_print__({text!r}, {f'{page}:{first_line + i}'!r}, {m.group(2)})"
    return "\n".join(lines) + "\n"


def run_python(block: Block, code: str, namespace: dict) -> None:
    """Run a Python block in ``namespace``; tracebacks name the page's lines."""
    code = with_print_checks(code, block.page, block.line + 1)
    namespace.setdefault("__check_print__", check_print)
    exec(compile("\n" * block.line + code, str(REPO / block.page), "exec"), namespace)


# ------------------------------------------------------------------------------------ shell
def run_bash(block: Block, code: str, cwd: Path, env: dict[str, str]) -> None:
    """Run a bash block; a failing command fails the test with the block's output."""
    proc = subprocess.run(["bash", "--noprofile", "--norc", "-euo", "pipefail", "-c", code], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=BLOCK_TIMEOUT, text=True, errors="replace")
    print(proc.stdout)
    assert proc.returncode == 0, f"{block.where}: exit status {proc.returncode}\n{code}\n--- output ---\n{proc.stdout[-6000:]}"


def as_in_a_terminal() -> None:
    """In the child: Ctrl-C's default action, as for a command started at a terminal. A suite started in the
    background (``make test &``, nohup) runs with SIGINT ignored, every child inherits that, and a server
    rightly keeps a signal ignored at its start: it would never see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_servers(block: Block, code: str, cwd: Path, env: dict[str, str]) -> None:
    """Each command of a ``serve`` block: started, asked for its model, stopped with SIGINT."""
    for start, end in logical_lines(code):
        command = code[start:end].strip()
        if not command or command.startswith("#"):
            continue
        proc = subprocess.Popen(["bash", "--noprofile", "--norc", "-c", f"exec {command}"], cwd=cwd, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=as_in_a_terminal)
        lines: list[str] = []
        try:
            url = None
            while url is None and (line := proc.stdout.readline()):
                lines.append(line)
                url = re.search(r"http://127\.0\.0\.1:\d+/", line)
            assert url, f"{block.where}: {command!r} printed no URL\n{''.join(lines)}"
            url = url.group(0)
            with urllib.request.urlopen(url + "api/model", timeout=60) as res:
                assert res.status == 200 and isinstance(json.load(res), dict)
        finally:
            proc.send_signal(signal.SIGINT)
            rest, _ = proc.communicate(timeout=60)
        print("".join(lines) + rest)
        assert proc.returncode == 0, f"{block.where}: {command!r} ended with {proc.returncode}\n{''.join(lines)}{rest}"


# ------------------------------------------------------------------------------------ what the pages name
@functools.cache
def release_file(folder: Path, name: str) -> Path:
    """``folder/efficientvit_mN.pth`` as the release files are laid out (``{'model': state dict}``), with
    random weights under timm's key names (the loader reads official, timm and own names alike)."""
    path = folder / name
    torch.manual_seed(0)
    model = cgavit.create_model(name.removesuffix(".pth"))
    torch.save({"model": to_timm_state_dict(model.state_dict())}, path)
    return path


class ReleaseHandler(http.server.BaseHTTPRequestHandler):
    """Serves ``/efficientvit_mN.pth``, generated on first request, to ``CGAVIT_WEIGHTS_MIRROR``."""

    folder: Path

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        name = self.path.rsplit("/", 1)[-1]
        if not RELEASE_FILE.fullmatch(name):
            self.send_error(404)
            return
        data = release_file(self.folder, name).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="session")
def mirror(tmp_path_factory):
    """``CGAVIT_WEIGHTS_MIRROR`` for a local server of generated release files, and the folder they are in."""
    folder = tmp_path_factory.mktemp("release")
    handler = type("Handler", (ReleaseHandler,), {"folder": folder})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", folder
    server.shutdown()


def small_image_folder(digits: Path, root: Path, train: int = 4, val: int = 2) -> None:
    """``root/{train,val}/<digit>/``: the first few digits images of each class (a stand-in for ImageNet)."""
    for split, count in (("train", train), ("val", val)):
        for cls in sorted((digits / split).iterdir()):
            (root / split / cls.name).mkdir(parents=True)
            for img in sorted(cls.iterdir())[:count]:
                shutil.copy(img, root / split / cls.name / img.name)


def photos(digits: Path, root: Path) -> None:
    """``cat.png`` (RGB, 96x64) and ``scan.tif`` (16-bit grayscale): two digits images in other modes."""
    first = sorted((digits / "val" / "3").iterdir())[0]
    with Image.open(first) as im:
        im.convert("RGB").resize((96, 64)).save(root / "cat.png")
        Image.fromarray(np.asarray(im, dtype=np.uint16) * 256).save(root / "scan.tif")


@pytest.fixture(scope="session")
def workspace(tmp_path_factory, trained_digits):
    """What every page's scratch folder starts with (module docstring), built once."""
    root = tmp_path_factory.mktemp("docs-workspace")
    (root / "runs" / "demo" / "run").mkdir(parents=True)
    shutil.copy(trained_digits.checkpoint, root / "runs" / "demo" / "run" / "model.safetensors")
    (root / "runs" / "demo" / "data").symlink_to(trained_digits.data)
    small_image_folder(trained_digits.data, root / "imagenet")
    photos(trained_digits.data, root)
    return root


@pytest.fixture(scope="session")
def tools(tmp_path_factory):
    """A folder for the PATH: ``cgavit`` and ``torchrun`` of this checkout's Python."""
    bin_dir = tmp_path_factory.mktemp("docs-bin")
    for name, args in {"cgavit": "-m cgavit", "torchrun": "-m torch.distributed.run"}.items():
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {args} "$@"\n')
        (bin_dir / name).chmod(0o755)
    return bin_dir


# ------------------------------------------------------------------------------------ the pages run
@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_examples_run(page, workspace, mirror, tools, tmp_path, monkeypatch):
    blocks, page_wide = parse_page(page)
    assert not unused_page_directives(blocks, page_wide), f"{page}: page directives match no block"
    scratch = tmp_path / "page"
    shutil.copytree(workspace, scratch, symlinks=True)
    url, release = mirror
    for name in sorted(set(RELEASE_FILE.findall((REPO / page).read_text()))):
        os.symlink(release_file(release, name), scratch / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "CGAVIT_WEIGHTS_MIRROR": url,
           "TORCH_HOME": str(tmp_path / "torch-home"), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1",
           **page_wide.env}
    for key in ("CGAVIT_WEIGHTS_MIRROR", "TORCH_HOME", "MPLBACKEND"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.chdir(scratch)
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for block in blocks:
        if block.lang not in RUN_LANGS:
            assert block.lang in SHOWN_LANGS, f"{block.where}: label the block (```text, ```json, ...) or make it run"
            continue
        if (page, block.first_line) in NOT_RUN:
            continue
        start = time.perf_counter()
        code = apply_directives(block.code, block.directives, block.where)
        code = apply_directives(code, page_wide, block.where, strict=False)
        if block.lang == "python":
            run_python(block, code, namespace)
        elif block.directives.serve:
            run_servers(block, code, scratch, {**env, **block.directives.env})
        else:
            run_bash(block, code, scratch, {**env, **block.directives.env})
        ran += 1
        print(f"{block.where}: {time.perf_counter() - start:.1f} s")
    listed = [key for key in NOT_RUN if key[0] == page]
    assert ran or listed or not any(b.lang in RUN_LANGS for b in blocks)


def test_not_run_blocks_still_exist():
    """Every NOT_RUN entry names a block that is there (the list cannot outlive the pages)."""
    firsts = {(page, b.first_line) for page in RUN_PAGES for b in parse_page(page)[0]}
    assert set(NOT_RUN) <= firsts, sorted(set(NOT_RUN) - firsts)


# ------------------------------------------------------------------------------------ stated figures
def test_readme_variant_table_matches_the_models():
    rows = re.findall(r"^\| (efficientvit_m\d) \| ([\d.]+) \| (\d+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \|$",
                      (REPO / "README.md").read_text(), re.M)
    assert [r[0] for r in rows] == cgavit.list_models()
    for name, params, macs, widths, depths, heads, top1 in rows:
        with torch.device("meta"):
            model = cgavit.create_model(name)
        assert f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}" == params, name
        cfg, published = model.cfg, cgavit.VARIANTS[name]
        assert (",".join(map(str, cfg.embed_dim)), ",".join(map(str, cfg.depth)), ",".join(map(str, cfg.num_heads))) \
            == (widths, depths, heads), name
        assert (round(published.macs_m), published.top1) == (int(macs), float(top1)), name


# ------------------------------------------------------------------------------------ links
def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (repeated headings get ``-1``, ``-2``, ... as on GitHub).

    Inline code stays in a heading's text, as GitHub keeps it: "what `auto` judged on" is ``what-auto-judged-on``.
    """
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", outside_code(page.read_text(), inline=False), re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize("page", LINKED_PAGES)
def test_relative_links_and_anchors_resolve(page):
    path = REPO / page
    broken = []
    for target in LINK.findall(outside_code(path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL: not checked offline
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(REPO) if REPO in dest.parents else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page}: " + "; ".join(broken)


def test_architecture_names_only_paths_that_exist():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    names = set(re.findall(r"`([\w/]+\.py|[\w]+/)`", text))
    missing = [n for n in sorted(names) if not ((REPO / "cgavit" / n).exists() or (REPO / n).exists()
                                                 or any((REPO / "cgavit").rglob(n.rstrip("/"))))]
    assert names and not missing, f"docs/ARCHITECTURE.md names {missing}, which are not in the tree"


def resolves(dotted: str) -> bool:
    """Whether ``cgavit.a.b`` is a module, or an attribute of the longest importable prefix."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for name in parts[n:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("page", LINKED_PAGES)
def test_cgavit_names_in_backticks_exist(page):
    text = (REPO / page).read_text()
    names = set(re.findall(r"`(cgavit(?:\.[A-Za-z_]\w*)+)", text))
    missing = sorted(n for n in names if not resolves(n))
    assert not missing, f"{page} names {missing}, which cgavit does not have"


def test_readme_lists_every_command():
    commands = re.findall(r"^ {4}(\w+) ", build_parser().format_help(), re.M)
    listed = re.search(r"`cgavit --help` lists the commands \(([^)]*)\)", (REPO / "README.md").read_text(), re.S)
    assert commands and listed, "the README's command list or cgavit --help's has moved"
    assert sorted(re.findall(r"`(\w+)`", listed.group(1))) == sorted(commands)
