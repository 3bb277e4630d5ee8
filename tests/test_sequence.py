"""``Sequence.ids`` (a span of the prompt and outputs without building ``all_ids``) and the
prefix-cache key of a segment (its bytes are what replicas exchange: they must not drift)."""

import hashlib
import random

from mcserve.engine.prefix_keys import block_hash, chain_hashes
from mcserve.engine.sampling import SamplingParams
from mcserve.engine.sequence import Sequence


def test_ids_equal_all_ids_slices():
    rng = random.Random(0)
    seq = Sequence("r", 0, [rng.randrange(1000) for _ in range(37)], SamplingParams())
    seq.output_ids = [rng.randrange(1000) for _ in range(11)]
    n = len(seq.all_ids)
    for start in range(0, n + 1, 3):
        for stop in range(start, n + 3):
            assert seq.ids(start, stop) == seq.all_ids[start:stop], (start, stop)


def test_block_hash_bytes_and_chain():
    salt = b"model|grm"
    want = hashlib.blake2b(b"root" + salt + b"5,17,3", digest_size=16).digest()
    assert block_hash(None, [5, 17, 3], salt) == want
    child = hashlib.blake2b(want + salt + b"8", digest_size=16).digest()
    assert block_hash(want, [8], salt) == child
    ids = [5, 17, 3, 8, 1, 2]
    keys = chain_hashes(ids, 3, salt, 2)
    assert keys[0] == want and keys == chain_hashes(ids[:6], 3, salt, 2)
    assert chain_hashes(ids, 3, salt, 2, keys[:1]) == keys[1:]
