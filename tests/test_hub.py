"""The pretrained download (cgavit/hub.py) against a local HTTP server this file starts: servers that never
answer or stall midway, downloads racing in threads, a cache folder that cannot be made, files left by killed
downloads. No test reaches the network beyond 127.0.0.1."""

import http.server
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import cgavit
from cgavit import hub
from cgavit.cli import main
from cgavit.io import CheckpointError, WriteError

NAME = "efficientvit_m0.pth"


class _Handler(http.server.BaseHTTPRequestHandler):
    """``/ok/NAME`` serves the file, ``/slow/NAME`` in pieces, ``/hang/NAME`` never answers, ``/hangmid/NAME``
    sends the headers and 1000 bytes then stalls, ``/trickle/NAME`` sends a byte every 20 ms, ``/redir/NAME``
    redirects to ``/ok/NAME``, ``/badlength/NAME`` sends the file with a Content-Length that is no number, ``/chunkcut/NAME`` one chunk of
    it and closes."""

    protocol_version = "HTTP/1.1"
    data = b""
    release = threading.Event()  # set when the test ends: stalled handlers return

    def log_message(self, *args):
        pass

    def do_GET(self):
        mode = self.path.split("/")[1]
        if mode == "hang":
            self.release.wait(30)
            return
        if mode == "redir":
            self._send(302, b"", Location=f"/ok/{NAME}")
            return
        if mode == "chunkcut":  # a chunked body whose connection closes before its last chunk
            self._send(200, None, **{"Transfer-Encoding": "chunked", "Connection": "close"})
            self.wfile.write(b"%x\r\n%s\r\n" % (1000, self.data[:1000]))
            self.close_connection = True
            return
        if mode == "badlength":  # a length http.client ignores, reading to the end of the connection
            self._send(200, None, **{"Content-Length": "9.8 MB", "Connection": "close"})
            self.wfile.write(self.data)
            self.close_connection = True
            return
        self._send(200, None, **{"Content-Length": str(len(self.data))})
        if mode == "hangmid":
            self.wfile.write(self.data[:1000])
            self.wfile.flush()
            self.release.wait(30)
        elif mode == "trickle":  # a byte at a time: never a pause long enough to time a read out
            for i in range(len(self.data)):
                if self.release.is_set():
                    return
                self.wfile.write(self.data[i:i + 1])
                self.wfile.flush()
                time.sleep(0.02)
        elif mode == "slow":
            for i in range(0, len(self.data), len(self.data) // 8 + 1):
                self.wfile.write(self.data[i:i + len(self.data) // 8 + 1])
                self.wfile.flush()
                time.sleep(0.05)
        else:
            self.wfile.write(self.data)

    def _send(self, code, body, **headers):
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        if body is not None:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)


@pytest.fixture(scope="module")
def release_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("release") / NAME
    torch.save({"model": cgavit.create_model("efficientvit_m0").state_dict()}, path)
    return path.read_bytes()


@pytest.fixture
def server(release_bytes, tmp_path, monkeypatch):
    """A local server (the address, ``http://127.0.0.1:PORT``), the mirror and an empty torch hub cache."""
    handler = type("Handler", (_Handler,), {"data": release_bytes, "release": threading.Event()})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    # generous for the servers that answer (0.5 s once cut a download of three threads short on a loaded 2-core
    # machine); the stall tests shorten it
    monkeypatch.setattr(hub, "STALL_TIMEOUT", 10.0, raising=False)
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    handler.release.set()
    srv.shutdown()
    srv.server_close()


def _cache():
    return os.path.join(torch.hub.get_dir(), "checkpoints")


def _in_thread(call, seconds=20):
    """Run ``call`` in a thread; its exception (or None), failing the test when it is still running after ``seconds``."""
    out = []

    def run():
        try:
            call()
            out.append(None)
        except Exception as err:
            out.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: the download hangs"
    return out[0]


@pytest.mark.parametrize("mode", ["hang", "hangmid"])
def test_a_server_that_stalls_ends_the_download_with_a_message(server, monkeypatch, mode):
    """D4: a mirror that never answered, or stopped sending midway, hung pretrained=True forever."""
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", f"{server}/{mode}")
    monkeypatch.setattr(hub, "STALL_TIMEOUT", 0.5)
    err = _in_thread(lambda: cgavit.create_model("efficientvit_m0", pretrained=True))
    assert isinstance(err, CheckpointError), err
    assert "no data for 0.5 s" in str(err) and "by hand" in str(err)
    assert os.listdir(_cache()) == []  # nothing cached, no temporary left


def test_a_server_that_trickles_ends_the_download_with_a_message(server, monkeypatch):
    """A byte every 20 ms never let a read time out: the 9.8 MB file would have taken days, "never hangs" did not hold."""
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", f"{server}/trickle")
    monkeypatch.setattr(hub, "STALL_TIMEOUT", 0.5)
    err = _in_thread(lambda: cgavit.create_model("efficientvit_m0", pretrained=True))
    assert isinstance(err, CheckpointError) and "under 64 KiB for 0.5 s" in str(err), err
    assert os.listdir(_cache()) == []


def test_the_download_takes_what_a_checkpoint_file_takes_and_nothing_else(tmp_path, monkeypatch):
    """The download's check was torch.load alone: a release file holding an argparse.Namespace (as training scripts
    save their options) was refused though --checkpoint reads it, and a torch file of no weights (a lone tensor) was
    cached, failing every later call."""
    import argparse

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", mirror.as_uri())
    weights = cgavit.create_model("efficientvit_m1").state_dict()
    torch.save({"model": weights, "args": argparse.Namespace(lr=1e-3)}, mirror / "efficientvit_m1.pth")
    torch.save(torch.zeros(3), mirror / NAME)
    loaded = cgavit.create_model("efficientvit_m1", pretrained=True)
    assert torch.equal(loaded.head.linear.weight, weights["head.linear.weight"])
    with pytest.raises(CheckpointError, match="is not a weights file .*holds no state dict.*nothing was cached"):
        cgavit.create_model("efficientvit_m0", pretrained=True)
    assert os.listdir(_cache()) == ["efficientvit_m1.pth"]


def test_files_left_by_killed_downloads_are_removed(server, monkeypatch):
    """D4: a killed download left its temporary in the cache, and nothing ever removed it."""
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", f"{server}/ok")
    os.makedirs(_cache())
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(ended.stdout)
    left = [f".{NAME}.{dead}.part.0123abcd.partial", f".{NAME}.{dead}.0123abcd.part"]  # earlier and current names
    kept = [f".{NAME}.{os.getppid()}.0123abcd.part", "other.pth"]  # a live process's download; another file
    for name in left + kept:
        path = os.path.join(_cache(), name)
        open(path, "wb").close()
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    cgavit.create_model("efficientvit_m0", pretrained=True)
    assert sorted(os.listdir(_cache())) == sorted([*kept, NAME])


def test_downloads_of_one_file_in_threads_all_succeed(server, monkeypatch):
    """D7: threads of one process shared the temporary file's name; all but one died on a FileNotFoundError."""
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", f"{server}/slow")
    results = [None] * 3
    start = threading.Barrier(3)

    def load(i):
        start.wait()
        try:
            cgavit.create_model("efficientvit_m0", pretrained=True)
            results[i] = "ok"
        except Exception as err:
            results[i] = f"{type(err).__name__}: {err}"

    threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == ["ok"] * 3
    assert os.listdir(_cache()) == [NAME]


def test_a_cache_folder_that_cannot_be_made_is_one_clear_error(server, monkeypatch, tmp_path, capsys):
    """D8: a TORCH_HOME under a file gave a NotADirectoryError traceback (exit 1)."""
    blocker = tmp_path / "afile"
    blocker.write_text("")
    _cache_refused(blocker, f"{server}/ok", rf"cache folder {blocker}.*TORCH_HOME.*torch\.hub\.set_dir", "TORCH_HOME",
                   monkeypatch, tmp_path, capsys)


def _cache_refused(home, mirror: str, match: str, says: str, monkeypatch, tmp_path, capsys) -> None:
    """With the torch hub cache under ``home``, the published weights are refused with the ``WriteError`` that
    matches ``match``, and ``cgavit predict --pretrained`` exits 2 with a line saying ``says``, no traceback."""
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", mirror)
    with pytest.raises(WriteError, match=match):
        cgavit.create_model("efficientvit_m0", pretrained=True)
    assert main(["predict", str(tmp_path / "x.png"), "--model", "efficientvit_m0", "--pretrained", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_a_read_only_cache_folder_is_one_clear_error(server, monkeypatch, mount_tmpfs, tmp_path, capsys):
    """In a cache folder on a read-only disk, removing the temporary file that could not be made failed too (EROFS,
    not 'no such file'), and that bare OSError replaced the error saying the disk is read-only and what to do."""
    ro = mount_tmpfs(folders=("hub/checkpoints",), read_only=True)
    _cache_refused(ro, f"{server}/ok", r"cache folder .* read-only; .*TORCH_HOME", "read-only", monkeypatch, tmp_path, capsys)


def test_a_folder_where_the_weights_go_is_named_before_the_download(server, monkeypatch, tmp_path):
    """A folder at the cached file's path was found after the whole download, which was then thrown away, and the
    message named the cache folder, not what was in the way."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", f"{server}/ok")
    in_the_way = tmp_path / "home" / "hub" / "checkpoints" / "efficientvit_m0.pth"
    in_the_way.mkdir(parents=True)
    fetched = []
    monkeypatch.setattr(hub, "_fetch", lambda *args: fetched.append(args))
    with pytest.raises(WriteError, match=rf"holds a folder .* at {in_the_way}, where the weights go"):
        cgavit.create_model("efficientvit_m0", pretrained=True)
    assert fetched == []


def test_a_chunked_download_cut_short_says_so(server, monkeypatch):
    """A chunked response cut short failed with 'IncompleteRead(0 bytes read)', saying neither what happened nor
    that nothing was cached."""
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", f"{server}/chunkcut")
    with pytest.raises(CheckpointError, match="closed before the end of the file; nothing was cached. Try again"):
        cgavit.create_model("efficientvit_m0", pretrained=True)
    assert os.listdir(_cache()) == []


def test_a_content_length_that_is_no_number_is_ignored_as_http_client_does(server, monkeypatch, release_bytes):
    """int() of the header failed the download with 'invalid literal for int() with base 10', where http.client
    itself reads such a response to the end."""
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", f"{server}/badlength")
    cgavit.create_model("efficientvit_m0", pretrained=True)
    with open(os.path.join(_cache(), NAME), "rb") as f:
        assert f.read() == release_bytes


def test_redirects_and_file_mirrors_still_work(server, monkeypatch, tmp_path, release_bytes):
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", f"{server}/redir")
    cgavit.create_model("efficientvit_m0", pretrained=True)
    with open(os.path.join(_cache(), NAME), "rb") as f:
        assert f.read() == release_bytes
    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror" / NAME).write_bytes(release_bytes)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th2"))
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", (tmp_path / "mirror").as_uri())
    cgavit.create_model("efficientvit_m0", pretrained=True)
    assert os.listdir(_cache()) == [NAME]


def test_ema_asked_of_the_published_weights_says_they_hold_none(release_bytes, tmp_path, monkeypatch, caplog):
    """``load_model(None, name, pretrained=True, use_ema=True)`` (``eval --model m0 --pretrained --ema``) used the
    published weights without a word, as a file without EMA weights already warns."""
    import logging

    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror" / NAME).write_bytes(release_bytes)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", (tmp_path / "mirror").as_uri())
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        cgavit.load_model(None, "efficientvit_m0", pretrained=True, use_ema=True)
    assert "the published weights of efficientvit_m0 hold no EMA weights; --ema changes nothing" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cgavit"):
        cgavit.load_model(None, "efficientvit_m0", pretrained=True)
    assert "EMA" not in caplog.text


def test_a_mirror_given_as_a_plain_folder_path_is_read_from_that_folder(tmp_path, monkeypatch, release_bytes):
    """CGAVIT_WEIGHTS_MIRROR=/srv/weights (a folder, not a file:// URL) failed with urllib's 'unknown url type'."""
    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror" / NAME).write_bytes(release_bytes)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    monkeypatch.chdir(tmp_path)
    for given in (str(tmp_path / "mirror"), "mirror/", f"  {tmp_path / 'mirror'}  "):
        monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", given)
        assert hub.release_url(f"https://example.org/v1/{NAME}") == (tmp_path / "mirror" / NAME).as_uri()
    cgavit.create_model("efficientvit_m0", pretrained=True)
    assert os.listdir(_cache()) == [NAME]


def test_a_mirror_serving_another_variant_under_the_name_caches_nothing(tmp_path, monkeypatch, release_bytes):
    """A mirror serving M1's weights as efficientvit_m0.pth had them cached: every later call failed without
    downloading again, saying to delete the file, and deleting it downloaded the same wrong file."""
    (tmp_path / "mirror").mkdir()
    torch.save({"model": cgavit.create_model("efficientvit_m1").state_dict()}, tmp_path / "mirror" / NAME)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", (tmp_path / "mirror").as_uri())
    with pytest.raises(CheckpointError, match=r"refused: it is not the published efficientvit_m0 weights .*shape "
                                              r"mismatch.*nothing was cached .*another file under that name"):
        cgavit.create_model("efficientvit_m0", pretrained=True)
    assert os.listdir(_cache()) == []
    (tmp_path / "mirror" / NAME).write_bytes(release_bytes)  # the right file: a class count of the caller's still loads
    assert cgavit.create_model("efficientvit_m0", pretrained=True, num_classes=10).num_classes == 10
    assert os.listdir(_cache()) == [NAME]


class _RunsCode:
    def __reduce__(self):
        return (os.getpid, ())


def test_a_download_with_pickled_code_is_refused_saying_so(tmp_path, monkeypatch):
    """A release file holding pickled objects was refused as 'cut short, or an error page', with an opt-in
    (load_checkpoint(..., trust=True)) that pretrained=True does not have."""
    (tmp_path / "mirror").mkdir()
    weights = cgavit.create_model("efficientvit_m0").state_dict()
    torch.save({"model": weights, "x": _RunsCode()}, tmp_path / "mirror" / NAME)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", (tmp_path / "mirror").as_uri())
    with pytest.raises(CheckpointError) as caught:
        cgavit.create_model("efficientvit_m0", pretrained=True)
    text = str(caught.value)
    assert "holds pickled Python objects" in text and "download it by hand and load it with trust=True" in text
    assert "cut short" not in text
    assert os.listdir(_cache()) == []


def test_fine_tuning_from_the_published_weights_is_not_warned_about(tmp_path, monkeypatch, release_bytes, caplog):
    """pretrained=True with another num_classes is a new task by definition: its new classifier is noted at INFO,
    where a checkpoint_path file of another class count is warned about."""
    import logging

    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror" / NAME).write_bytes(release_bytes)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    monkeypatch.setenv("CGAVIT_WEIGHTS_MIRROR", str(tmp_path / "mirror"))
    with caplog.at_level(logging.INFO, logger="cgavit"):
        cgavit.create_model("efficientvit_m0", pretrained=True, num_classes=10)
    assert "classifier left as initialised" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
