"""Benchmarks (run as scripts); ``benchmarks.zoo`` is also imported by the fusion tests."""
