"""The peer protocol of the local tier's copies (jaxckpt._peers), fed what a hostile or
broken peer could send: every request is refused without the listener's token, no path
leads out of the folder a copy is written to, and a copy that arrives changed is refused."""

import json
import socket
import struct

import pytest

from jaxckpt import _peers


@pytest.fixture
def peer(tmp_path):
    """One process's listener on 127.0.0.1, serving `tmp_path/parts/<owner>/<step>` and
    keeping what it is sent under `tmp_path/copies/`."""
    accepted = []

    def serve(owner, step):
        folder = tmp_path / "parts" / str(owner) / str(step)
        return folder if folder.is_dir() else None

    def receive(owner, step):
        (tmp_path / "copies" / str(owner)).mkdir(parents=True, exist_ok=True)
        return tmp_path / "copies" / str(owner) / str(step)

    def accept(owner, step, tmp):
        accepted.append((owner, step))
        tmp.rename(receive(owner, step))

    peers = _peers.Peers("127.0.0.1", serve, receive, accept)
    peers.accepted = accepted
    yield peers
    peers.close()


def _part(folder):
    (folder / "packed").mkdir(parents=True)
    (folder / "packed" / "0-of-1.bin").write_bytes(bytes(range(256)) * 100)
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


def test_a_part_goes_to_a_peer_and_comes_back_whole(peer, tmp_path):
    part = _part(tmp_path / "mine")
    peer.put(0, 3, 12, part)
    assert peer.accepted == [(3, 12)]
    copy = tmp_path / "copies" / "3" / "12"
    assert (copy / "packed" / "0-of-1.bin").read_bytes() == (
        part / "packed" / "0-of-1.bin"
    ).read_bytes()
    _part(tmp_path / "parts" / "3" / "12")
    peer.get(0, 3, 12, tmp_path / "back")
    assert (tmp_path / "back" / "data.json").read_text() == '{"position": 3}'
    with pytest.raises(_peers.PeerError, match="has no copy of process 3's step 13"):
        peer.get(0, 3, 13, tmp_path / "none")


def _raw(peer, header, body=b""):
    host, port, _, _ = peer.addresses[0]
    with socket.create_connection((host, port), timeout=30) as conn:
        raw = json.dumps(header).encode()
        conn.sendall(struct.pack(">I", len(raw)) + raw + body)
        return _peers._read_header(conn)


@pytest.mark.parametrize(
    "header",
    [
        {"token": "0" * 32, "op": "get", "owner": 0, "step": 1},
        {"op": "get", "owner": 0, "step": 1},
        {"token": None, "op": "put", "owner": 0, "step": 1, "files": []},
    ],
)
def test_a_request_without_the_token_is_refused(peer, header, tmp_path):
    _part(tmp_path / "parts" / "0" / "1")
    reply = _raw(peer, header)
    assert reply == {"ok": False, "error": "a request without this job's token"}
    assert not (tmp_path / "copies").exists()


@pytest.mark.parametrize(
    "rel", ["../outside", "/etc/passwd", "a/../../outside", "a//b", "", "a\\b", ".."]
)
def test_no_file_of_a_copy_lands_outside_its_folder(peer, tmp_path, rel):
    token = peer.addresses[0][2]
    files = [[rel, 4, "0" * 32]]
    reply = _raw(
        peer, {"token": token, "op": "put", "owner": 0, "step": 1, "files": files}, b"abcd"
    )
    assert reply["ok"] is False and "outside the folder" in reply["error"]
    assert not (tmp_path / "outside").exists() and peer.accepted == []


def test_a_copy_that_arrives_changed_is_refused(peer, tmp_path):
    token = peer.addresses[0][2]
    files = [["x.bin", 4, "0" * 32]]  # not the hash of b"abcd"
    reply = _raw(
        peer, {"token": token, "op": "put", "owner": 0, "step": 1, "files": files}, b"abcd"
    )
    assert reply["ok"] is False and "checksum mismatch" in reply["error"]
    assert peer.accepted == [] and not any((tmp_path / "copies").rglob("x.bin"))


@pytest.mark.parametrize(
    "header",
    [
        {"token": "t", "op": "delete", "owner": 0, "step": 1},
        {"token": "t", "op": "get", "owner": -1, "step": 1},
        {"token": "t", "op": "get", "owner": True, "step": 1},
        {"token": "t", "op": "put", "owner": 0, "step": 1, "files": "x"},
        {"token": "t", "op": "put", "owner": 0, "step": 1, "files": [["a", -1, "h"]]},
    ],
)
def test_a_malformed_request_is_refused(peer, header):
    header["token"] = peer.addresses[0][2]
    assert _raw(peer, header)["ok"] is False


def test_a_header_too_big_or_not_json_closes_the_connection_only(peer, tmp_path):
    host, port, _, _ = peer.addresses[0]
    for raw in (struct.pack(">I", 2**31), struct.pack(">I", 5) + b"nope!"):
        with socket.create_connection((host, port), timeout=30) as conn:
            conn.sendall(raw)
            assert _peers._read_header(conn)["ok"] is False
    part = _part(tmp_path / "mine")  # the listener still serves
    peer.put(0, 1, 2, part)
    assert peer.accepted == [(1, 2)]
