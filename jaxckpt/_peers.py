"""Copies of local parts between processes, over TCP: the one owner of the peer protocol.

With `LocalTier(replicas=r)`, each process's part goes to r other processes (`holders`: the
next ones in the ring of processes that run on another machine), so that a process whose
directory is lost gets its part back from a peer. A process never opens
another process's directory: on a pod that is another machine's disk. Each process listens
on a port of its own in a thread of its own (beside XLA's collectives, never among them:
a background transfer issuing collectives could interleave with a training step's on other
processes); the job's processes exchange their addresses and a random token each once, by a
collective when the manager is made, and a peer must present the listener's token.

A request is a header (4-byte length, then JSON) and, for a put, the files' bytes:

    put  {token, op: "put", owner, step, files: [[rel, size, xxh3_128], ...]}  + bytes
         -> {"ok": true} once the copy is written, checked and renamed into place
    get  {token, op: "get", owner, step}
         -> {"ok": true, files: [[rel, size, xxh3_128], ...]} + bytes, or {"ok": false, ...}

Copies live in the holder's directory as `replicas/<owner>/<step>/` (the owner's step folder
as it is), written to `<step>.jaxckpt-tmp` and renamed: a copy is there whole or not at all.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from jax.experimental import multihost_utils

from jaxckpt import _integrity

log = logging.getLogger("jaxckpt")

REPLICAS = "replicas"
TMP_SUFFIX = ".jaxckpt-tmp"
TIMEOUT_S = 120.0  # any one socket operation
_MAX_HEADER = 2**20
_MAX_FILES = 4096
_CHUNK = 8 * 2**20
_ADDRESS_BYTES = 256
_REL = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")


class PeerError(Exception):
    """A transfer with a peer failed (its message says which and why)."""


def holders(process: int, machines: list[str], replicas: int) -> list[int]:
    """The processes that keep copies of `process`'s part: the next ones in the ring that
    run on other machines (losing a host loses all its processes' directories), then, if
    there are too few of those, the next ones on the same machine."""
    ring = [(process + k) % len(machines) for k in range(1, len(machines))]
    elsewhere = [p for p in ring if machines[p] != machines[process]]
    return (elsewhere + [p for p in ring if p not in elsewhere])[:replicas]


class Peers:
    """This process's listener, and every peer's address. `serve(owner, step)` gives the
    folder of a part this process can send (None: it has none); `received(owner, step,
    tmp)` is called for a copy put here, checked, before it is renamed into place, and
    returns its final folder."""

    def __init__(
        self,
        address: str,
        serve: Callable[[int, int], Path | None],
        receive: Callable[[int, int], Path],
        accept: Callable[[int, int, Path], None],
    ):
        self._serve, self._receive, self._accept = serve, receive, accept
        self._token = secrets.token_hex(16)
        self._server = socket.create_server((address, 0))
        self._server.settimeout(1.0)
        self._closed = threading.Event()
        port = self._server.getsockname()[1]
        self.addresses = _exchange(f"{address} {port} {self._token} {socket.gethostname()}")
        self._thread = threading.Thread(target=self._listen, name="jaxckpt-peers", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._server.close()

    # ------------------------------------------------------------------------- client

    def put(self, peer: int, owner: int, step: int, folder: Path) -> None:
        """Sends the part in `folder` to `peer`, which keeps it as a copy (PeerError)."""
        files = _files(folder)
        with self._connect(peer) as conn:
            _send_header(conn, self._request(peer, "put", owner, step, files=files))
            for rel, size, _ in files:
                _send_file(conn, folder / rel, size)
            reply = _read_header(conn)
        if not reply.get("ok"):
            raise PeerError(f"process {peer} refused the copy of step {step}: {reply.get('error')}")

    def get(self, peer: int, owner: int, step: int, dest: Path) -> None:
        """Receives `owner`'s part of `step` from `peer` into the new folder `dest`, each
        file checked against the size and hash the peer announced (PeerError)."""
        with self._connect(peer) as conn:
            _send_header(conn, self._request(peer, "get", owner, step))
            reply = _read_header(conn)
            if not reply.get("ok"):
                raise PeerError(
                    f"process {peer} has no copy of process {owner}'s step {step}: "
                    f"{reply.get('error')}"
                )
            _receive_files(conn, dest, _checked_files(reply.get("files")))

    def _request(self, peer: int, op: str, owner: int, step: int, **more: Any) -> dict:
        token = self.addresses[peer][2]
        return {"token": token, "op": op, "owner": owner, "step": step, **more}

    def _connect(self, peer: int) -> socket.socket:
        host, port, _, _ = self.addresses[peer]
        try:
            conn = socket.create_connection((host, port), timeout=TIMEOUT_S)
        except OSError as e:
            raise PeerError(f"process {peer} at {host}:{port} is unreachable: {e}") from e
        conn.settimeout(TIMEOUT_S)
        return conn

    # ------------------------------------------------------------------------- server

    def _listen(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(TIMEOUT_S)
            try:
                request = _read_header(conn)
                if not hmac.compare_digest(str(request.get("token")), self._token):
                    raise PeerError("a request without this job's token")
                owner, step = request.get("owner"), request.get("step")
                if not (type(owner) is int and type(step) is int and owner >= 0 and step >= 0):
                    raise PeerError("a request without an owner and a step")
                if request.get("op") == "put":
                    self._take(conn, owner, step, _checked_files(request.get("files")))
                    _send_header(conn, {"ok": True})
                elif request.get("op") == "get":
                    self._give(conn, owner, step)
                else:
                    raise PeerError(f"an unknown request {request.get('op')!r}")
            except Exception as e:  # a peer's failure never stops this process
                log.warning("local tier: a peer's request failed: %s", e)
                with contextlib.suppress(OSError):  # the peer may be gone already
                    _send_header(conn, {"ok": False, "error": str(e)[:500]})

    def _take(self, conn: socket.socket, owner: int, step: int, files: list) -> None:
        final = self._receive(owner, step)
        tmp = final.with_name(final.name + TMP_SUFFIX)
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _receive_files(conn, tmp, files)
            self._accept(owner, step, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _give(self, conn: socket.socket, owner: int, step: int) -> None:
        folder = self._serve(owner, step)
        if folder is None:
            _send_header(conn, {"ok": False, "error": "no such part here"})
            return
        files = _files(folder)
        _send_header(conn, {"ok": True, "files": files})
        for rel, size, _ in files:
            _send_file(conn, folder / rel, size)


def _exchange(mine: str) -> list[tuple[str, int, str, str]]:
    """Every process's "address port token machine" (a collective)."""
    raw = mine.encode()
    if len(raw) > _ADDRESS_BYTES:
        raise PeerError(f"the address {mine!r} is too long")
    padded = np.zeros(_ADDRESS_BYTES, np.uint8)
    padded[: len(raw)] = np.frombuffer(raw, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, _ADDRESS_BYTES)
    out = []
    for row in every:
        host, port, token, machine = bytes(row).rstrip(b"\0").decode().split(" ", 3)
        out.append((host, int(port), token, machine))
    return out


def _files(folder: Path) -> list[list]:
    """Every regular file below `folder`: [rel, size, xxh3_128 hex] each, sorted."""
    out = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            path = Path(root) / name
            if path.is_symlink() or not path.is_file():
                raise PeerError(f"{path} is not a regular file")
            rel = str(path.relative_to(folder))
            out.append([rel, *_integrity.digest(folder, rel)])
    return out


def _checked_files(files: Any) -> list[tuple[str, int, str]]:
    """A peer's list of files, refused unless every path stays inside the folder."""
    if not isinstance(files, list) or len(files) > _MAX_FILES:
        raise PeerError("a list of files that is not one")
    out = []
    for entry in files:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise PeerError("a file entry that is not [path, size, hash]")
        rel, size, digest = entry
        if not (isinstance(rel, str) and _REL.fullmatch(rel) and ".." not in rel.split("/")):
            raise PeerError(f"a file path outside the folder: {str(rel)[:100]!r}")
        if not (type(size) is int and size >= 0 and isinstance(digest, str)):
            raise PeerError(f"{rel}: a size or hash that is not one")
        out.append((rel, size, digest))
    return out


def _send_header(conn: socket.socket, doc: dict) -> None:
    raw = json.dumps(doc).encode()
    conn.sendall(struct.pack(">I", len(raw)) + raw)


def _read_header(conn: socket.socket) -> dict:
    (size,) = struct.unpack(">I", _read_exactly(conn, 4))
    if size > _MAX_HEADER:
        raise PeerError(f"a header of {size} bytes")
    doc = json.loads(_read_exactly(conn, size))
    if not isinstance(doc, dict):
        raise PeerError("a header that is not a JSON object")
    return doc


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = conn.recv(min(size - len(buf), _CHUNK))
        if not chunk:
            raise PeerError(f"the peer closed the connection after {len(buf)} of {size} bytes")
        buf += chunk
    return bytes(buf)


def _send_file(conn: socket.socket, path: Path, size: int) -> None:
    with open(path, "rb") as f:
        sent = conn.sendfile(f, 0, size)
    if sent != size:
        raise PeerError(f"{path} changed while it was sent ({sent} of {size} bytes)")


def _receive_files(conn: socket.socket, dest: Path, files: list) -> None:
    """The files' bytes from `conn` into the new folder `dest`, each checked and fsynced."""
    dest.mkdir(parents=True)
    for rel, size, digest in files:
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        h, left = xxhash.xxh3_128(), size
        with open(path, "xb") as f:
            while left:
                chunk = conn.recv(min(left, _CHUNK))
                if not chunk:
                    raise PeerError(f"the peer closed the connection during {rel}")
                h.update(chunk)
                f.write(chunk)
                left -= len(chunk)
            f.flush()
            os.fsync(f.fileno())
        if h.hexdigest() != digest:
            raise PeerError(f"{rel} arrived changed (checksum mismatch)")
