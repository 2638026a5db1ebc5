"""Tier modules written for the tests: each is held to the whole tier contract by ``tests/test_tier_contract.py``."""
