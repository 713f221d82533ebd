"""Test infrastructure the tests import: helpers that are not tests themselves."""
