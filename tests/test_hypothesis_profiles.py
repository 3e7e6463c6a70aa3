"""The hypothesis profiles the Makefile and CI load (registered in conftest.py)."""
from hypothesis import Phase, settings


def test_ci_profile_stops_at_the_first_failing_example_and_dev_shrinks_it():
    ci = settings.get_profile("ci")
    assert Phase.generate in ci.phases and Phase.shrink not in ci.phases
    assert ci.derandomize and ci.print_blob  # the failing example is reproducible without shrinking
    for name in ("dev", "thorough"):
        assert Phase.shrink in settings.get_profile(name).phases, name
    assert settings.get_profile("thorough").max_examples == 1000
