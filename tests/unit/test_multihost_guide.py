"""docs/several-machines.md is what the multi-host harness runs (tests.multihost.guide renders
it from the harness's hosts, commands and environments)."""

from pathlib import Path

from tests.multihost import guide

DOC = Path(__file__).resolve().parents[2] / "docs" / "several-machines.md"


def test_the_several_machines_guide_is_generated_from_the_harness():
    assert DOC.read_text() == guide.render(), (
        "docs/several-machines.md is stale: python -m tests.multihost.guide > "
        "docs/several-machines.md"
    )


def test_the_guide_names_every_host_and_hands_out_no_ca_key():
    text = guide.render()
    for host in ("10.77.0.1", "10.77.0.2", "10.77.0.3"):
        assert f"ASYNCRL_ADVERTISE_HOST={host}" in text
    assert "--nats-node" in text and "ca.key" not in text
