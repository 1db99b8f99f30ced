"""Importable reward-function plugins for tests: plugin:tests.fixtures_plugins.rewards:<fn>."""
