import subprocess
import sys

import numpy as np
import pytest

from tiercache.errors import InvalidArgument
from tiercache.prefix.hashes import PrefixHashes

TOKENS = np.random.default_rng(3).integers(0, 150_000, 5000)


def hashes(tokens=TOKENS, namespace="ns", n=544, u=16) -> PrefixHashes:
    return PrefixHashes(namespace, tokens, n, u)


def test_equal_prefixes_have_equal_hashes_and_nothing_else_does():
    a = hashes()
    other = TOKENS.copy()
    other[1234] += 1
    b = hashes(other)
    assert all(a.at(p) == b.at(p) for p in (0, 1, 16, 544, 1000, 1234))
    assert all(a.at(p) != b.at(p) for p in (1235, 1248, 1632, 2000, 4999))


def test_every_position_has_a_distinct_hash():
    h = hashes()
    values = [h.at(p) for p in range(0, 2000)]
    assert len(set(values)) == len(values) and all(len(v) == 16 for v in values)


def test_hash_depends_on_namespace_and_units():
    assert hashes().at(600) != hashes(namespace="other").at(600)
    assert hashes().at(600) != hashes(u=8).at(600)
    assert hashes().at(600) != hashes(n=528).at(600)


def test_lists_and_arrays_of_any_int_dtype_agree():
    assert hashes(list(TOKENS[:700])).at(700) == hashes(TOKENS[:700].astype(np.uint32)).at(700)


def test_a_longer_sequence_does_not_change_earlier_hashes():
    assert hashes(TOKENS[:1000]).at(999) == hashes().at(999)


def test_deterministic_across_processes():
    script = ("import numpy as np; from tiercache.prefix.hashes import PrefixHashes;"
              "t=np.random.default_rng(3).integers(0,150000,5000);h=PrefixHashes('ns',t,544,16);"
              "print(','.join(h.at(p).hex() for p in (0,17,544,1100,4999)))")
    runs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    h = hashes()
    assert runs == {",".join(h.at(p).hex() for p in (0, 17, 544, 1100, 4999))}


def test_262144_tokens():
    tokens = np.random.default_rng(0).integers(0, 150_000, 262_144)
    h = hashes(tokens)
    assert h.length == 262_144 and h.at(262_144) != h.at(262_143)


@pytest.mark.parametrize("tokens", [[-1, 2], [2**32], [[1, 2]], [1.5]])
def test_bad_token_ids_are_rejected(tokens):
    with pytest.raises(InvalidArgument):
        hashes(np.asarray(tokens))


def test_position_outside_the_sequence_is_rejected():
    with pytest.raises(InvalidArgument):
        hashes(TOKENS[:10]).at(11)
