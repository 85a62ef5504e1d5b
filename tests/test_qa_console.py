"""QA: human units stay readable at the scale of large training runs."""

from geotrain.console import human_rate


def test_exa_and_zetta_prefixes():
    # One iteration of Llama-2-70B on 8M tokens is ~3.7e18 FLOP: "3.73e+03 PFLOP" was printed before.
    assert human_rate(3.73e18, "FLOP") == "3.73 EFLOP"
    assert human_rate(3.73e21, "FLOP") == "3.73 ZFLOP"
    assert human_rate(999e15, "FLOP") == "999 PFLOP"
