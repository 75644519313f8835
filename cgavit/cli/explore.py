"""``cgavit explore``: serve the CGA Explorer page until Ctrl-C."""

from __future__ import annotations

import argparse
import errno
from pathlib import Path

from ..explorer import ImageAttention, build_model, make_server
from ..explorer.guard import is_loopback, split_host
from . import Terminated
from .common import add_dial_args, dials_from_args, image_size


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.img_size is not None:
        image_size(args.img_size, "--img-size")
    host = listen_address(args.host)
    for name in args.allow_host:
        if split_host(name)[1] is not None:
            raise ValueError(f"--allow-host takes a host name without a port, got {name!r}")
    loaded = build_model(args.checkpoint, args.model, args.img_size, trust=args.trust_checkpoint, **dials_from_args(args))
    try:
        server = make_server(host, args.port, ImageAttention(*loaded), allow_hosts=tuple(args.allow_host))
    except OSError as err:
        port_taken = err.errno in (errno.EADDRINUSE, errno.EACCES)
        fix = ("choose another --port (0 = any free)" if port_taken else
               "give --host an address of this machine (default 127.0.0.1; 0.0.0.0: every interface)")
        raise ValueError(f"cannot listen on {args.host} port {args.port} ({err.strerror or err}); {fix}") from None
    print(f"CGA Explorer: {server.url}", flush=True)
    print(f"image panel model: {loaded.about}", flush=True)
    if not is_loopback(host):
        print(f"warning: listening on {host or 'every interface'}, reachable from other machines", flush=True)
    print("press Ctrl-C to stop", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt as stop:  # Ctrl-C is how the server is stopped: status 0
        if isinstance(stop, Terminated):  # a SIGTERM ends it as any command: "terminated", 143
            raise
    finally:
        server.server_close()
    return 0


def listen_address(host: str) -> str:
    """``--host`` as the address to bind: an IPv6 address as written in a URL (``[::1]``) without its brackets.

    Raises:
        ValueError: a port in it (``localhost:8080``: the port is ``--port``), or a malformed bracketed address.
    """
    if not (host.startswith("[") or host.count(":") == 1):  # a name, an IPv4 address, a bare IPv6 one or ""
        return host
    name, port = split_host(host)
    if port is not None:
        raise ValueError(f"--host takes an address without a port, got {host!r}; give the port with --port")
    return name


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explore",
        help="serve the CGA Explorer page (heads, cascade, groups; your image's attention)",
        description=(
            "Serve the CGA Explorer: six tokens through cascaded group attention with the heads, cascade "
            "and channel groups you choose, and each head's attention over an image you upload, in a "
            "real model (--checkpoint, or a randomly initialised --model). Listens on 127.0.0.1 only "
            "unless --host says otherwise."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1; 0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    p.add_argument("--checkpoint", type=Path, default=None, help="weights for the image panel (cgavit, official or timm file)")
    p.add_argument("--model", default=None, help="variant for a checkpoint without recorded architecture, or the random model (default efficientvit_m0)")
    p.add_argument("--img-size", type=int, default=None, help="side the uploaded image is resized and centre-cropped to, 32..4096 "
                   "(default: the checkpoint's, else 224); a model whose attention maps or replies would outgrow the "
                   "explorer's memory bounds at this size is refused at start")
    p.add_argument(
        "--allow-host", action="append", default=[], metavar="NAME",
        help="also answer requests addressed to this host name (repeatable); by default only 127.0.0.1, "
        "localhost, [::1] and the --host address are answered, against DNS rebinding",
    )
    p.add_argument("--trust-checkpoint", action="store_true", help="allow pickled objects in the checkpoint (runs code from it: only for files you trust)")
    add_dial_args(p)
    p.set_defaults(func=run)
