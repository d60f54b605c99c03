"""Helpers of the test suite (fixtures, statistical checks); never imported by production code."""
