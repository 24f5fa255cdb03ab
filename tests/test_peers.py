"""The peer protocol of the local tier's copies (jaxckpt._peers), fed what a hostile or
broken peer could send: every request is refused unless signed with the listener's key for
its connection (so a captured one cannot be replayed), a put never rolls copies back, no
path leads out of the local directory (neither a file name nor a link), and a copy that
arrives changed is refused. Between real processes: tests/test_local_copies.py."""

import contextlib
import json
import logging
import socket
import struct
import threading

import numpy as np
import pytest
import xxhash

from jaxckpt import _peer_files, _peers, _replicas


@pytest.fixture
def peer(tmp_path):
    """One process's listener on 127.0.0.1 with its local directory `tmp_path/local`."""
    checked = []
    root = tmp_path / "local"
    root.mkdir()

    def check(owner, step, folder):
        checked.append((owner, step))

    tried = []
    peers = _peers.Peers(
        "127.0.0.1", root, check=check, tried=lambda *put: tried.append(put), keep=2, timeout_s=30
    )
    peers.checked, peers.tried = checked, tried
    yield peers
    peers.close()


def _part(folder, fill=0):
    (folder / "packed").mkdir(parents=True)
    (folder / "packed" / "0-of-1.bin").write_bytes(bytes(range(256)) * 100 + bytes([fill]))
    (folder / "data.json").write_text('{"position": 3}')
    return folder


def test_copies_go_to_other_machines_first():
    machines = ["a", "a", "b", "b", "c", "c"]  # two processes a host
    assert _peers.holders(0, machines, 1) == [2]
    assert _peers.holders(1, machines, 2) == [2, 3]
    assert _peers.holders(5, machines, 1) == [0]
    assert _peers.holders(0, ["a", "a"], 1) == [1]  # one machine: the next process
    assert _peers.holders(0, ["a", "b"], 3) == [1]  # never more than the others
    assert _peers.holders(0, ["a"], 1) == []


def test_a_part_goes_to_a_peer_and_comes_back_whole(peer):
    part = _part(peer.root / "12")
    peer.put(0, 3, 12, "12")
    assert peer.checked == [(3, 12)]
    copy = peer.root / "replicas" / "3" / "12"
    assert (copy / "packed" / "0-of-1.bin").read_bytes() == (
        part / "packed" / "0-of-1.bin"
    ).read_bytes()
    peer.get(0, 3, 12, "back")
    assert (peer.root / "back" / "data.json").read_text() == '{"position": 3}'
    assert _replicas.copies(peer.root) == {3: [12]}
    with pytest.raises(_peers.PeerError, match="has no copy of process 3's step 13"):
        peer.get(0, 3, 13, "none")


def test_keep_copies_of_each_owner_are_kept(peer):
    for step in (2, 4, 6):
        _part(peer.root / str(step), fill=step)
        peer.put(0, 1, step, str(step))
    assert _replicas.copies(peer.root) == {1: [4, 6]}


class _Relay:
    """A man in the middle between the peers and the listener: it passes every byte on,
    and records what the client sent on each connection."""

    def __init__(self, to):
        self.to, self.sent = to, []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.to, timeout=30)
            record = bytearray()
            self.sent.append(record)
            threading.Thread(
                target=self._pump, args=(client, upstream, record), daemon=True
            ).start()
            threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True).start()

    @staticmethod
    def _pump(source, sink, record):
        try:
            while chunk := source.recv(1 << 16):
                if record is not None:
                    record += chunk
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def _replay(address, raw):
    """Sends `raw` on a new connection to the listener: its reply."""
    with socket.create_connection(address, timeout=30) as conn:
        _peers._read_header(conn)  # this connection's challenge, ignored
        conn.sendall(raw)
        return _peers._read_header(conn)


def test_a_captured_put_replayed_later_is_refused_and_rolls_nothing_back(peer):
    host, port, key, machine = peer.addresses[0]
    relay = _Relay((host, port))
    peer.addresses[0] = _peers.Address("127.0.0.1", relay.port, key, machine)
    _part(peer.root / "12", fill=12)
    peer.put(0, 1, 12, "12")
    (captured,) = relay.sent
    assert key.hex().encode() not in captured and key not in captured  # never on the wire
    _part(peer.root / "14", fill=14)
    peer.put(0, 1, 14, "14")
    reply = _replay((host, port), bytes(captured))
    assert reply["ok"] is False and "replayed" in reply["error"]
    assert peer.checked == [(1, 12), (1, 14)]
    assert _replicas.copies(peer.root) == {1: [12, 14]}


def test_a_put_never_rolls_copies_back(peer):
    for step in (14, 12):
        _part(peer.root / str(step), fill=step)
    peer.put(0, 1, 14, "14")
    with pytest.raises(_peers.PeerError, match="never rolled back"):
        peer.put(0, 1, 12, "12")
    assert _replicas.copies(peer.root) == {1: [14]}
    peer.put(0, 1, 14, "14")  # the same step again: it replaces the copy
    assert _replicas.copies(peer.root) == {1: [14]}
    assert peer.tried == [(1, 14), (1, 12), (1, 14)]  # each put that was over, refused too


def _raw(peer, header, body=b"", *, key=None, challenge=None):
    """A request as a hostile peer may send it: signed with `key` (the listener's, by
    default; False: unsigned) over `challenge` (this connection's, by default)."""
    host, port, own, _ = peer.addresses[0]
    with socket.create_connection((host, port), timeout=30) as conn:
        sent = _peers._read_header(conn)["challenge"]
        if key is not False:
            mac = _peers._mac(key or own, challenge or sent, header)
            header = {**header, "mac": mac}
        raw = json.dumps(header).encode()
        conn.sendall(struct.pack(">I", len(raw)) + raw + body)
        reply = _peers._read_header(conn)
        if header.get("op") == "put" and reply.get("ok"):  # "send the files": they were
            reply = _peers._read_header(conn)
        return reply


@pytest.mark.parametrize(
    "signing",
    [{"key": False}, {"key": b"0" * 16}, {"challenge": "0" * 32}],
    ids=["unsigned", "another-key", "another-challenge"],
)
def test_a_request_not_signed_for_its_connection_is_refused(peer, signing):
    (peer.root / "replicas" / "0" / "1").mkdir(parents=True)
    for header in (
        {"op": "get", "owner": 0, "step": 1},
        {"op": "put", "owner": 0, "step": 2, "files": []},
    ):
        reply = _raw(peer, header, **signing)
        assert reply["ok"] is False and "not signed with this listener's key" in reply["error"]
    assert peer.checked == peer.tried == [] and _replicas.copies(peer.root) == {0: [1]}


@pytest.mark.parametrize(
    "rel", ["../outside", "/etc/passwd", "a/../../outside", "a//b", "", "a\\b", ".."]
)
def test_no_file_of_a_copy_lands_outside_its_folder(peer, tmp_path, rel):
    files = [[rel, 4, "0" * 32]]
    reply = _raw(peer, {"op": "put", "owner": 0, "step": 1, "files": files}, b"abcd")
    assert reply["ok"] is False and "outside the folder" in reply["error"]
    assert not (tmp_path / "outside").exists() and peer.checked == []


def test_a_copy_that_arrives_changed_is_refused(peer):
    files = [["x.bin", 4, "0" * 32]]  # not the hash of b"abcd"
    reply = _raw(peer, {"op": "put", "owner": 0, "step": 1, "files": files}, b"abcd")
    assert reply["ok"] is False and "checksum mismatch" in reply["error"]
    assert peer.checked == [] and not any(peer.root.rglob("x.bin"))


def _outside(tmp_path):
    outside = tmp_path / "outside"
    _part(outside / "5")
    return outside


def test_a_get_follows_no_link(peer, tmp_path, caplog):
    """`replicas/<owner>` a link to a folder elsewhere: nothing is served from there."""
    (peer.root / "replicas").mkdir()
    (peer.root / "replicas" / "3").symlink_to(_outside(tmp_path))
    with pytest.raises(_peers.PeerError, match="is a link"):
        peer.get(0, 3, 5, "back")
    assert not any((peer.root / "back").rglob("*"))
    with caplog.at_level(logging.WARNING, "jaxckpt"):
        assert _replicas.copies(peer.root) == {}
    assert "is a link" in caplog.text


@pytest.mark.parametrize("link", ["replicas", "replicas/1"])
def test_a_put_follows_no_link(peer, tmp_path, link):
    outside = tmp_path / "outside"
    outside.mkdir()
    (peer.root / "replicas").mkdir(exist_ok=link != "replicas")
    if link == "replicas":
        (peer.root / "replicas").rmdir()
    (peer.root / link).symlink_to(outside)
    _part(peer.root / "12")
    with pytest.raises(_peers.PeerError, match="is a link"):
        peer.put(0, 1, 12, "12")
    assert list(outside.iterdir()) == [] and peer.checked == []


def test_a_part_holding_a_link_is_never_sent(peer, tmp_path):
    part = _part(peer.root / "12")
    (part / "data.json").unlink()
    (part / "data.json").symlink_to(_outside(tmp_path) / "5" / "data.json")
    with pytest.raises(_peers.PeerError, match=r"data\.json is a link"):
        peer.put(0, 1, 12, "12")
    assert peer.checked == []


def test_a_deletion_follows_no_link(peer, tmp_path):
    """A leftover or a copy swapped for a link is deleted as a link: what it points to
    stays."""
    outside = _outside(tmp_path)
    at = peer.root / "replicas" / "1"
    at.mkdir(parents=True)
    (at / "7.jaxckpt-tmp").symlink_to(outside / "5")
    (at / "8").symlink_to(outside / "5")
    _part(at / "9")
    _replicas.sweep(peer.root)
    assert sorted(p.name for p in at.iterdir()) == ["8", "9"]
    assert _replicas.copies(peer.root) == {1: [9]}  # the link is no copy
    _replicas.drop_copies(peer.root, 0)
    assert sorted(p.name for p in at.iterdir()) == ["8"]
    _replicas.discard(at / "8")
    assert list(at.iterdir()) == [] and (outside / "5" / "data.json").exists()


@pytest.mark.parametrize(
    "header",
    [
        {"op": "delete", "owner": 0, "step": 1},
        {"op": "get", "owner": -1, "step": 1},
        {"op": "get", "owner": True, "step": 1},
        {"op": "put", "owner": 0, "step": 1, "files": "x"},
        {"op": "put", "owner": 0, "step": 1, "files": [["a", -1, "h"]]},
    ],
)
def test_a_malformed_request_is_refused(peer, header):
    assert _raw(peer, header)["ok"] is False


def test_a_header_too_big_or_not_json_closes_the_connection_only(peer):
    host, port, _, _ = peer.addresses[0]
    for raw in (struct.pack(">I", 2**31), struct.pack(">I", 5) + b"nope!"):
        with socket.create_connection((host, port), timeout=30) as conn:
            _peers._read_header(conn)
            conn.sendall(raw)
            assert _peers._read_header(conn)["ok"] is False
    _part(peer.root / "2")  # the listener still serves
    peer.put(0, 1, 2, "2")
    assert peer.checked == [(1, 2)]


# --- a later part: only the blocks that changed -------------------------------------------

BLOCK = _peer_files.BLOCK_BYTES


def _big_part(folder, changed_at=()):
    """A part of 16 blocks of random bytes (the same every time), with bytes changed at
    these offsets."""
    data = bytearray(np.random.default_rng(0).bytes(16 * BLOCK))
    for at in changed_at:
        data[at] ^= 0xFF
    (folder / "packed").mkdir(parents=True)
    (folder / "packed" / "0-of-1.bin").write_bytes(bytes(data))
    (folder / "data.json").write_text(json.dumps({"changed": list(changed_at)}))
    return folder


def _relayed(peer):
    host, port, key, machine = peer.addresses[0]
    relay = _Relay((host, port))
    peer.addresses[0] = _peers.Address("127.0.0.1", relay.port, key, machine)
    return relay


def _same(peer, owner, step):
    copy = peer.root / "replicas" / str(owner) / str(step)
    for rel in ("packed/0-of-1.bin", "data.json"):
        assert (copy / rel).read_bytes() == (peer.root / str(step) / rel).read_bytes(), rel


def test_a_later_part_sends_only_the_blocks_that_changed(peer):
    relay = _relayed(peer)
    _big_part(peer.root / "2")
    peer.put(0, 1, 2, "2")
    _big_part(peer.root / "4", changed_at=[3 * BLOCK + 5, 9 * BLOCK])
    peer.put(0, 1, 4, "4")
    _same(peer, 1, 4)
    first, later = (len(sent) for sent in relay.sent)
    assert first > 16 * BLOCK
    assert later < 2 * BLOCK + 4096  # two blocks, the small file and the headers
    assert _replicas.copies(peer.root) == {1: [2, 4]}


def test_a_holder_that_no_longer_keeps_the_earlier_copy_takes_whole_files(peer):
    relay = _relayed(peer)
    _big_part(peer.root / "2")
    peer.put(0, 1, 2, "2")
    _replicas.discard(peer.root / "replicas" / "1" / "2")
    _big_part(peer.root / "4", changed_at=[5])
    peer.put(0, 1, 4, "4")
    _same(peer, 1, 4)
    assert len(relay.sent[1]) > 16 * BLOCK


def test_a_damaged_earlier_copy_fails_the_later_one_and_the_next_goes_whole(peer):
    _big_part(peer.root / "2")
    peer.put(0, 1, 2, "2")
    kept = peer.root / "replicas" / "1" / "2" / "packed" / "0-of-1.bin"
    damaged = bytearray(kept.read_bytes())
    damaged[7 * BLOCK] ^= 1
    kept.write_bytes(bytes(damaged))
    _big_part(peer.root / "4", changed_at=[5])
    with pytest.raises(_peers.PeerError, match="checksum mismatch"):
        peer.put(0, 1, 4, "4")
    assert _replicas.copies(peer.root) == {1: [2]}
    _big_part(peer.root / "6", changed_at=[5])
    peer.put(0, 1, 6, "6")
    _same(peer, 1, 6)


def _files_of(*parts):
    files = [[rel, len(raw), xxhash.xxh3_128_hexdigest(raw)] for rel, raw in parts]
    return files, b"".join(raw for _, raw in parts)


@pytest.mark.parametrize(
    "delta, error",
    [
        ({"base": 7, "block": BLOCK, "send": {"x.bin": []}}, "not one before 7"),
        ({"base": 1, "block": 4096, "send": {"x.bin": []}}, "blocks of 4096 bytes"),
        ({"base": 1, "block": BLOCK, "send": {}}, "each file's blocks"),
        ({"base": 1, "block": BLOCK, "send": {"x.bin": [[0, 2]]}}, "past its"),
        ({"base": 1, "block": BLOCK, "send": {"x.bin": [[1, 1]]}}, "out of order"),
        ({"base": 1, "block": BLOCK, "send": {"x.bin": [["0", 1]]}}, "not ranges"),
        ({"base": 1, "block": BLOCK, "send": {"x.bin": []}}, "checksum mismatch"),
        ({"base": 1, "block": BLOCK, "send": {"x.bin": "all"}}, "not ranges"),
    ],
)
def test_a_hostile_delta_is_refused(peer, delta, error):
    _big_part(peer.root / "replicas" / "0" / "1")
    (peer.root / "replicas" / "0" / "1" / "x.bin").write_bytes(b"abce")  # kept: not "abcd"
    files, _ = _files_of(("x.bin", b"abcd"))  # (no byte sent: each is refused before)
    reply = _raw(peer, {"op": "put", "owner": 0, "step": 7, "files": files, "delta": delta})
    assert reply["ok"] is False and error in reply["error"], reply
    assert _replicas.copies(peer.root) == {0: [1]} and peer.checked == []


def test_a_delta_keeps_no_block_from_outside_the_earlier_copy(peer, tmp_path):
    at = peer.root / "replicas" / "0"
    at.mkdir(parents=True)
    (at / "1").symlink_to(_outside(tmp_path) / "5")  # the base: a link
    files, _ = _files_of(("data.json", b'{"position": 3}'))
    delta = {"base": 1, "block": BLOCK, "send": {"data.json": []}}  # every block kept
    reply = _raw(peer, {"op": "put", "owner": 0, "step": 7, "files": files, "delta": delta})
    assert reply["ok"] is False and peer.checked == []
