"""Hypothesis targets. ``FUZZ`` holds the settings every target shares; example counts come from
the profile chosen in tests/conftest.py."""

from hypothesis import HealthCheck, settings

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                      HealthCheck.too_slow])
