"""The scheduler's defaults are SchedulerConfig's, wherever they are taken."""

from __future__ import annotations

from services.scheduler.__main__ import parse_args
from services.scheduler.config import SchedulerConfig
from services.scheduler.registry import Registry


def test_command_line_defaults_are_the_config_defaults():
    args, config = parse_args([]), SchedulerConfig()
    got = (args.lease_ttl, args.heartbeat_interval, args.progress_timeout)
    assert got == (config.lease_ttl_s, config.heartbeat_interval_s, config.progress_timeout_s)
    assert args.trainer_poll_interval == config.trainer_poll_interval_s


def test_registry_defaults_are_the_config_defaults():
    registry, config = Registry(), SchedulerConfig()
    got = (registry.lease_ttl_s, registry.heartbeat_interval_s)
    assert got == (config.lease_ttl_s, config.heartbeat_interval_s) == (10.0, 1.0)
