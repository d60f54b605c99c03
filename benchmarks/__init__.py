"""Benchmarks (not tests): each prints ratios against baselines measured in the same run."""
