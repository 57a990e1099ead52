"""Step-shape buckets: the token ladders (powers of 2; dense adds 3 x 2^k from 24) and bucket lookup."""
import pytest

from gemmajax.engine.runner import bucket, pow2_buckets, token_buckets


def test_token_buckets_ladders():
    assert token_buckets(16, 512) == (16, 32, 64, 128, 256, 512)
    assert token_buckets(16, 512, dense=True) == (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert token_buckets(16, 2048, dense=True)[-5:] == (512, 768, 1024, 1536, 2048)
    assert token_buckets(16, 100, dense=True) == (16, 24, 32, 48, 64, 96, 100)  # the cap itself is a bucket
    assert token_buckets(64, 200) == (64, 128, 200)
    assert pow2_buckets(1, 16) == (1, 2, 4, 8, 16)


@pytest.mark.parametrize("n,want", [(1, 16), (16, 16), (17, 24), (25, 32), (65, 96), (97, 128), (384, 384),
                                    (385, 512)])
def test_bucket_picks_the_smallest_that_fits(n, want):
    assert bucket(n, token_buckets(16, 512, dense=True)) == want


def test_bucket_over_the_cap_names_it():
    with pytest.raises(ValueError, match="513 exceeds the largest bucket 512"):
        bucket(513, token_buckets(16, 512))
