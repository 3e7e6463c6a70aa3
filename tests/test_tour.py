from laminae.triton_ops import tour


def test_tour_runs_and_reports_each_mechanism(capsys):
    assert tour.main(["laurel", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "laurel" in out and "within tolerance" in out
    assert "interpreter" in out or "compiled" in out


def test_tour_exits_nonzero_on_mismatch(monkeypatch, capsys):
    import importlib

    laurel = importlib.import_module("laminae.triton_ops.laurel")  # the kernel file, not the function

    original = laurel.tour_case

    def broken(device):
        case = original(device)
        op = case.op
        case.op = lambda **kw: op(**kw) * 1.01
        return case

    monkeypatch.setattr(laurel, "tour_case", broken)
    assert tour.main(["laurel", "--reps", "1"]) == 1
    assert "FAIL" in capsys.readouterr().out
