"""The scheduler lease's pure decisions (services/scheduler/leadership.py), a scheduler list's
gRPC target (asyncrl.grpcutil) and the supervisor's standby addresses."""

from __future__ import annotations

import socket

import pytest

from asyncrl.grpcutil import grpc_target
from asyncrl.supervisor.daemon import metrics_port_for, scheduler_addresses
from services.scheduler.leadership import LeaseValue, Sighting, act_until, holder_gone, may_take

ACTIVE = LeaseValue("host:10:50051-aaaaaa", epoch=4, renewed_unix_ms=1_000)


def test_lease_value_json_round_trip_keeps_every_field():
    value = LeaseValue("h:1:2-ab", epoch=7, renewed_unix_ms=123, released=True)
    assert LeaseValue.from_json(value.to_json()) == value


def test_may_take_no_lease_yet_true():
    assert may_take(None, Sighting(), now=0.0, ttl_s=3.0) is True


def test_may_take_released_lease_true_at_once():
    sighting = Sighting()
    sighting.see(9, now=100.0)
    released = LeaseValue(ACTIVE.holder, ACTIVE.epoch, ACTIVE.renewed_unix_ms, released=True)
    assert may_take(released, sighting, now=100.0, ttl_s=3.0) is True


@pytest.mark.parametrize("now, expected", [(100.0, False), (102.9, False), (103.0, True)])
def test_may_take_same_revision_for_ttl_true_only_after_ttl(now, expected):
    sighting = Sighting()
    sighting.see(9, now=100.0)
    sighting.see(9, now=101.0)  # seen again: the clock runs from the first sight
    assert may_take(ACTIVE, sighting, now=now, ttl_s=3.0) is expected


def test_may_take_renewed_revision_restarts_the_wait():
    sighting = Sighting()
    sighting.see(9, now=100.0)
    sighting.see(10, now=102.5)  # the active renewed
    assert (sighting.revision, sighting.since) == (10, 102.5)
    assert may_take(ACTIVE, sighting, now=104.0, ttl_s=3.0) is False
    assert may_take(ACTIVE, sighting, now=105.5, ttl_s=3.0) is True


def test_act_until_ends_before_a_standby_may_take_over():
    """The holder acts 2.5 s of a 3 s lease after its renewal began; a standby that saw the
    renewed revision at once waits the whole 3 s."""
    assert act_until(100.0, 3.0) == pytest.approx(102.5)
    sighting = Sighting()
    sighting.see(10, now=100.0)
    assert not may_take(ACTIVE, sighting, now=act_until(100.0, 3.0), ttl_s=3.0)


def fake_resolve(host, port, type):
    table = {"sched-a": "10.0.0.1", "sched-b": "10.0.0.2", "127.0.0.1": "127.0.0.1"}
    if host == "::1":
        return [(socket.AF_INET6, type, 6, "", ("::1", port, 0, 0))]
    return [(socket.AF_INET, type, 6, "", (table[host], port))]


def test_grpc_target_one_address_as_it_is():
    assert grpc_target("sched-a:50051", fake_resolve) == ("sched-a:50051", None)


def test_grpc_target_list_ipv4_target_first_host_checked():
    target = grpc_target("127.0.0.1:50051, 127.0.0.1:50052", fake_resolve)
    assert target == ("ipv4:127.0.0.1:50051,127.0.0.1:50052", "127.0.0.1")


def test_grpc_target_list_of_names_resolved_first_name_checked():
    target = grpc_target("sched-a:50051,sched-b:50051", fake_resolve)
    assert target == ("ipv4:10.0.0.1:50051,10.0.0.2:50051", "sched-a")


def test_grpc_target_ipv6_list_bracketed():
    assert grpc_target("[::1]:1,[::1]:2", fake_resolve) == ("ipv6:[::1]:1,[::1]:2", "::1")


def test_grpc_target_mixed_families_value_error_names_address():
    with pytest.raises(ValueError, match="mixes IPv4 and IPv6"):
        grpc_target("127.0.0.1:1,[::1]:2", fake_resolve)


@pytest.mark.parametrize(
    "standby, expected", [(False, "127.0.0.1:7000"), (True, "127.0.0.1:7000,127.0.0.1:7001")]
)
def test_scheduler_addresses_standby_adds_next_port(standby, expected):
    assert scheduler_addresses(7000, standby) == expected


def test_metrics_port_standby_scheduler_none_not_the_trainers():
    assert metrics_port_for("scheduler", 0, 9100) == 9100
    assert metrics_port_for("scheduler", 1, 9100) is None
    assert metrics_port_for("trainer", 0, 9100) == 9101


@pytest.mark.parametrize(
    "holder, expected",
    [
        ("h1:4242:50051-ab12cd", True),  # this host, the process is gone
        ("h1:77:50051-ab12cd", False),  # this host, alive (paused, say): wait out the lease
        ("h2:4242:50051-ab12cd", False),  # another host: only the lease tells
        ("garbage", False),
    ],
)
def test_holder_gone_only_a_dead_process_of_this_host(holder, expected):
    assert holder_gone(holder, "h1", alive=lambda pid: pid == 77) is expected


def test_may_take_holder_gone_true_at_once():
    sighting = Sighting()
    sighting.see(9, now=100.0)
    assert may_take(ACTIVE, sighting, now=100.0, ttl_s=3.0, gone=True) is True
