"""QA: human units stay readable at the scale of large training runs."""

from geotrain.console import human_rate


def test_exa_and_zetta_prefixes():
    # One iteration of Llama-2-70B on 8M tokens is ~3.7e18 FLOP: "3.73e+03 PFLOP" was printed before.
    assert human_rate(3.73e18, "FLOP") == "3.73 EFLOP"
    assert human_rate(3.73e21, "FLOP") == "3.73 ZFLOP"
    assert human_rate(999e15, "FLOP") == "999 PFLOP"


def test_bytes_near_the_next_unit_print_without_an_exponent():
    from geotrain.console import human_bytes

    assert human_bytes(1000 * 1024) == "1000 KiB"          # was "1e+03 KiB" (rehearse's link table)
    assert human_bytes(1023.7 * 2**20) == "1024 MiB"
    assert human_bytes(3.2 * 2**30) == "3.2 GiB" and human_bytes(512) == "512 B"


def test_a_small_need_is_not_printed_as_zero_gib():
    from types import SimpleNamespace

    from geotrain.planner.explain import infeasible_reason

    gpu = SimpleNamespace(memory_gib=0.004)
    ctx = SimpleNamespace(cluster=SimpleNamespace(datacenters=[], name="c"), job=SimpleNamespace(dp=None),
                          model=SimpleNamespace(name="tiny"), tp=1, gpu=lambda dc: gpu,
                          dc=lambda dc: SimpleNamespace(gpu_type="small"))
    msg = infeasible_reason(ctx, (5.0, "a", "pp=1"))
    assert "needs 20.5 MiB per GPU in a" in msg and "0.0 GiB" not in msg      # validate said "needs 0.0 GiB"
