"""The launch-coverage check (tests/_launch_coverage.py, ``pytest --launch-coverage``):
a configuration of a static case that no launch executed is named, and fails the session
unless it is on the allow-list."""
import os

import pytest
import torch

from . import _launch_coverage as lc

_TORCH_NAMES = {v: k for k, v in lc._DTYPES.items()}


def _launch(case, **const):
    ptrs = {k: _TORCH_NAMES[t[1:]] for k, t in case.signature.items() if t.startswith("*")}
    return (lc._fn_id(lc._python_fn(case.kernel)), {k: repr(v) for k, v in {**case.constexprs, **const}.items()},
            ptrs)


def test_a_configuration_no_launch_ran_is_named_and_fails():
    cases = lc.static_configurations(["xsa"])["xsa"]
    every = [_launch(c[0]) for c in cases.values()]
    assert lc.coverage(every, ["xsa"])["xsa"][2] == []
    without = [launch for launch in every if not (launch[2]["y_ptr"] == "bfloat16"
                                                  and launch[1]["NORMALIZED"] == "False")]
    done, total, missing = lc.coverage(without, ["xsa"])["xsa"]
    assert (done, total) == (total - 2, len(cases))
    assert missing == ["xsa_bwd[bf16: NORMALIZED=False]", "xsa_fwd[bf16: NORMALIZED=False]"]
    lines, failures = lc.summary({"xsa": (done, total, missing), "derf": (0, 1, ["derf_fwd[x]"])},
                                 allow={"derf: derf_fwd[x]"})
    assert failures == [f"xsa: {m}" for m in missing]  # the allow-listed one is counted, not failed
    assert any("1 more on the allow-list" in line for line in lines)


def test_an_allow_listed_configuration_that_ran_fails_until_its_line_goes():
    cov = {"xsa": (2, 3, ["xsa_fwd[bf16: NORMALIZED=False]"])}
    ran = "xsa: xsa_bwd[bf16: NORMALIZED=False]"
    _, failures = lc.summary(cov, allow={"xsa: xsa_fwd[bf16: NORMALIZED=False]", ran, "derf: derf_fwd[x]"})
    assert failures == [f"{ran}  (allow-listed but not missing: delete the line)"]  # other stems: not checked
    assert lc.summary(cov, allow={"xsa: xsa_fwd[bf16: NORMALIZED=False]"})[1] == []


def test_a_width_does_not_make_a_configuration_but_a_dtype_or_tile_does():
    configs = lc.static_configurations(["xsa", "shared_matrix"])
    case = next(iter(configs["xsa"].values()))[0]
    other_width = _launch(case, BLOCK_D=case.constexprs["BLOCK_D"] * 2)
    assert len(lc.coverage([other_width], ["xsa"])["xsa"][2]) == len(configs["xsa"]) - 1
    assert case.signature["y_ptr"] == "*fp32"
    wrong_dtype = (other_width[0], other_width[1], {k: "float16" for k in other_width[2]})
    missing = lc.coverage([wrong_dtype], ["xsa"])["xsa"][2]
    assert f"{case.name}[fp32: NORMALIZED={case.constexprs['NORMALIZED']}]" in missing
    tiled = next(c[0] for key, c in configs["shared_matrix"].items() if key[0] == "shared_matrix_fwd")
    other_tile = _launch(tiled, BLOCK_M=tiled.constexprs["BLOCK_M"] * 2)
    assert len(lc.coverage([other_tile], ["shared_matrix"])["shared_matrix"][2]) == len(configs["shared_matrix"])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records interpreted launches")
def test_the_recorder_sees_an_interpreted_launch():
    from laminae.triton_ops.xsa import xsa

    lc.install()
    session = set(lc._launches)  # what this session recorded so far (under --launch-coverage) stays
    lc._launches.clear()
    try:
        xsa(torch.randn(1, 3, 2, 8, dtype=torch.bfloat16), torch.randn(1, 3, 1, 8, dtype=torch.bfloat16))
        seen = [(fn, dict(c), dict(p)) for fn, c, p in lc._launches]
    finally:
        lc._launches.update(session)
    assert lc.coverage(seen, ["xsa"])["xsa"][0] == 1
