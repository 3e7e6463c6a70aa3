"""The hypothesis profiles the Makefile and CI load (registered in conftest.py)."""
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import Phase, settings


def test_ci_profile_stops_at_the_first_failing_example_and_dev_shrinks_it():
    ci = settings.get_profile("ci")
    assert Phase.generate in ci.phases and Phase.shrink not in ci.phases
    assert ci.derandomize and ci.print_blob  # the failing example is reproducible without shrinking
    for name in ("dev", "thorough"):
        assert Phase.shrink in settings.get_profile(name).phases, name
    assert settings.get_profile("thorough").max_examples == 1000


def test_profiles_are_the_same_when_the_environment_says_ci():
    # hypothesis loads its own "ci" profile at import when CI is set; ours must not inherit from it
    probe = ("import tests.conftest as c; from hypothesis import Phase, settings as s; "
             "print(Phase.shrink in s.get_profile('dev').phases, s.get_profile('dev').derandomize, "
             "Phase.shrink in s.default.phases)")
    env = {**os.environ, "CI": "true", "HYPOTHESIS_PROFILE": "ci"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[1], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "False", "False"], out.stderr[-2000:]
