"""Transfer packs (format.md §14.3): two jax processes on this machine (tests/support/transfer_peer.py)
ship a request's KV and records; a byte flipped in transit is reported on the receiving side with
the sender's slot and position (and again by the receiver's next TAIL verify at its own slot), a clean
transfer is silent. In-process: the framing errors of a damaged pack."""

import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

from jax_kvcanary.runtime.transfer import TransferError, pack_transfer, unpack_transfer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peer(*args):
    p = subprocess.run([sys.executable, "-m", "tests.support.transfer_peer", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_byte_flipped_in_transit_is_reported_with_the_senders_slot(tmp_path):
    clean = tmp_path / "clean.pack"
    sent = peer("send", str(clean))
    data = bytearray(clean.read_bytes())
    pack, _ = unpack_transfer(bytes(data), check=False)
    # the K bytes of entry 2 (sender slot 11, position 2): find them in the pack and flip one
    needle = pack.kv["FULL/k/0"][2].tobytes()
    at = bytes(data).find(needle)
    assert at > 0 and bytes(data).count(needle) == 1
    data[at + 5] ^= 0x40
    flipped = tmp_path / "flipped.pack"
    flipped.write_bytes(bytes(data))

    got_clean, got_flipped = peer("recv", str(clean), str(flipped))
    assert got_clean == {"host": [], "device": []}
    assert got_flipped["host"] == [["HOST_TRANSFER_K_FULL", ["verify_real_kv_hash"], sent["slots"][2], 2]]
    # the receiver imported the pages into its slots 17..22: its TAIL verify sees the same byte
    assert got_flipped["device"] == [["TAIL_K_FULL", ["verify_real_kv_hash"], 19, 2]]


def _pack():
    rec = np.zeros((3, 32), np.uint8)
    return pack_transfer({"FULL": [4, 5, 6]}, {"FULL/k/0": np.ones((3, 16), np.float32)},
                         {"TAIL_K_FULL": rec}, fingerprints={"TAIL_K_FULL": [("FULL/k/0", 64)]},
                         real_kv_hash_mode=2)


def test_round_trip_of_the_framing():
    pack, result = unpack_transfer(_pack(), check=False)
    assert pack.slots["FULL"].tolist() == [4, 5, 6] and pack.kv["FULL/k/0"].shape == (3, 16)
    assert pack.fingerprints == {"TAIL_K_FULL": (("FULL/k/0", 64),)} and int(pack.real_kv_hash_mode) == 2
    _, result = unpack_transfer(_pack())          # zero records vs non-zero KV: three rows
    assert [r[1] for r in result.rows] == [4, 5, 6]
    for data in (bytearray(_pack()), np.frombuffer(_pack(), np.uint8), np.frombuffer(_pack(), np.uint8).view(np.int32)):
        assert unpack_transfer(data, check=False)[0].slots["FULL"].tolist() == [4, 5, 6]


def _edit(fn):
    data = bytearray(_pack())
    fn(data)
    return bytes(data)


@pytest.mark.parametrize("data, text", [
    (b"KVCAN", "kv-canary: transfer pack is truncated: 5 bytes, need at least 24"),
    (_edit(lambda d: d.__setitem__(slice(0, 8), b"NOTAPACK")),
     "kv-canary: not a transfer pack: magic b'NOTAPACK', expected b'KVCANARY'"),
    (_edit(lambda d: d.__setitem__(slice(8, 12), struct.pack("<I", 2))),
     "kv-canary: transfer pack version 2 is not supported (this build reads version 1)"),
    (_edit(lambda d: d.__setitem__(30, d[30] ^ 1)), "kv-canary: transfer pack header is corrupt (crc32 mismatch)"),
    (_pack()[:-10], "kv-canary: transfer pack array 'kv/FULL/k/0' (float32[3, 16] at bytes "),
])
def test_damaged_packs_fail_with_a_clear_error(data, text):
    with pytest.raises(TransferError, match="^" + re.escape(text)):
        unpack_transfer(data)


def test_pack_errors():
    with pytest.raises(ValueError, match=r"kv-canary: transfer kv 'FULL/k/0' has shape \(2, 16\), but group FULL has 3 slots"):
        pack_transfer({"FULL": [1, 2, 3]}, {"FULL/k/0": np.ones((2, 16), np.float32)}, {})
    with pytest.raises(ValueError, match="kv-canary: fingerprint of 'TAIL_K_FULL' names KV 'FULL/k/1'"):
        pack_transfer({"FULL": [1]}, {}, {}, fingerprints={"TAIL_K_FULL": [("FULL/k/1", 16)]})
    with pytest.raises(ValueError, match="kv-canary: transfer kv name 'MID/k' names no group"):
        pack_transfer({"FULL": [1]}, {"MID/k": np.ones((1, 16), np.float32)}, {})


def test_fingerprint_with_offset_bytes():
    """A fused entry [K 32 B, V 32 B]: the V fingerprint names the same KV array with offset_bytes 32
    (no separate V copy in the pack); a source without an offset packs exactly as before."""
    import jax_kvcanary as kvc
    from jax_kvcanary import hashing
    kv = np.random.default_rng(5).integers(0, 256, (3, 64), dtype=np.uint8)
    v_src = kvc.RealKvSource(kv, 1, 64, 32, offset_bytes=32)
    rec = np.zeros((3, 4), np.int64)
    rec[:, 1] = [7, 8, 9]
    rec[:, 3] = hashing.to_i64(hashing.slot_real_kv_hash((v_src,), np.arange(3), 2))
    rec = rec.view(np.uint8).reshape(3, 32)

    def make(kv_bytes, fp):
        return pack_transfer({"FULL": [4, 5, 6]}, {"FULL/kv/0": kv_bytes}, {"TAIL_V_FULL": rec},
                             fingerprints={"TAIL_V_FULL": fp}, real_kv_hash_mode=2)

    pack, result = unpack_transfer(make(kv, [("FULL/kv/0", 32, 32)]))
    assert pack.fingerprints == {"TAIL_V_FULL": (("FULL/kv/0", 32, 32),)}
    assert result.ok and result.checked == 3
    k_flip, v_flip = kv.copy(), kv.copy()
    k_flip[1, 5] ^= 1                              # entry 1's K: outside the V strip
    v_flip[2, 32 + 5] ^= 1                         # entry 2's V
    assert unpack_transfer(make(k_flip, [("FULL/kv/0", 32, 32)]))[1].ok
    rows = unpack_transfer(make(v_flip, [("FULL/kv/0", 32, 32)]))[1].rows
    assert [(r[1], r[2], r[7]) for r in rows] == [(6, 9, 4)]   # the sender's slot and the position
    # without the offset the same pack reads K: every record mismatches
    assert len(unpack_transfer(make(kv, [("FULL/kv/0", 32)]))[1].rows) == 3
    # offset 0 is the old form: the same bytes whether it is given or not
    assert make(kv, [("FULL/kv/0", 32, 0)]) == make(kv, [("FULL/kv/0", 32)])
    assert unpack_transfer(make(kv, [("FULL/kv/0", 32, 0)]), check=False)[0].fingerprints == {
        "TAIL_V_FULL": (("FULL/kv/0", 32),)}
