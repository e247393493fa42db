import pytest

from plait.ir.diagnosis import Diagnosis, DiagnosisError, Finding


def test_round_trip_and_culprits():
    d = Diagnosis("runs/x", [Finding("slow_rank", (2,), 12.5, step=3, nodes=("n1",)),
                             Finding("slow_link", (0, 1), 20.0)], world_size=4)
    back = Diagnosis.from_dict(d.to_dict())
    assert back == d and back.to_dict()["format_version"] == 1
    assert back.culprit_ranks() == set() and not back.healthy  # a slow rank is reported, never isolated


def test_bad_kind_and_newer_version():
    with pytest.raises(DiagnosisError, match="finding kind"):
        Finding("slowish", (1,), 0.0)
    with pytest.raises(DiagnosisError, match="newer"):
        Diagnosis.from_dict({"format_version": 99}, "d.json")
