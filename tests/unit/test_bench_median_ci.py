"""bench.proxy_overhead's confidence interval for a median (order statistics)."""

from bench.proxy_overhead import median_ci


def test_the_interval_is_the_order_statistics_a_sign_test_gives():
    assert median_ci([]) == (None, None, None)
    assert median_ci([5, 1, 4, 2, 3]) == (None, 3, None)          # 2 * 2^-5 > 5%: too few
    assert median_ci([6, 1, 5, 2, 4, 3]) == (1, 3.5, 6)            # 2 * 2^-6 < 5%: the extremes
    assert median_ci(list(range(20))) == (5, 9.5, 14)              # the 6th and 15th of 20
    assert median_ci(list(range(100))) == (39, 49.5, 60)           # the 40th and 61st of 100
