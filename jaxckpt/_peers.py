"""Copies of local parts between processes, over TCP: the one owner of the peer protocol.
The copies' folder it fills, `replicas/`, is `jaxckpt._replicas`'.

With `LocalTier(replicas=r)`, each process's part goes to r other processes (`holders`: the
next ones in the ring of processes that run on another machine), so that a process whose
directory is lost gets its part back from a peer. A process never opens another process's
directory: on a pod that is another machine's disk. Each process listens on a port of its
own in a thread of its own (beside XLA's collectives, never among them: a background
transfer issuing collectives could interleave with a training step's on other processes).

When and to whom copies go, and what `wait()` waits for, is `jaxckpt._local`'s: in
threads of their own, never on the training thread. Any one socket operation that stalls
for `LocalTier.copy_timeout_s` fails its transfer (PeerError, naming the peer).

Protocol. The job's processes exchange their addresses and a random key each once, by a
collective when the manager is made; a key never goes over TCP. A connection carries one
request; a header is a 4-byte length, then JSON:

    listener -> {"challenge": <32 random hex digits, this connection's own>}
    client   -> {op, owner, step, [files], [delta], mac}
                mac: HMAC-SHA256 with the listener's key over the challenge, a newline and
                the request without `mac` (JSON, keys sorted, no spaces)
    put:  -> {"ok": true, "delta": bool} (send) or {"ok": false, error}; then the files'
             bytes: only the blocks `delta` names if the listener said so, else all
          -> {"ok": true} once the copy is written, checked and in place, or {"ok": false, error}
    get:  -> {"ok": true, files} + the files' bytes, or {"ok": false, error}

`files` is [[rel, size, xxh3_128], ...]; every file is checked against it as it arrives.
`delta` ({base, block, send}: `jaxckpt._peer_files`) names the blocks of each file that
changed since step `base`, the last part this holder took from this process; the holder
takes the others from its copy of `base`, if it keeps it still. A
request whose mac does not match is refused: without the key none can be made, and a
captured one cannot be replayed (another connection, another challenge). Not covered: the
traffic is not encrypted, and what follows a request's header is checked by xxh3 (against
damage, not an attacker that alters the traffic in flight).

Copies live in the holder's directory as `replicas/<owner>/<step>/` (the owner's step
folder as it is), written to `<step>-<random>.jaxckpt-tmp` and renamed: a copy is there
whole or not at all. A put never rolls copies back: it is refused when the holder keeps a
copy of a newer step of that owner received since it started, and it never deletes a newer
one; copies of a timeline that did not go on are dropped by the holder itself (`drop`: at
each of its saves, those from before it started of that step or newer; and every newer one
when it restores an older step, or its own saves go back). No link is followed anywhere
under the local directory (`jaxckpt._replicas.folder`).
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from jaxckpt import _agree
from jaxckpt._peer_files import (
    BLOCK_BYTES,
    PeerError,
    changed,
    checked_delta,
    checked_files,
    files_of,
    receive_files,
    send_file,
)
from jaxckpt._replicas import REPLICAS, TMP_SUFFIX, discard, drop_copies, fsync_folder, steps_in
from jaxckpt._replicas import folder as _folder

log = logging.getLogger("jaxckpt")

_MAX_HEADER = 2**20
_MAX_FILES = 4096
_CHUNK = 8 * 2**20
_ADDRESS_BYTES = 256
_REL = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")


class _Silent(PeerError):
    """The peer closed the connection before it sent a byte."""


class Address(NamedTuple):
    host: str
    port: int
    key: bytes
    machine: str


def holders(process: int, machines: list[str], replicas: int) -> list[int]:
    """The processes that keep copies of `process`'s part: the next ones in the ring that
    run on other machines (losing a host loses all its processes' directories), then, if
    there are too few of those, the next ones on the same machine."""
    ring = [(process + k) % len(machines) for k in range(1, len(machines))]
    elsewhere = [p for p in ring if machines[p] != machines[process]]
    return (elsewhere + [p for p in ring if p not in elsewhere])[:replicas]


class Peers:
    """This process's listener, and every peer's address (`addresses`, by process index).

    `root` is this process's local directory: its own parts are `root/<step>`, the copies
    it keeps `root/replicas/<owner>/<step>`. `check(owner, step, folder)` checks a copy
    received (PeerError if it is not `owner`'s part of `step`) before it is put in place;
    `keep` copies of each owner are kept; `tried(owner, step)` is called once a put from
    `owner` (signed) is over, whether the copy is in place or not.
    """

    def __init__(
        self,
        address: str,
        root: Path,
        *,
        check: Callable[[int, int, Path], None],
        tried: Callable[[int, int], None],
        keep: int,
        timeout_s: float,
    ):
        self.root, self.timeout_s = root, timeout_s
        self._check, self._tried, self._keep = check, tried, keep
        self._key = secrets.token_bytes(16)
        self._server = socket.create_server((address, 0))
        self._closed = threading.Event()
        self._lock = threading.Lock()  # the copies' folders, and who put what since start:
        self._fresh: set[tuple[int, int]] = set()  # (owner, step)
        self._open: set[socket.socket] = set()  # the connections of put and get, for close
        self._sent: dict[int, tuple[int, dict]] = {}  # each holder's last part: step, blocks
        port = self._server.getsockname()[1]
        self.addresses = _exchange(f"{address} {port} {self._key.hex()} {socket.gethostname()}")
        self._listener = threading.Thread(target=self._listen, name="jaxckpt-peers", daemon=True)
        self._listener.start()

    def close(self) -> None:
        """Stops listening; a put or get in flight is cut off."""
        self._closed.set()
        with contextlib.suppress(OSError):  # wakes the listener's accept(), which then stops
            socket.create_connection(self._server.getsockname()[:2], timeout=1.0).close()
        with self._lock:
            for conn in self._open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self._listener.join(timeout=5)
        self._server.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def where(self, peer: int) -> str:
        """`process <peer> (<host>:<port>)`, for messages."""
        host, port, _, _ = self.addresses[peer]
        return f"process {peer} ({host}:{port})"

    # ------------------------------------------------------------------------- client

    def put(self, peer: int, owner: int, step: int, rel: str) -> None:
        """Sends the part in `root/<rel>` to `peer`, which keeps it as its copy of `owner`'s
        part of `step` (PeerError; OSError if the part cannot be read here): only the blocks
        that changed since the last part `peer` took, if it still keeps that copy."""
        with _folder(self.root, rel) as folder:
            files, blocks = files_of(folder)
            last = self._sent.pop(peer, None)  # (until this one is in place)
            send = None
            if last is not None and last[0] < step:
                base, send = last[0], changed(last[1], blocks)
            with self._connect(peer) as conn:
                request = {"op": "put", "owner": owner, "step": step, "files": files}
                if send is not None:
                    request["delta"] = {"base": base, "block": BLOCK_BYTES, "send": send}
                self._request(conn, peer, request)
                reply = _read_header(conn)
                if reply.get("ok"):
                    ranges = send if reply.get("delta") and send is not None else {}
                    for name, size, _ in files:
                        send_file(conn, folder, name, size, ranges.get(name))
                    reply = _read_header(conn)
        if not reply.get("ok"):
            raise PeerError(
                f"{self.where(peer)} refused the copy of step {step}: {reply.get('error')}"
            )
        self._sent[peer] = (step, blocks)

    def get(self, peer: int, owner: int, step: int, name: str) -> None:
        """Receives `owner`'s part of `step` from `peer` into the new folder `root/<name>`,
        each file checked against the size and hash the peer announced (PeerError)."""
        with self._connect(peer) as conn:
            self._request(conn, peer, {"op": "get", "owner": owner, "step": step})
            reply = _read_header(conn)
            if not reply.get("ok"):
                raise PeerError(
                    f"{self.where(peer)} has no copy of process {owner}'s step {step}: "
                    f"{reply.get('error')}"
                )
            files = checked_files(reply.get("files"))
            with _folder(self.root, "") as root:
                os.mkdir(root / name)
                with _folder(root, name) as dest:
                    receive_files(conn, dest, files)

    def _request(self, conn: socket.socket, peer: int, request: dict) -> None:
        challenge = _read_header(conn).get("challenge")
        if not isinstance(challenge, str):
            raise PeerError(f"{self.where(peer)} sent no challenge")
        mac = _mac(self.addresses[peer].key, challenge, request)
        _send_header(conn, {**request, "mac": mac})

    @contextlib.contextmanager
    def _connect(self, peer: int) -> Iterator[socket.socket]:
        """A connection to `peer`, cut off by `close`; a timeout or a reset is a PeerError
        naming the peer."""
        host, port, _, _ = self.addresses[peer]
        try:
            conn = socket.create_connection((host, port), timeout=self.timeout_s)
        except OSError as e:
            raise PeerError(f"{self.where(peer)} is unreachable: {e}") from e
        with self._lock:
            self._open.add(conn)
        try:
            with conn:
                yield conn
        except TimeoutError as e:
            raise PeerError(
                f"{self.where(peer)} did not answer within {self.timeout_s:.0f} s "
                "(stopped, overloaded or gone?)"
            ) from e
        except ConnectionError as e:
            raise PeerError(f"{self.where(peer)} closed the connection: {e}") from e
        finally:
            with self._lock:
                self._open.discard(conn)

    # ------------------------------------------------------------------------- server

    def _listen(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            if self._closed.is_set():  # (close's own connection, to wake this up)
                conn.close()
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.timeout_s)
            try:
                peer = "{}:{}".format(*conn.getpeername()[:2])
            except OSError:
                peer = "a peer"
            try:
                challenge = secrets.token_hex(16)
                _send_header(conn, {"challenge": challenge})
                request = _read_header(conn)
                mac = request.pop("mac", None)
                if not (
                    isinstance(mac, str)
                    and hmac.compare_digest(mac, _mac(self._key, challenge, request))
                ):
                    raise PeerError(
                        "a request not signed with this listener's key for this connection "
                        "(not from this job, or replayed)"
                    )
                owner, step = request.get("owner"), request.get("step")
                if not (type(owner) is int and type(step) is int and owner >= 0 and step >= 0):
                    raise PeerError("a request without an owner and a step")
                if request.get("op") == "put":
                    try:
                        files = checked_files(request.get("files"))
                        delta = request.get("delta")
                        delta = None if delta is None else checked_delta(delta, files, step)
                        self._take(conn, owner, step, files, delta)
                    finally:
                        self._tried(owner, step)
                    _send_header(conn, {"ok": True})
                elif request.get("op") == "get":
                    self._give(conn, owner, step)
                else:
                    raise PeerError(f"an unknown request {request.get('op')!r}")
            except _Silent:  # closed before a byte: `refuses`'s probe
                pass
            except Exception as e:  # a peer's failure never stops this process
                log.warning("local tier: a request from %s failed: %s", peer, e)
                with contextlib.suppress(OSError):  # the peer may be gone already
                    _send_header(conn, {"ok": False, "error": str(e)[:500]})

    def _take(
        self, conn: socket.socket, owner: int, step: int, files: list, delta: tuple | None
    ) -> None:
        with _folder(self.root, f"{REPLICAS}/{owner}", create=True) as at:
            with self._lock:
                self._refuse_rollback(at, owner, step)
            tmp = f"{step}-{secrets.token_hex(4)}{TMP_SUFFIX}"
            base = None  # the copy the delta's kept blocks come from, if it is still here
            if delta is not None and os.path.isdir(at / str(delta[0])):
                base = str(delta[0])
            try:
                os.mkdir(at / tmp)
                _send_header(conn, {"ok": True, "delta": base is not None})  # send the files
                with _folder(at, tmp) as dest, _folder(at, base or "") as earlier:
                    if base is None or delta is None:
                        received = receive_files(conn, dest, files)
                    else:
                        received = receive_files(conn, dest, files, earlier, delta[2])
                    self._check(owner, step, dest)
                log.debug(
                    "local tier: process %d's step %d: %d of its %d bytes received, the "
                    "rest kept from its step %s",
                    owner,
                    step,
                    received,
                    sum(size for _, size, _ in files),
                    base,
                )
                with self._lock:
                    self._refuse_rollback(at, owner, step)
                    if os.path.lexists(at / str(step)):
                        discard(at / str(step))
                    os.rename(at / tmp, at / str(step))
                    fsync_folder(at)
                    self._fresh.add((owner, step))
                    older = [s for s in steps_in(at) if s <= step]
                    for old in older[: -self._keep]:
                        discard(at / str(old))
                        self._fresh.discard((owner, old))
            except BaseException:
                shutil.rmtree(at / tmp, ignore_errors=True)
                raise

    def _refuse_rollback(self, at: Path, owner: int, step: int) -> None:
        newer = [s for s in steps_in(at) if s > step and (owner, s) in self._fresh]
        if newer:
            raise PeerError(
                f"a copy of process {owner}'s step {step}, older than its step {newer[-1]} "
                "this process keeps: a copy is never rolled back"
            )

    def _give(self, conn: socket.socket, owner: int, step: int) -> None:
        try:
            with _folder(self.root, f"{REPLICAS}/{owner}/{step}") as folder:
                files, _ = files_of(folder)
                _send_header(conn, {"ok": True, "files": files})
                for rel, size, _ in files:
                    send_file(conn, folder, rel, size)
        except FileNotFoundError:
            _send_header(conn, {"ok": False, "error": "no such copy here"})

    # ------------------------------------------------------------------------- timelines

    def drop(self, step: int, *, fresh_too: bool) -> None:
        """Deletes the copies of steps from `step` on (of a timeline that did not go on):
        those kept from before this process started, or all of them (`fresh_too`)."""
        with self._lock:
            drop_copies(self.root, step, keep=set() if fresh_too else set(self._fresh))
            if fresh_too:
                self._fresh = {(o, s) for o, s in self._fresh if s < step}

    def refuses(self, peer: int) -> bool:
        """Whether `peer`'s listener refuses a connection: its process is gone."""
        try:
            socket.create_connection(self.addresses[peer][:2], timeout=1.0).close()
        except ConnectionRefusedError:
            return True
        except OSError:
            pass
        return False


def _exchange(mine: str) -> list[Address]:
    """Every process's "address port key machine" (agreed by all, `_agree.gather`)."""
    raw = mine.encode()
    if len(raw) > _ADDRESS_BYTES:
        raise PeerError(f"the address {mine!r} is too long")
    out = []
    for row in _agree.gather("the local tier's peer addresses", mine):
        host, port, key, machine = row.split(" ", 3)
        out.append(Address(host, int(port), bytes.fromhex(key), machine))
    return out


def _mac(key: bytes, challenge: str, request: dict) -> str:
    body = json.dumps(request, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, f"{challenge}\n{body}".encode(), "sha256").hexdigest()


# --- the wire -----------------------------------------------------------------------------


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
            if not buf:
                raise _Silent(f"the peer closed the connection before it sent any of {size} bytes")
            raise PeerError(f"the peer closed the connection after {len(buf)} of {size} bytes")
        buf += chunk
    return bytes(buf)
