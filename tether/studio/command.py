"""`tether studio`: serve the studio (app.py) until Ctrl-C.

Bound to 127.0.0.1 by default. Binding any other address makes a random token, printed once with
the URL, that every request must carry (app.py's guard): the studio reads run directories and
writes label files, which nobody else on the network should do.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
from dataclasses import dataclass, field
from typing import Annotated

from tether.constraints import PositiveInt, Range, Seed
from tether.errors import UserError


@dataclass
class StudioConfig:
    runs_dir: str = "runs"
    "the directory whose runs the Runs page lists (read only)"
    host: str = "127.0.0.1"
    "address to bind; anything but loopback requires the printed token on every request"
    port: Annotated[int, Range(ge=0, le=65535)] = 7860
    "TCP port (0: any free port)"
    model: str = ""
    "a policy (HF folder) the pages sample from live; '' = pages use run files and the gold-reward world"
    labels_dir: str = ""
    "where the labeler appends its preference JSONL ('' = <runs_dir>/studio-labels)"
    label_source: str = "world"
    "the labeler's pairs: 'world' (the gold-reward world's writer), a preference or prompt-completion JSONL, or 'model' (two temperatures of `model`)"
    label_prompts: str = ""
    "prompts of label_source=model: a prompt-only JSONL ('' = the gold-reward world's prompts)"
    label_temperatures: list[float] = field(default_factory=lambda: [0.7, 1.3])
    "label_source=model: the two sampling temperatures whose completions are compared"
    retrain_every: PositiveInt = 5
    "the labeler's Bradley-Terry model retrains in the background after every this many labels"
    seed: Seed = 0
    "seed of the labeler's pair order and the world's writer"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_studio(cfg: StudioConfig) -> dict:
    try:
        import uvicorn

        from tether.studio.app import create_app
    except ImportError as e:
        raise UserError(f"tether studio needs its extra: pip install 'tether[studio]' ({e})") from None
    token = None if is_loopback(cfg.host) else secrets.token_urlsafe(24)
    app = create_app(cfg, token=token)
    # Bind here, not in uvicorn: the URL printed names the port really bound (port=0 picks one),
    # and a port in use is one line, before anything is served.
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as e:
        sock.close()
        raise UserError(f"studio: cannot bind {cfg.host}:{cfg.port}: {e.strerror}") from None
    sock.listen(2048)  # connections wait in the backlog until uvicorn serves: the URL works once printed
    port = sock.getsockname()[1]
    shown = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    print(f"tether studio: http://{shown}:{port}/" + (f"?token={token}" if token else ""), flush=True)
    if token:
        print("tether studio: bound beyond loopback: every request needs the token above (shown only once)",
              flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    return {}
