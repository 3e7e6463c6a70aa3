"""Test configuration. Runs before anything imports triton: without a CUDA device
every kernel runs in the Triton interpreter (fp32 exact), so the whole suite
exercises forward and backward kernels on a CPU-only machine."""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# exact fp32 products in tl.dot and cuBLAS, so fp32 comparisons are tight
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
# Under pytest-xdist every core runs a worker: one torch thread each, or the workers'
# thread pools compete for the same cores (60 % more CPU time for the same tests).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# CI stops at the first failing example: generation finds a bug, and shrinking it through the
# interpreter cost minutes per failure (print_blob replays it); dev and thorough runs shrink.
CI_PHASES = tuple(p for p in Phase if p is not Phase.shrink)
# Each profile derives from hypothesis' own defaults, not from whatever is loaded: with CI set,
# hypothesis has already loaded its built-in "ci" profile, registering ours under that name makes
# it active, and a profile registered after it would inherit its phases and derandomize.
_base = settings.get_profile("default")
settings.register_profile("ci", _base, max_examples=12, derandomize=True, print_blob=True, phases=CI_PHASES,
                          **_common)
settings.register_profile("dev", _base, max_examples=25, **_common)
settings.register_profile("thorough", _base, max_examples=1000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _cost_rank(item) -> int:
    path = str(item.path)
    if item.get_closest_marker("packaging"):   # one test of about 30 s: first, not alone at the end
        return -1
    return 0 if "/tests/triton_ops/" in path else 1 if "/tests/recipes/" in path else 2


def pytest_collection_modifyitems(config, items):
    # The interpreted kernel tests (seconds each) first, quick reference tests last:
    # the pytest-xdist workers then finish together instead of one waiting on a
    # long test at the end.
    items.sort(key=_cost_rank)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_nan_fill():
    from laminae.triton_ops._common import set_fill_nan

    torch.manual_seed(0)
    set_fill_nan(True)
    yield
    set_fill_nan(False)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")


# ----------------------------------------------------------------------------
# --launch-coverage: every configuration the CUDA path can launch runs here
# ----------------------------------------------------------------------------


def pytest_addoption(parser):
    parser.addoption("--launch-coverage", action="store_true",
                     help="record every interpreted kernel launch and fail the session when a launch "
                          "configuration of a kernel's static_cases() never ran (tests/_launch_coverage.py)")


def pytest_configure(config):
    if not config.getoption("launch_coverage") or os.environ.get("TRITON_INTERPRET") != "1":
        return
    import tempfile

    from . import _launch_coverage

    if not hasattr(config, "workerinput"):  # the controller: its pytest-xdist workers inherit the folder
        os.environ["LAMINAE_LAUNCH_DIR"] = tempfile.mkdtemp(prefix="laminae-launches-")
    _launch_coverage.install()


def pytest_sessionfinish(session, exitstatus):
    from . import _launch_coverage

    folder = _launch_coverage.directory()
    if folder is None or not session.config.getoption("launch_coverage"):
        return
    worker = getattr(session.config, "workerinput", {}).get("workerid", "main")
    _launch_coverage.write(folder, worker)
    if worker != "main":
        return
    lines, failures = _launch_coverage.summary(_launch_coverage.coverage(_launch_coverage.read(folder)))
    session.config._launch_coverage = (lines, failures)
    if failures and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    report = getattr(config, "_launch_coverage", None)
    if report is None:
        return
    lines, failures = report
    terminalreporter.section("launch configurations (kernel, dtype, tile constexprs)")
    for line in lines:
        terminalreporter.write_line(line)
    if failures:
        terminalreporter.write_line(f"FAILED: {len(failures)} launch configurations: the CUDA path can launch them "
                                    "but none ran under the interpreter, or the allow-list names them needlessly:",
                                    red=True)
        for line in failures:
            terminalreporter.write_line("  " + line)
